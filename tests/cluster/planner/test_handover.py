"""Restarts and node drains on plain data: one replica of a model at a time, a replacement first."""

from dataclasses import replace

from cluster.planner import (
    PENDING,
    READY,
    RESTART_QUEUED,
    RESTART_REPLACING,
    STARTING,
    Assign,
    Create,
    Drain,
    Fail,
    MarkReplacing,
    SetModelNote,
    SetNodeNote,
    Stop,
    Unplaceable,
    plan,
)
from tests.cluster.planner.snapshots import (
    NOW,
    GiB,
    apply,
    converge,
    creates,
    model,
    node,
    of,
    rep,
    replacing,
    snap,
    step,
)


def test_queued_replica_keeps_serving_while_a_replacement_starts_beside_it_then_drains():
    s = snap([node(1)], [model(1)], [rep(1, 1, 1, READY, restart=RESTART_QUEUED)])
    actions = plan(s)
    assert actions == [MarkReplacing(1, "restart queued"), Create(1, 1, None, 4 * GiB)]
    s = apply(s, actions)
    assert [r.restart for r in s.replicas] == [RESTART_REPLACING, "none"]
    starting = replace(s, replicas=(s.replicas[0], replace(s.replicas[1], state=STARTING)))
    assert plan(starting) == []  # the old one serves on until the new one is ready
    assert plan(s) == [Drain(1, "replaced by r2")]
    s = apply(s, plan(s))
    assert plan(replace(s, inflight={"r1": 2})) == []  # in-flight requests finish
    assert plan(s) == [Stop(1, "drained: idle")]


def test_a_queued_replica_that_is_not_ready_yet_is_replaced_and_stopped():
    s = snap([node(1)], [model(1)], [rep(1, 1, 1, STARTING, restart=RESTART_REPLACING), rep(2, 1, 1, READY)])
    assert plan(s) == [Stop(1, "replaced by r2")]


def test_replicas_of_one_model_are_replaced_one_at_a_time():
    nodes = [node(1), node(2), node(3)]
    replicas = [rep(i, 1, i, READY, restart=RESTART_QUEUED) for i in (1, 2, 3)]
    s = snap(nodes, [model(1, replicas=3)], replicas)
    marks = []
    for _ in range(40):
        actions = plan(s)
        if not actions:
            break
        marks += [a.replica_id for a in of(actions, MarkReplacing)]
        s = step(s)
        assert len(replacing(s)) <= 1
        assert len([r for r in s.replicas if r.state == READY]) >= 3
    assert marks == [1, 2, 3]  # oldest first
    assert {r.id for r in s.replicas} == {4, 5, 6} and all(r.restart == "none" for r in s.replicas)


def test_different_models_are_replaced_in_parallel():
    nodes = [node(1), node(2)]
    replicas = [rep(1, 1, 1, restart=RESTART_QUEUED), rep(2, 1, 2, restart=RESTART_QUEUED),
                rep(3, 2, 1, restart=RESTART_QUEUED), rep(4, 2, 2, restart=RESTART_QUEUED)]
    s = snap(nodes, [model(1, replicas=2), model(2, replicas=2)], replicas)
    assert of(plan(s), MarkReplacing) == [MarkReplacing(1, "restart queued"), MarkReplacing(3, "restart queued")]
    s = converge(s, {1, 2})
    assert all(r.id > 4 and r.restart == "none" for r in s.replicas)


def test_ready_replicas_are_replaced_before_the_rest_waits_for_the_model_to_be_ready():
    replicas = [rep(1, 1, 1, READY, restart=RESTART_QUEUED), rep(2, 1, 1, STARTING)]
    assert plan(snap([node(1)], [model(1, replicas=2)], replicas)) == []  # r2 is on its way: not now
    ready = [rep(1, 1, 1, READY, restart=RESTART_QUEUED), rep(2, 1, 1, READY)]
    assert of(plan(snap([node(1)], [model(1, replicas=2)], ready)), MarkReplacing) == [
        MarkReplacing(1, "restart queued")
    ]


def test_a_model_short_of_replicas_starts_no_restart():
    m = model(1, replicas=2)
    replicas = [rep(1, 1, 1, READY, restart=RESTART_QUEUED), rep(2, 1, None, PENDING, reason="no room")]
    actions = plan(snap([node(1, ram=5 * GiB)], [m], replicas))
    assert not of(actions, MarkReplacing) and not of(actions, Drain)


def test_no_room_for_a_second_copy_drains_the_old_one_first_and_says_so():
    s = snap([node(1, ram=6 * GiB)], [model(1)], [rep(1, 1, 1, READY, restart=RESTART_QUEUED)])
    actions = plan(s)
    reason = "needs 4.0 GiB RAM; the most free is 2.0 GiB on n1"
    assert actions == [
        MarkReplacing(1, "restart queued", room=False),
        Unplaceable(1, None, reason, 4 * GiB),
        Drain(1, "no room for a second copy: stopping it first, the new one starts in its place "
                 "(model m1 has no other ready replica meanwhile)", outage=True),
        SetModelNote(1, reason),
    ]
    s = apply(s, actions)
    assert plan(replace(s, inflight={"r1": 1})) == []  # it drains up to the grace; the new one waits
    s = step(s)  # idle: stopped
    assert plan(s) == [Assign(2, 1, None), SetModelNote(1, "")]  # the freed memory takes the new one
    s = apply(s, plan(s))
    assert plan(s) == [] and [r.id for r in s.replicas] == [2]


def test_no_room_outage_with_other_replicas_serving_says_only_no_room():
    replicas = [rep(1, 1, 1, READY, restart=RESTART_QUEUED), rep(2, 1, 2, READY)]
    s = snap([node(1, ram=6 * GiB), node(2, ram=6 * GiB)], [model(1, replicas=2)], replicas)
    drains = of(plan(s), Drain)
    assert drains == [Drain(1, "no room for a second copy: stopping it first, the new one starts in its place",
                            outage=True)]


def test_gpu_replica_without_room_for_a_second_copy_goes_first_on_its_own_gpu():
    s = snap([node(1, gpus=[8 * GiB, 2 * GiB])], [model(1, mem=6 * GiB, gpu=True)],
             [rep(1, 1, 1, READY, mem=6 * GiB, gpu=0, restart=RESTART_QUEUED)])
    assert of(plan(s), Drain) and of(plan(s), MarkReplacing)[0].room is False
    s = step(step(s))
    assert plan(s)[0] == Assign(2, 1, 0)


def test_restart_waits_when_the_new_copy_does_not_fit_even_in_its_place():
    # The model now wants more memory than the old replica holds, and no node has it.
    s = snap([node(1, ram=6 * GiB)], [model(1, mem=8 * GiB)], [rep(1, 1, 1, READY, restart=RESTART_QUEUED)])
    actions = plan(s)
    assert not of(actions, Drain) and not of(actions, Stop)
    assert of(actions, SetModelNote)[0].note.startswith("restart of replica r1 waits: no room for a second copy")
    s = apply(s, actions)
    assert plan(s) == []  # it keeps serving, quietly


def test_replicas_on_a_draining_node_move_elsewhere_one_at_a_time_replacement_first():
    nodes = [node(1, draining=True), node(2)]
    replicas = [rep(1, 1, 1), rep(2, 1, 1), rep(3, 2, 1)]
    s = snap(nodes, [model(1, replicas=2), model(2)], replicas)
    actions = plan(s)
    assert of(actions, MarkReplacing) == [MarkReplacing(1, "node n1 is draining"),
                                          MarkReplacing(3, "node n1 is draining")]
    assert {(a.model_id, a.node_id) for a in of(actions, Create)} == {(1, 2), (2, 2)}
    s = converge(s, {1, 2})
    assert {r.node_id for r in s.replicas} == {2} and len(s.replicas) == 3
    assert not of(plan(s), SetNodeNote)


def test_drain_with_nowhere_else_to_go_is_blocked_and_leaves_the_replica_serving():
    s = snap([node(1, draining=True), node(2, ram=2 * GiB)], [model(1)], [rep(1, 1, 1)])
    actions = plan(s)
    why = "needs 4.0 GiB RAM; the most free is 2.0 GiB on n2"
    assert actions == [
        MarkReplacing(1, "node n1 is draining"),
        Unplaceable(1, None, why, 4 * GiB),
        SetModelNote(1, f"drain of node n1 is blocked for replica r1: nowhere else to go ({why})"),
        SetNodeNote(1, f"replica r1 has nowhere else to go ({why})"),
    ]
    s = apply(s, actions)
    assert plan(s) == []  # stays blocked, serving; nothing rewritten
    assert next(r for r in s.replicas if r.id == 1).state == READY
    # room appears elsewhere: the replacement goes there, then the old one drains
    s = replace(s, nodes=(s.nodes[0], replace(s.nodes[1], memory_bytes=8 * GiB)))
    s = converge(s, set())
    assert [(r.id, r.node_id) for r in s.replicas] == [(2, 2)]
    assert not s.nodes[0].drain_note and not s.models[0].placement_note


def test_forced_drain_stops_a_replica_with_nowhere_else_to_go():
    nodes = [node(1, draining=True, drain_force=True), node(2, ram=2 * GiB)]
    s = snap(nodes, [model(1, replicas=2)], [rep(1, 1, 1), rep(2, 1, 1)])
    actions = plan(s)
    why = "needs 4.0 GiB RAM; the most free is 2.0 GiB on n2"
    assert of(actions, Drain) == [Drain(1, f"node n1 drained with force: nowhere else to go ({why})", outage=True)]
    assert not of(actions, SetNodeNote)
    for _ in range(10):
        s = step(s)
    # one at a time, both gone; the model waits, unplaced, for room
    assert [(r.node_id, r.state) for r in s.replicas] == [(None, PENDING), (None, PENDING)]


def test_drain_waits_for_a_model_short_of_replicas_and_says_why():
    nodes = [node(1, draining=True), node(2, ram=2 * GiB)]
    replicas = [rep(1, 1, 1), rep(2, 1, None, PENDING, reason="needs 4.0 GiB RAM; the most free is 2.0 GiB on n2")]
    actions = plan(snap(nodes, [model(1, replicas=2, placement_note=replicas[1].reason)], replicas))
    assert actions == [
        SetNodeNote(1, "replica r1 waits: model m1 is short of replicas "
                       "(needs 4.0 GiB RAM; the most free is 2.0 GiB on n2)")
    ]


def test_node_note_cleared_once_it_is_not_draining():
    assert plan(snap([node(1, drain_note="replica r1 has nowhere else to go")], [])) == [SetNodeNote(1, "")]


def test_restart_markers_are_moot_when_serving_stopped_or_the_model_removed():
    replicas = [rep(1, 1, 1, restart=RESTART_QUEUED), rep(2, 1, 2, restart=RESTART_QUEUED)]
    nodes = [node(1, draining=True), node(2)]
    for s in (snap(nodes, [model(1, replicas=2)], replicas, serving_stopped=True),
              snap(nodes, [model(1, replicas=2, removing=True)], replicas)):
        actions = plan(s)
        assert set(actions) == {Drain(1, "surplus: model wants 0"), Drain(2, "surplus: model wants 0")}


def test_surplus_takes_replicas_to_be_replaced_first():
    replicas = [rep(1, 1, 1, restart=RESTART_QUEUED), rep(2, 1, 2), rep(3, 1, 2), rep(4, 1, 3)]
    actions = plan(snap([node(1), node(2), node(3, draining=True)], [model(1, replicas=2)], replicas))
    assert set(actions) == {Drain(1, "surplus: model wants 2"), Drain(4, "surplus: model wants 2")}


def test_replaced_replica_lost_with_its_node_does_not_block_the_model():
    nodes = [node(1, connected=False, seen=NOW - 100), node(2)]
    replicas = [rep(1, 1, 1, restart=RESTART_REPLACING), rep(2, 1, 2, STARTING)]
    actions = plan(snap(nodes, [model(1)], replicas))
    assert actions == [Fail(1, "node n1 lost")]


def test_a_restart_ends_as_spread_as_it_began():
    # two replicas on a large and a small node; the one on the small node is the older, so it goes first
    nodes = [node(1, "big", ram=32 * GiB), node(2, "small", ram=16 * GiB)]
    replicas = [rep(1, 1, 2, restart=RESTART_QUEUED), rep(2, 1, 1, restart=RESTART_QUEUED)]
    s = converge(snap(nodes, [model(1, replicas=2)], replicas), {1})
    assert sorted(r.node_id for r in s.replicas) == [1, 2]
    assert {r.id for r in s.replicas}.isdisjoint({1, 2}) and all(r.restart == "none" for r in s.replicas)


def test_a_replacement_is_placed_by_the_spread_rule_not_beside_a_replica_that_is_leaving():
    # the replica being replaced does not hold its node for the model: the empty node gets the new one
    # (bin-packing alone would pick the fuller node a, where the model's other replica runs)
    nodes = [node(1, "a", ram=16 * GiB), node(2, "b", ram=32 * GiB)]
    s = snap(nodes, [model(1, replicas=2)], [rep(1, 1, 2, restart=RESTART_QUEUED), rep(2, 1, 1)])
    actions = plan(s)
    assert of(actions, MarkReplacing) == [MarkReplacing(1, "restart queued")]
    assert creates(actions) == [(1, 2, None)]  # b: it holds nothing of the model once r1 has gone
