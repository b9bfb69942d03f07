"""Surplus and drains on plain data; serving stopped and models removed."""

from dataclasses import replace

from cluster.planner import (
    DOWNLOADING,
    DRAINING,
    PENDING,
    READY,
    RESTART_QUEUED,
    RESTART_REPLACING,
    STARTING,
    STOPPED,
    STOPPING,
    DeleteModel,
    Drain,
    SetModelNote,
    Stop,
    plan,
)
from tests.cluster.planner.snapshots import (
    NOW,
    apply,
    creates,
    model,
    node,
    rep,
    snap,
)

# --- surplus -------------------------------------------------------------------------------------------------


def test_surplus_removes_unplaced_first():
    nodes = [node(1), node(2)]
    replicas = [rep(1, 1, 1, READY), rep(2, 1, 2, STARTING, changed=5), rep(3, 1, None, PENDING, reason="x")]
    actions = plan(snap(nodes, [model(1, replicas=2)], replicas))
    assert actions == [Stop(3, "surplus: model wants 2")]


def test_surplus_then_not_ready_newest_first():
    nodes = [node(1), node(2), node(3)]
    replicas = [
        rep(1, 1, 1, READY, changed=1),
        rep(2, 1, 2, DOWNLOADING, changed=5),
        rep(3, 1, 3, STARTING, changed=9),
        rep(4, 1, 1, PENDING, changed=7),
    ]
    actions = plan(snap(nodes, [model(1, replicas=2)], replicas))
    assert actions == [Stop(3, "surplus: model wants 2"), Stop(4, "surplus: model wants 2")]


def test_surplus_then_drains_ready_from_the_most_loaded_node_newest_first():
    nodes = [node(1), node(2), node(3)]
    replicas = [
        rep(1, 1, 1, READY, changed=1),
        rep(2, 1, 1, READY, changed=3),
        rep(3, 1, 1, READY, changed=2),
        rep(4, 1, 2, READY, changed=9),
        rep(5, 1, 3, STARTING, changed=0),
    ]
    actions = plan(snap(nodes, [model(1, replicas=2)], replicas))
    why = "surplus: model wants 2"
    # the starting one first, then n1 (3 replicas) newest first; then n1 and n2 hold 2 and 1
    assert actions == [Stop(5, why), Drain(2, why), Drain(3, why)]


def test_surplus_ignores_replicas_being_replaced_and_others_outside_the_count():
    nodes = [node(1), node(2)]
    replicas = [
        rep(1, 1, 1, READY, restart=RESTART_REPLACING),
        rep(2, 1, 2, READY),
        rep(3, 1, 1, DRAINING, changed=NOW),
        rep(4, 1, 2, STOPPING),
    ]
    actions = plan(snap(nodes, [model(1, replicas=1)], replicas, inflight={"r3": 2}))
    # No surplus: the replica being replaced is not removed as surplus; its replacement (r2) is ready, so it
    # is handed over instead.
    assert actions == [Drain(1, "replaced by r2")]


def test_replica_being_replaced_stops_counting_so_a_replacement_is_placed():
    nodes = [node(1, "a"), node(2, "b")]
    replicas = [rep(1, 1, 1, READY, restart=RESTART_REPLACING), rep(2, 1, 2, READY, restart=RESTART_QUEUED)]
    actions = plan(snap(nodes, [model(1, replicas=2)], replicas))
    assert len(creates(actions)) == 1


# --- draining -----------------------------------------------------------------------------------------------


def test_draining_replica_stops_when_idle():
    s = snap([node(1)], [model(1, replicas=0)], [rep(1, 1, 1, DRAINING, changed=NOW - 1, name="m1-aa")],
             inflight={"m1-aa": 0})
    assert plan(s) == [Stop(1, "drained: idle")]
    assert plan(replace(s, inflight={})) == [Stop(1, "drained: idle")]


def test_draining_replica_waits_while_busy_then_stops_after_the_grace():
    r = rep(1, 1, 1, DRAINING, changed=NOW - 299, name="m1-aa")
    s = snap([node(1)], [model(1, replicas=0)], [r], inflight={"m1-aa": 3}, drain_grace=300.0)
    assert plan(s) == []
    later = replace(s, now=NOW + 1)
    assert plan(later) == [Stop(1, "drain grace of 300s passed")]


def test_draining_replica_of_a_model_that_still_wants_replicas():
    # e.g. a replaced replica draining while its replacement serves
    replicas = [rep(1, 1, 1, DRAINING, changed=NOW, name="old"), rep(2, 1, 1, READY, name="new")]
    s = snap([node(1)], [model(1, replicas=1)], replicas, inflight={"old": 1})
    assert plan(s) == []
    assert plan(replace(s, inflight={"old": 0})) == [Stop(1, "drained: idle")]


# --- stopping everything and removing models --------------------------------------------------------------


def test_serving_stopped_drains_ready_and_stops_the_rest():
    nodes = [node(1), node(2)]
    replicas = [
        rep(1, 1, 1, READY),
        rep(2, 1, 2, STARTING),
        rep(3, 1, None, PENDING),
        rep(4, 2, 1, READY, restart=RESTART_REPLACING),
        rep(5, 2, 2, DRAINING, changed=NOW),
        rep(6, 2, 2, STOPPING),
    ]
    models = [model(1, replicas=2), model(2, replicas=1, placement_note="stale")]
    actions = plan(snap(nodes, models, replicas, serving_stopped=True, inflight={"r5": 1}))
    assert set(actions) == {
        Stop(3, "surplus: model wants 0"),
        Stop(2, "surplus: model wants 0"),
        Drain(1, "surplus: model wants 0"),
        Drain(4, "surplus: model wants 0"),
        SetModelNote(2, ""),
    }
    assert not creates(actions)


def test_serving_stopped_converges_to_nothing_running():
    nodes = [node(1), node(2)]
    s = snap(nodes, [model(1, replicas=3), model(2, replicas=2)])
    s = apply(s, plan(s))
    assert len(s.replicas) == 5
    s = replace(s, serving_stopped=True)
    for _ in range(4):
        s = apply(s, plan(s))
    assert all(r.state == STOPPING for r in s.replicas)
    s = replace(s, serving_stopped=False, replicas=())  # the agents report them stopped
    assert len(creates(plan(s))) == 5


def test_removing_model_stops_its_replicas_then_is_deleted():
    nodes = [node(1)]
    m = model(1, replicas=2, removing=True)
    s = snap(nodes, [m], [rep(1, 1, 1, READY), rep(2, 1, 1, PENDING), rep(3, 1, None, PENDING)])
    actions = plan(s)
    assert set(actions) == {Stop(3, "surplus: model wants 0"), Stop(2, "surplus: model wants 0"),
                            Drain(1, "surplus: model wants 0")}
    s = apply(s, actions)
    assert {r.state for r in s.replicas} == {STOPPING, DRAINING}
    assert plan(replace(s, inflight={"r1": 1})) == []  # still draining, stopping: not yet
    s = apply(s, plan(s))  # idle: the drain ends
    assert plan(s) == []  # stopping: the agent has not confirmed yet
    s = replace(s, replicas=tuple(replace(r, state=STOPPED) for r in s.replicas))
    assert plan(s) == [DeleteModel(1)]
    assert plan(replace(s, replicas=())) == [DeleteModel(1)]


def test_model_with_zero_replicas_is_not_deleted():
    assert plan(snap([node(1)], [model(1, replicas=0)])) == []


def test_orphan_replicas_are_stopped():
    actions = plan(snap([node(1)], [], [rep(1, 99, 1, READY), rep(2, 99, 1, DRAINING, changed=NOW)],
                        inflight={"r2": 1}))
    assert actions == [Stop(1, "its model is gone")]
