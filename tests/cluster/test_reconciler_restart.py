"""The reconciler applying restarts and node drains on a real database: markers, states, notes and Events."""

import pytest
from django.utils import timezone

from cluster import operations, planner, reconciler
from cluster.models import Event, Model, Node, Replica
from tests.cluster.test_reconciler import report, report_none
from tests.factories import make_agent_node, make_model

S = Replica.State
R = Replica.Restart
GIB = 1024**3
ACTOR = "test"


def run():
    return reconciler.reconcile_once()


def placed(model) -> list[Replica]:
    """Place the model's replicas and have their agents report them ready."""
    run()
    replicas = list(Replica.objects.filter(model=model))
    report(replicas, "ready")
    return replicas


def messages(kind: str, subject: str | None = None) -> list[str]:
    events = Event.objects.filter(kind=kind).order_by("id")
    if subject:
        events = events.filter(subject=subject)
    return list(events.values_list("message", flat=True))


@pytest.fixture
def nodes(db):
    return make_agent_node("gpu-1", port_range=(21000, 21009)), make_agent_node("gpu-2", port_range=(22000, 22009))


def test_restart_places_a_replacement_beside_then_drains_and_stops_the_old_one(db):
    node = make_agent_node("gpu-1", memory_bytes=4 * GIB)
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    [old] = placed(model)
    operations.restart_replicas(ACTOR, replicas=[old.name])

    run()
    old.refresh_from_db()
    assert (old.state, old.restart) == (S.READY, R.REPLACING)  # still serving
    new = Replica.objects.get(model=model, restart=R.NONE)
    assert (new.state, new.node_id) == (S.PENDING, node.pk)
    assert messages("replica.replacing", old.name) == [
        f"replica {old.name} being replaced (restart queued): a new replica starts beside it; "
        "it keeps serving until that one is ready"
    ]
    assert run() == 0  # the new one is not ready yet: nothing to do

    report([new], "ready")
    run()
    old.refresh_from_db()
    assert (old.state, old.reason) == (S.DRAINING, f"replaced by {new.name}")
    assert messages("replica.draining", old.name) == [f"replica {old.name} draining: replaced by {new.name}"]
    run()  # nothing in flight on it: stopped
    old.refresh_from_db()
    assert (old.state, old.reason) == (S.STOPPING, "drained: idle")
    report_none(node)
    report([new], "ready", full=True)
    old.refresh_from_db()
    assert old.state == S.STOPPED
    assert run() == 0


def test_restart_without_room_for_a_second_copy_stops_the_old_one_first_and_logs_the_outage(db):
    node = make_agent_node("gpu-1", memory_bytes=GIB + GIB // 2)
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    [old] = placed(model)
    operations.restart_replicas(ACTOR, replicas=[old.name])

    run()
    old.refresh_from_db()
    assert (old.state, old.restart) == (S.DRAINING, R.REPLACING)
    new = Replica.objects.get(model=model, restart=R.NONE)
    assert (new.state, new.node_id) == (S.PENDING, None)  # waits for the memory
    assert messages("replica.replacing", old.name) == [
        f"replica {old.name} being replaced (restart queued): no room for a second copy: "
        "it stops first and the new one starts in its place"
    ]
    [outage] = Event.objects.filter(kind="replica.draining", subject=old.name)
    assert outage.data == {"outage": True}
    assert outage.message == (
        f"replica {old.name} draining, an outage chosen: no room for a second copy: stopping it first, "
        "the new one starts in its place (model m1 has no other ready replica meanwhile)"
    )

    run()  # idle: stopped
    report_none(node)
    run()  # the freed memory takes the new one
    new.refresh_from_db()
    assert (new.node_id, new.reason) == (node.pk, "")
    assert Model.objects.get(pk=model.pk).placement_note == ""


def test_drain_moves_replicas_to_other_nodes_then_the_node_is_drained(nodes):
    first, second = nodes
    model = make_model("m1", replicas=1, memory_bytes=GIB, nodes=[])
    Node.objects.filter(pk=second.pk).update(schedulable=False)
    [old] = placed(model)
    assert old.node_id == first.pk
    Node.objects.filter(pk=second.pk).update(schedulable=True)

    operations.drain_node("gpu-1", ACTOR)
    run()
    old.refresh_from_db()
    new = Replica.objects.get(model=model, restart=R.NONE)
    assert (old.restart, old.state, new.node_id) == (R.REPLACING, S.READY, second.pk)
    assert messages("replica.replacing", old.name) == [
        f"replica {old.name} being replaced (node gpu-1 is draining): a new replica starts elsewhere; "
        "it keeps serving until that one is ready"
    ]
    report([new], "ready")
    run()
    run()
    report_none(first)
    left = Replica.objects.filter(node=first).exclude(state__in=Replica.TERMINAL).count()
    assert Node.objects.get(pk=first.pk).drain_state(left) == "drained"


def test_drain_with_nowhere_else_to_go_is_blocked_then_undrain_keeps_the_replica(db):
    node = make_agent_node("gpu-1")
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    [old] = placed(model)
    operations.drain_node("gpu-1", ACTOR)

    run()
    old.refresh_from_db()
    assert (old.state, old.restart) == (S.READY, R.REPLACING)  # left serving
    why = "every connected node is unschedulable or draining"
    node.refresh_from_db()
    assert node.drain_note == f"replica {old.name} has nowhere else to go ({why})"
    assert node.drain_state(1) == "blocked"
    assert Model.objects.get(pk=model.pk).placement_note == (
        f"drain of node gpu-1 is blocked for replica {old.name}: nowhere else to go ({why})"
    )
    assert messages("node.drain_blocked", "gpu-1") == [f"drain of node gpu-1 blocked: {node.drain_note}"]
    assert run() == 0  # stays so, quietly

    operations.undrain_node("gpu-1", ACTOR)
    run()  # the waiting replacement is surplus now
    old.refresh_from_db()
    assert (old.state, old.restart) == (S.READY, R.NONE)
    assert set(Replica.objects.filter(model=model).exclude(pk=old.pk).values_list("state", flat=True)) == {S.STOPPED}
    assert Model.objects.get(pk=model.pk).placement_note == ""
    assert run() == 0


def test_forced_drain_stops_a_replica_with_nowhere_else_to_go(db):
    make_agent_node("gpu-1")
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    [old] = placed(model)
    operations.drain_node("gpu-1", ACTOR, force=True)
    run()
    old.refresh_from_db()
    assert old.state == S.DRAINING and old.reason.startswith("node gpu-1 drained with force: nowhere else to go")
    [event] = Event.objects.filter(kind="replica.draining", subject=old.name)
    assert event.data == {"outage": True}


def test_the_snapshot_carries_the_nodes_drain(db):
    node = make_agent_node("gpu-1")
    Node.objects.filter(pk=node.pk).update(draining=True, drain_force=True, drain_note="x")
    [view] = reconciler.take_snapshot().nodes
    assert (view.draining, view.drain_force, view.drain_note) == (True, True, "x")


def test_mark_replacing_is_a_conditional_update(db):
    make_agent_node("gpu-1")
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    [replica] = placed(model)
    snapshot = reconciler.take_snapshot()
    Replica.objects.filter(pk=replica.pk).update(state=S.FAILED)  # meanwhile, its engine died
    applier = reconciler._Applier(snapshot, timezone.now())
    applier.apply(planner.MarkReplacing(replica.pk, "restart queued"))
    replica.refresh_from_db()
    assert replica.restart == R.NONE
    assert not Event.objects.filter(kind="replica.replacing").exists()
