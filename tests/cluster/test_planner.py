"""The planner on plain data: no database, no clock, no network."""

import math
import random
import time
from dataclasses import replace

from cluster.planner import (
    DOWNLOADING,
    DRAINING,
    FAILED,
    PENDING,
    READY,
    RESTART_QUEUED,
    RESTART_REPLACING,
    STARTING,
    STOPPED,
    STOPPING,
    Assign,
    Create,
    DeleteModel,
    Drain,
    Fail,
    MarkNodeDisconnected,
    MarkReplacing,
    MarkStopped,
    ModelView,
    NodeView,
    ReplicaView,
    SetModelNote,
    SetNodeNote,
    Snapshot,
    Stop,
    Unplaceable,
    format_bytes,
    plan,
)

GiB = 1024**3
MiB = 1024**2
NOW = 10_000.0


def node(id, name=None, *, connected=True, seen=NOW - 1, schedulable=True, draining=False, engines=("llama.cpp",),
         ram=64 * GiB, gpus=(), **kw):
    return NodeView(id=id, name=name or f"n{id}", connected=connected, last_seen=seen, schedulable=schedulable,
                    draining=draining, engines=frozenset(engines), memory_bytes=ram, gpus=tuple(gpus), **kw)


def model(id, name=None, *, replicas=1, mem=4 * GiB, engine="llama.cpp", gpu=False, **kw):
    return ModelView(id=id, name=name or f"m{id}", replicas=replicas, memory_bytes=mem, engine_kind=engine,
                     uses_gpu=gpu, **kw)


def rep(id, model_id, node_id, state=READY, *, mem=4 * GiB, gpu=None, changed=0.0, name=None, **kw):
    return ReplicaView(id=id, name=name or f"r{id}", model_id=model_id, node_id=node_id, state=state,
                       memory_bytes=mem, gpu_index=gpu, state_changed_at=changed, **kw)


def snap(nodes=(), models=(), replicas=(), **kw):
    return Snapshot(now=NOW, nodes=tuple(nodes), models=tuple(models), replicas=tuple(replicas), **kw)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def creates(actions):
    return [(a.model_id, a.node_id, a.gpu_index) for a in of(actions, Create)]


def apply(s, actions):
    """A tiny stand-in for the reconciler: the snapshot after the actions, with every placement ready."""
    reps = {r.id: r for r in s.replicas}
    nodes = {n.id: n for n in s.nodes}
    models = {m.id: m for m in s.models}
    next_id = max(reps, default=0) + 1
    for a in actions:
        if isinstance(a, Create):
            reps[next_id] = rep(next_id, a.model_id, a.node_id, READY, mem=a.memory_bytes, gpu=a.gpu_index,
                                changed=s.now)
            next_id += 1
        elif isinstance(a, Unplaceable) and a.replica_id is None:
            reps[next_id] = rep(next_id, a.model_id, None, PENDING, mem=a.memory_bytes, reason=a.reason, changed=s.now)
            next_id += 1
        elif isinstance(a, Unplaceable):
            reps[a.replica_id] = replace(reps[a.replica_id], reason=a.reason)
        elif isinstance(a, Assign):
            reps[a.replica_id] = replace(reps[a.replica_id], node_id=a.node_id, gpu_index=a.gpu_index, state=READY)
        elif isinstance(a, Drain):
            reps[a.replica_id] = replace(reps[a.replica_id], state=DRAINING, state_changed_at=s.now)
        elif isinstance(a, Stop):
            r = reps[a.replica_id]
            reps[a.replica_id] = replace(r, state=STOPPING if r.node_id is not None else STOPPED)
        elif isinstance(a, (Fail, MarkStopped)):
            reps[a.replica_id] = replace(reps[a.replica_id], state=FAILED if isinstance(a, Fail) else STOPPED)
        elif isinstance(a, MarkNodeDisconnected):
            nodes[a.node_id] = replace(nodes[a.node_id], connected=False)
        elif isinstance(a, SetModelNote):
            models[a.model_id] = replace(models[a.model_id], placement_note=a.note)
        elif isinstance(a, MarkReplacing):
            reps[a.replica_id] = replace(reps[a.replica_id], restart=RESTART_REPLACING)
        elif isinstance(a, SetNodeNote):
            nodes[a.node_id] = replace(nodes[a.node_id], drain_note=a.note)
        elif isinstance(a, DeleteModel):
            del models[a.model_id]
    live = tuple(r for r in reps.values() if r.state not in (STOPPED, FAILED))
    return replace(s, nodes=tuple(nodes.values()), models=tuple(models.values()), replicas=live)


# --- placement ---------------------------------------------------------------------------------------------


def test_places_missing_replicas_and_is_quiet_once_placed():
    s = snap([node(1)], [model(1, replicas=2)])
    actions = plan(s)
    assert creates(actions) == [(1, 1, None), (1, 1, None)]
    assert of(actions, Create)[0].memory_bytes == 4 * GiB
    assert plan(apply(s, actions)) == []


def test_spreads_across_nodes_before_stacking():
    nodes = [node(1, ram=100 * GiB), node(2, ram=10 * GiB), node(3, ram=10 * GiB)]
    actions = plan(snap(nodes, [model(1, replicas=4)]))
    placed = [c[1] for c in creates(actions)]
    assert sorted(placed[:3]) == [1, 2, 3]
    # the fourth stacks on the node with a replica and the least room left after it: n2 or n3 (6 GiB free -> 2)
    assert placed[3] == 2


def test_spread_counts_existing_replicas_of_the_model_only():
    nodes = [node(1, ram=16 * GiB), node(2, ram=64 * GiB)]
    existing = [rep(1, 1, 1), rep(2, 2, 2)]  # n1 holds m1; n2 holds another model
    actions = plan(snap(nodes, [model(1, replicas=2), model(2)], existing))
    assert creates(actions) == [(1, 2, None)]


def test_bin_packs_onto_the_fullest_node_that_fits():
    nodes = [node(1, "a", ram=64 * GiB), node(2, "b", ram=8 * GiB), node(3, "c", ram=5 * GiB),
             node(4, "d", ram=3 * GiB)]
    assert creates(plan(snap(nodes, [model(1)]))) == [(1, 3, None)]


def test_bin_pack_ties_go_by_name():
    nodes = [node(1, "zeta", ram=8 * GiB), node(2, "alpha", ram=8 * GiB)]
    assert creates(plan(snap(nodes, [model(1)]))) == [(1, 2, None)]


def test_counts_memory_of_running_and_stopping_replicas_not_terminal_ones():
    nodes = [node(1, "a", ram=10 * GiB), node(2, "b", ram=12 * GiB)]
    other = model(2, replicas=1, mem=4 * GiB)
    # On a: 4 GiB stopping + 4 GiB draining = 8 used, 2 free: m1 (4 GiB) no longer fits there.
    replicas = [rep(1, 2, 1, STOPPING), rep(2, 2, 1, DRAINING, changed=NOW), rep(3, 2, 1, STOPPED), rep(4, 2, 1, READY)]
    actions = plan(snap(nodes, [model(1), other], replicas, inflight={"r2": 1}))
    assert creates(actions) == [(1, 2, None)]


def test_later_placements_see_earlier_ones():
    nodes = [node(1, "a", ram=6 * GiB), node(2, "b", ram=6 * GiB)]
    actions = plan(snap(nodes, [model(1, "first"), model(2, "second"), model(3, "third")]))
    assert creates(actions) == [(1, 1, None), (2, 2, None)]
    assert of(actions, Unplaceable)[0].model_id == 3


def test_gpu_model_needs_one_gpus_memory_not_the_sum():
    nodes = [node(1, "g", engines=["vllm"], ram=512 * GiB, gpus=[16 * GiB, 16 * GiB])]
    actions = plan(snap(nodes, [model(1, mem=24 * GiB, engine="vllm", gpu=True)]))
    assert creates(actions) == []
    [u] = of(actions, Unplaceable)
    assert u.reason == "needs 24.0 GiB on one GPU; the most free is 16.0 GiB on g GPU 0"
    assert u.replica_id is None and u.memory_bytes == 24 * GiB


def test_gpu_model_goes_to_the_fullest_gpu_that_fits():
    nodes = [node(1, "g", engines=["vllm"], gpus=[80 * GiB, 24 * GiB, 40 * GiB, 24 * GiB])]
    actions = plan(snap(nodes, [model(1, mem=20 * GiB, engine="vllm", gpu=True)]))
    assert creates(actions) == [(1, 1, 1)]


def test_gpu_memory_in_use_is_per_gpu():
    nodes = [node(1, "g", engines=["vllm"], gpus=[24 * GiB, 24 * GiB])]
    existing = [rep(1, 2, 1, READY, mem=20 * GiB, gpu=0)]
    models = [model(1, mem=10 * GiB, engine="vllm", gpu=True), model(2, mem=20 * GiB, engine="vllm", gpu=True)]
    assert creates(plan(snap(nodes, models, existing))) == [(1, 1, 1)]


def test_gpu_replicas_do_not_use_ram_and_cpu_replicas_do_not_use_gpus():
    nodes = [node(1, "g", engines=["vllm", "llama.cpp"], ram=8 * GiB, gpus=[8 * GiB])]
    models = [model(1, "cpu", mem=8 * GiB), model(2, "gpu", mem=8 * GiB, engine="vllm", gpu=True)]
    assert creates(plan(snap(nodes, models))) == [(1, 1, None), (2, 1, 0)]


def test_cpu_model_fits_in_ram():
    nodes = [node(1, "n1", ram=1 * GiB)]
    [u] = of(plan(snap(nodes, [model(1, mem=2 * GiB)])), Unplaceable)
    assert u.reason == "needs 2.0 GiB RAM; the most free is 1.0 GiB on n1"


def test_gpu_engine_without_gpus_is_unplaceable():
    nodes = [node(1, engines=["vllm"])]
    [u] = of(plan(snap(nodes, [model(1, engine="vllm", gpu=True)])), Unplaceable)
    assert u.reason == "no connected, schedulable node with engine vllm has a GPU"


def test_only_connected_schedulable_undrained_nodes_with_the_engine_take_replicas():
    nodes = [
        node(1, "off", connected=False, seen=NOW - 5),
        node(2, "silent", seen=NOW - 100),
        node(3, "cordoned", schedulable=False),
        node(4, "draining", draining=True),
        node(5, "other-engine", engines=["vllm"]),
        node(6, "never", connected=False, seen=None),
        node(7, "good", ram=128 * GiB),
    ]
    actions = plan(snap(nodes, [model(1, replicas=3)]))
    assert {c[1] for c in creates(actions)} == {7}
    assert len(creates(actions)) == 3


def test_allowed_nodes_constrain_placement():
    nodes = [node(1, "a", ram=8 * GiB), node(2, "b", ram=64 * GiB), node(3, "c", ram=5 * GiB)]
    actions = plan(snap(nodes, [model(1, replicas=2, nodes=frozenset({"a", "b"}))]))
    assert creates(actions) == [(1, 1, None), (1, 2, None)]


# --- reasons -------------------------------------------------------------------------------------------


def reason_for(nodes, m):
    actions = plan(snap(nodes, [m]))
    [u] = of(actions, Unplaceable)
    assert SetModelNote(m.id, u.reason) in actions
    return u.reason


def test_reason_no_node_connected():
    assert reason_for([], model(1)) == "no node is connected"
    assert reason_for([node(1, connected=False)], model(1)) == "no node is connected"


def test_reason_allowed_nodes_not_connected():
    nodes = [node(1, "a", connected=False), node(2, "c")]
    assert reason_for(nodes, model(1, nodes=frozenset({"b", "a"}))) == "allowed nodes (a, b) are not connected"


def test_reason_unschedulable_or_draining():
    nodes = [node(1, "a", schedulable=False), node(2, "b", draining=True)]
    assert reason_for(nodes, model(1)) == "every connected node is unschedulable or draining"
    assert (
        reason_for(nodes + [node(3, "c")], model(1, nodes=frozenset({"a", "b"})))
        == "no allowed node (a, b) is connected, schedulable and not draining"
    )


def test_reason_engine_missing():
    nodes = [node(1, "a"), node(2, "b", schedulable=False, engines=["xllamacpp"])]
    assert reason_for(nodes, model(1, engine="xllamacpp")) == "no connected, schedulable node has engine xllamacpp"
    assert (
        reason_for(nodes + [node(3, "c", engines=["xllamacpp"])], model(1, engine="xllamacpp", nodes=frozenset({"a"})))
        == "no connected, schedulable allowed node (a) has engine xllamacpp"
    )


def test_reason_memory_names_the_node_with_the_most_free():
    nodes = [node(1, "a", ram=1 * GiB), node(2, "b", ram=3 * GiB), node(3, "c", ram=3 * GiB),
             node(4, "d", ram=99 * GiB, connected=False)]
    assert reason_for(nodes, model(1, mem=4 * GiB)) == "needs 4.0 GiB RAM; the most free is 3.0 GiB on b"
    assert (
        reason_for(nodes, model(1, mem=4 * GiB, nodes=frozenset({"a", "c"})))
        == "needs 4.0 GiB RAM; the most free is 3.0 GiB on c"
    )


def test_reason_gpu_memory():
    nodes = [node(1, "gpu-1", engines=["vllm"], gpus=[16 * GiB, 8 * GiB]),
             node(2, "gpu-2", engines=["vllm"], gpus=[12 * GiB])]
    assert (
        reason_for(nodes, model(1, mem=24 * GiB, engine="vllm", gpu=True))
        == "needs 24.0 GiB on one GPU; the most free is 16.0 GiB on gpu-1 GPU 0"
    )


def test_format_bytes():
    assert format_bytes(24 * GiB) == "24.0 GiB"
    assert format_bytes(int(1.5 * GiB)) == "1.5 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(0) == "0.0 MiB"


def test_reason_in_mib_below_one_gib():
    nodes = [node(1, "a", ram=256 * MiB)]
    assert reason_for(nodes, model(1, mem=512 * MiB)) == "needs 512.0 MiB RAM; the most free is 256.0 MiB on a"


# --- unplaced replicas and the model's note --------------------------------------------------------------


def test_unplaced_replica_is_assigned_when_room_appears():
    m = model(1, replicas=1, placement_note="needs 4.0 GiB RAM; the most free is 1.0 GiB on a")
    pending = rep(5, 1, None, PENDING, reason=m.placement_note)
    actions = plan(snap([node(1, "a", ram=8 * GiB)], [m], [pending]))
    assert actions == [Assign(5, 1, None), SetModelNote(1, "")]


def test_unplaced_replica_reason_updated_only_when_it_changes():
    reason = "needs 4.0 GiB RAM; the most free is 1.0 GiB on a"
    m = model(1, replicas=1, placement_note=reason)
    s = snap([node(1, "a", ram=1 * GiB)], [m], [rep(5, 1, None, PENDING, reason=reason)])
    assert plan(s) == []  # nothing new to say
    s2 = replace(s, nodes=(node(1, "a", ram=2 * GiB),))
    new = "needs 4.0 GiB RAM; the most free is 2.0 GiB on a"
    assert plan(s2) == [Unplaceable(1, 5, new), SetModelNote(1, new)]


def test_unplaceable_creates_pending_replicas_then_stays_quiet():
    s = snap([node(1, "a", ram=1 * GiB)], [model(1, replicas=2, mem=2 * GiB)])
    actions = plan(s)
    reason = "needs 2.0 GiB RAM; the most free is 1.0 GiB on a"
    assert actions == [
        Unplaceable(1, None, reason, memory_bytes=2 * GiB),
        Unplaceable(1, None, reason, memory_bytes=2 * GiB),
        SetModelNote(1, reason),
    ]
    after = apply(s, actions)
    assert plan(after) == []  # the pending replicas count: no more are created
    # room appears: both are assigned, the note clears
    bigger = replace(after, nodes=(node(1, "a", ram=8 * GiB),))
    actions = plan(bigger)
    assert [type(a) for a in actions] == [Assign, Assign, SetModelNote]
    assert actions[-1] == SetModelNote(1, "")


def test_some_placed_some_not():
    s = snap([node(1, "a", ram=5 * GiB)], [model(1, replicas=2)])
    actions = plan(s)
    reason = "needs 4.0 GiB RAM; the most free is 1.0 GiB on a"
    assert actions == [Create(1, 1, None, 4 * GiB), Unplaceable(1, None, reason, 4 * GiB), SetModelNote(1, reason)]


def test_note_cleared_when_nothing_is_missing():
    m = model(1, replicas=1, placement_note="old news")
    assert plan(snap([node(1)], [m], [rep(1, 1, 1)])) == [SetModelNote(1, "")]


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


# --- failures and back-off ----------------------------------------------------------------------------------


BACKOFF_NOTE = "backing off after 3 failures; next try at " + time.strftime("%H:%M:%S", time.gmtime(math.ceil(NOW + 42.5))) + " UTC"


def test_no_placement_while_backing_off():
    m = model(1, replicas=2, failures=3, backoff_until=NOW + 42.5)
    actions = plan(snap([node(1)], [m], [rep(1, 1, None, PENDING)]))
    assert actions == [SetModelNote(1, BACKOFF_NOTE)]


def test_back_off_note_not_repeated():
    note = BACKOFF_NOTE
    m = model(1, replicas=2, failures=3, backoff_until=NOW + 42.5, placement_note=note)
    assert plan(snap([node(1)], [m])) == []


def test_placement_after_the_back_off():
    note = "backing off after 3 failures; next try at 00:00:00 UTC"
    m = model(1, replicas=1, failures=3, backoff_until=NOW, placement_note=note)
    assert plan(snap([node(1)], [m])) == [Create(1, 1, None, 4 * GiB), SetModelNote(1, "")]


def test_back_off_does_not_matter_when_nothing_is_missing():
    m = model(1, replicas=1, failures=3, backoff_until=NOW + 100)
    assert plan(snap([node(1)], [m], [rep(1, 1, 1)])) == []


# --- nodes coming and going --------------------------------------------------------------------------------


def test_silent_node_is_marked_disconnected():
    s = snap([node(1, "a", seen=NOW - 20)], [], node_tolerance=15.0)
    assert plan(s) == [MarkNodeDisconnected(1, "no word from the agent for 20s")]
    assert plan(snap([node(1, "a", seen=NOW - 15)], [], node_tolerance=15.0)) == []
    # once marked, not again
    assert plan(snap([node(1, "a", connected=False, seen=NOW - 20)], [])) == []


def test_silent_node_takes_no_new_replica():
    s = snap([node(1, "a", seen=NOW - 20, ram=999 * GiB), node(2, "b")], [model(1)], node_tolerance=15.0)
    actions = plan(s)
    assert actions[0] == MarkNodeDisconnected(1, "no word from the agent for 20s")
    assert creates(actions) == [(1, 2, None)]


def test_replicas_on_a_node_within_the_grace_still_count():
    nodes = [node(1, "a", connected=False, seen=NOW - 30), node(2, "b")]
    replicas = [rep(1, 1, 1, READY), rep(2, 1, 1, STOPPING), rep(3, 1, 1, DRAINING, changed=NOW)]
    s = snap(nodes, [model(1, replicas=1)], replicas, node_lost_grace=60.0, inflight={"r3": 1})
    assert plan(s) == []  # no duplicate placed, nothing failed


def test_replicas_on_a_lost_node_fail_and_are_replaced_elsewhere_at_once():
    nodes = [node(1, "a", seen=NOW - 61), node(2, "b")]
    replicas = [rep(1, 1, 1, READY), rep(2, 2, 1, STOPPING), rep(3, 1, 1, DRAINING, changed=NOW)]
    s = snap(nodes, [model(1, replicas=1), model(2, replicas=0)], replicas, node_tolerance=15.0,
             node_lost_grace=60.0, inflight={"r3": 1})
    actions = plan(s)
    assert actions == [
        MarkNodeDisconnected(1, "no word from the agent for 61s"),
        Fail(1, "node a lost"),
        MarkStopped(2, "node a lost"),
        Fail(3, "node a lost"),
        Create(1, 2, None, 4 * GiB),
    ]


def test_lost_node_frees_no_memory_for_itself_and_takes_nothing():
    nodes = [node(1, "a", connected=False, seen=None)]
    actions = plan(snap(nodes, [model(1)], [rep(1, 1, 1, STARTING)]))
    assert actions[0] == Fail(1, "node a lost")
    assert of(actions, Unplaceable)[0].reason == "no node is connected"


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


# --- determinism and agreement with a plain reference ---------------------------------------------------


def random_snapshot(seed, n_nodes=12, n_models=8):
    rnd = random.Random(seed)
    nodes = []
    for i in range(1, n_nodes + 1):
        engines = rnd.sample(["llama.cpp", "vllm", "xllamacpp"], rnd.randint(1, 2))
        nodes.append(node(i, f"n{i:02d}", connected=rnd.random() > 0.1, seen=NOW - rnd.choice([1, 1, 1, 30, 100]),
                          schedulable=rnd.random() > 0.1, draining=rnd.random() < 0.1, engines=engines,
                          ram=rnd.choice([8, 16, 32]) * GiB,
                          gpus=[rnd.choice([8, 16, 24]) * GiB for _ in range(rnd.randint(0, 3))]))
    models = []
    for j in range(1, n_models + 1):
        engine = rnd.choice(["llama.cpp", "vllm", "xllamacpp"])
        allowed = frozenset(rnd.sample([n.name for n in nodes], 3)) if rnd.random() < 0.3 else frozenset()
        models.append(model(j, f"m{j}", replicas=rnd.randint(0, 6), mem=rnd.choice([2, 4, 6, 10]) * GiB, engine=engine,
                            gpu=engine == "vllm", nodes=allowed))
    replicas = []
    for k in range(1, rnd.randint(0, 30)):
        m = rnd.choice(models)
        n = rnd.choice(nodes)
        gpu = rnd.randrange(len(n.gpus)) if m.uses_gpu and n.gpus else None
        if m.uses_gpu and gpu is None:
            continue
        replicas.append(rep(k, m.id, n.id, rnd.choice([PENDING, STARTING, READY, READY, DRAINING, STOPPING]),
                            mem=m.memory_bytes, gpu=gpu, changed=rnd.random() * NOW))
    rnd.shuffle(nodes)
    rnd.shuffle(models)
    rnd.shuffle(replicas)
    return snap(nodes, models, replicas, inflight={f"r{k}": rnd.randint(0, 1) for k in range(30)})


def reference_placements(s, replacing=frozenset()):
    """Where the rules say each Create goes, by looking at every node for every replica.

    `replacing`: replicas the planner marks replacing (on draining nodes): they stop counting."""
    silent = {n.id: None if n.last_seen is None else s.now - n.last_seen for n in s.nodes}
    alive = {n.id for n in s.nodes if n.connected and silent[n.id] is not None and silent[n.id] <= s.node_tolerance}
    lost = {i for i, t in silent.items() if i not in alive and (t is None or t > s.node_lost_grace)}
    ram = {n.id: n.memory_bytes for n in s.nodes}
    gpus = {n.id: list(n.gpus) for n in s.nodes}
    held = {}
    counting = {}
    for r in s.replicas:
        if r.node_id in lost:
            continue
        if r.state in (PENDING, DOWNLOADING, STARTING, READY, DRAINING, STOPPING):
            if r.gpu_index is None:
                ram[r.node_id] -= r.memory_bytes
            else:
                gpus[r.node_id][r.gpu_index] -= r.memory_bytes
        if r.state in (PENDING, DOWNLOADING, STARTING, READY, DRAINING):
            held[(r.model_id, r.node_id)] = held.get((r.model_id, r.node_id), 0) + 1
        if r.state in (PENDING, DOWNLOADING, STARTING, READY) and r.id not in replacing:
            counting[r.model_id] = counting.get(r.model_id, 0) + 1
    out = []
    for m in sorted(s.models, key=lambda m: m.name):
        for _ in range(m.replicas - counting.get(m.id, 0)):
            best = None
            for n in s.nodes:
                if n.id not in alive or not n.schedulable or n.draining or m.engine_kind not in n.engines:
                    continue
                if m.nodes and n.name not in m.nodes:
                    continue
                if m.uses_gpu:
                    fits = [(gpus[n.id][i], i) for i in range(len(n.gpus)) if gpus[n.id][i] >= m.memory_bytes]
                    if not fits:
                        continue
                    free, gpu = min(fits)
                else:
                    if ram[n.id] < m.memory_bytes:
                        continue
                    free, gpu = ram[n.id], None
                key = (held.get((m.id, n.id), 0), free - m.memory_bytes, n.name)
                if best is None or key < best[0]:
                    best = (key, n.id, gpu)
            if best is None:
                break
            _, node_id, gpu = best
            if gpu is None:
                ram[node_id] -= m.memory_bytes
            else:
                gpus[node_id][gpu] -= m.memory_bytes
            held[(m.id, node_id)] = held.get((m.id, node_id), 0) + 1
            out.append((m.id, node_id, gpu))
    return out


def test_placements_agree_with_a_plain_reference_on_random_fleets():
    for seed in range(300):
        s = random_snapshot(seed)
        actions = plan(s)
        marked = {a.replica_id for a in actions if isinstance(a, MarkReplacing)}
        assert creates(actions) == reference_placements(s, marked), seed


def test_many_replicas_of_one_model_agree_with_the_reference():
    # large batches take another path through the planner; the answer must not change
    rnd = random.Random(7)
    nodes = [node(i, f"n{i:03d}", engines=["vllm", "llama.cpp"], ram=rnd.choice([16, 32, 64]) * GiB,
                  gpus=[rnd.choice([16, 24, 40]) * GiB for _ in range(rnd.randint(1, 4))]) for i in range(1, 80)]
    models = [
        model(1, "cpu", replicas=150, mem=3 * GiB),
        model(2, "gpu", replicas=150, mem=7 * GiB, engine="vllm", gpu=True),
        model(3, "some", replicas=20, mem=5 * GiB, nodes=frozenset(f"n{i:03d}" for i in range(1, 40, 3))),
    ]
    existing = [rep(k, 1, rnd.randint(1, 79), READY, mem=3 * GiB) for k in range(1, 60)]
    s = snap(nodes, models, existing)
    assert creates(plan(s)) == reference_placements(s)


def test_same_snapshot_same_plan_whatever_the_order():
    for seed in range(50):
        s = random_snapshot(seed)
        first = plan(s)
        assert plan(s) == first
        shuffled = replace(s, nodes=tuple(reversed(s.nodes)), models=tuple(reversed(s.models)),
                           replicas=tuple(reversed(s.replicas)))
        assert plan(shuffled) == first, seed


# --- restarts and node drains ----------------------------------------------------------------------------


def step(s):
    """One reconciler run, then the agents: whatever was told to stop has stopped."""
    s = apply(s, plan(s))
    return replace(s, replicas=tuple(r for r in s.replicas if r.state != STOPPING))


def replacing(s, model_id=None):
    return [r for r in s.replicas if r.restart == RESTART_REPLACING and model_id in (None, r.model_id)]


def converge(s, model_ids, runs=40):
    """Step until nothing is left to do; check at every step that a model never has two replicas being
    replaced at once and never has fewer ready, serving replicas than it wants (there is room)."""
    for _ in range(runs):
        if not plan(s):
            return s
        s = step(s)
        for m in s.models:
            assert len(replacing(s, m.id)) <= 1, s.replicas
            if m.id in model_ids:
                serving = [r for r in s.replicas if r.model_id == m.id and r.state == READY]
                assert len(serving) >= m.replicas, s.replicas
    raise AssertionError("did not converge")


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
