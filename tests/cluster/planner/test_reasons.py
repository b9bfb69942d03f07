"""Why a model does not fit, in an operator's words; unplaced replicas and the model's note."""

from dataclasses import replace

from cluster.planner import (
    PENDING,
    Assign,
    Create,
    SetModelNote,
    Unplaceable,
    plan,
)
from ground.units import format_size
from tests.cluster.planner.snapshots import (
    GiB,
    MiB,
    apply,
    model,
    node,
    of,
    rep,
    snap,
)

# --- reasons -------------------------------------------------------------------------------------------


def reason_for(nodes, m):
    actions = plan(snap(nodes, [m]))
    [u] = of(actions, Unplaceable)
    assert SetModelNote(m.id, u.reason) in actions
    return u.reason


def test_reason_no_node_connected():
    assert reason_for([], model(1)) == "no node is connected"
    assert reason_for([node(1, connected=False, seen=None)], model(1)) == "no node is connected"
    # (a node heard from within the lost grace is waited for: test_nodes_and_failures.py)


def test_reason_allowed_nodes_not_connected():
    nodes = [node(1, "a", connected=False, seen=None), node(2, "c")]
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
             node(4, "d", ram=99 * GiB, connected=False, seen=None)]
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


def test_sizes_in_reasons_read_as_everywhere_else():
    assert format_size(24 * GiB) == "24.0 GiB"
    assert format_size(int(1.5 * GiB)) == "1.5 GiB"
    assert format_size(512 * MiB) == "512.0 MiB"
    assert format_size(0) == "0 B"


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
