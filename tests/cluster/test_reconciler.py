"""cluster.reconciler on a real database: snapshot, plan, apply; the lock; when it is due; whom it notifies."""

import asyncio
import itertools
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers
from django.utils import timezone

from cluster import notify, operations, planner, reconciler, reports
from cluster.locks import redis_client
from cluster.models import ClusterSettings, EngineVersion, Event, Model, Node, Replica
from ground import protocol
from tests.factories import make_agent_node, make_model, make_profile, make_replica

S = Replica.State
GIB = 1024**3
ACTOR = "test"
_listeners = itertools.count(1)


def kinds() -> list[str]:
    return sorted(Event.objects.values_list("kind", flat=True))


def report(replicas, state: str, full: bool = False) -> None:
    """Each replica's agent says `state` about it (a full report lists only these replicas)."""
    by_node: dict[int, list[protocol.ReplicaStatus]] = {}
    for r in replicas:
        by_node.setdefault(r.node_id, []).append({"name": r.name, "state": state})
    for node_id, statuses in by_node.items():
        reports.report(node_id, statuses, full=full)


def report_none(node: Node) -> None:
    """A full report that lists nothing: the agent runs no engine at all."""
    reports.report(node.pk, [], full=True)


class Listener:
    """A channel subscribed to nodes' agent groups, standing in for their agent streams.

    A plain (not process-specific) channel name and a fresh layer for each call: a layer's receive buffers
    belong to the event loop that made them, and each async_to_sync call runs in a new one.
    """

    def __init__(self, *nodes):
        self.channel = f"test.listener.{next(_listeners)}"
        self._run(lambda layer: asyncio.gather(
            *(layer.group_add(notify.agent_group(node.pk), self.channel) for node in nodes)
        ))

    @staticmethod
    def _run(work):
        async def go():
            layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
            try:
                return await work(layer)
            finally:
                await layer.close_pools()

        return async_to_sync(go)()

    def messages(self, wait: float | None = None) -> list[dict]:
        """What came, each waited for `wait` seconds; by default the first up to 5 s (one is expected: a busy
        machine's fresh layer took longer than 0.3 s to fetch it in a CI run), the rest 0.3 s."""
        async def drain(layer):
            got = []
            while True:
                try:
                    limit = wait if wait is not None else (5.0 if not got else 0.3)
                    got.append(await asyncio.wait_for(layer.receive(self.channel), limit))
                except TimeoutError:
                    return got

        return self._run(drain)


@pytest.fixture
def nodes(db):
    return make_agent_node("gpu-1", port_range=(21000, 21009)), make_agent_node("gpu-2", port_range=(22000, 22009))


# Placement


def test_places_replicas_spread_with_ports_memory_and_snapshot(nodes, django_capture_on_commit_callbacks):
    model = make_model("m1", replicas=4, memory_bytes=2 * GIB)
    cluster = ClusterSettings.load()
    with django_capture_on_commit_callbacks() as callbacks:
        assert reconciler.reconcile_once() == 4
    assert callbacks  # the nodes are told after commit, not before

    replicas = list(Replica.objects.filter(model=model))
    assert len(replicas) == 4
    ranges = {nodes[0].pk: range(21000, 21010), nodes[1].pk: range(22000, 22010)}
    for node in nodes:
        mine = [r for r in replicas if r.node_id == node.pk]
        assert len(mine) == 2  # spread before stacking
        assert len({r.port for r in mine}) == 2
        assert all(r.port in ranges[node.pk] for r in mine)
    for r in replicas:
        assert r.state == S.PENDING and r.name.startswith("m1-") and r.reason == ""
        assert r.memory_bytes == 2 * GIB
        assert r.gpu_index is None
        assert r.snapshot == {
            "profile": "default",
            "args": model.profile.args(),
            "engine": model.engine.spec(),
            "file": model.file.sha256,
            "engine_key": ClusterSettings.fingerprint(cluster.engine_key),
        }
    placed = Event.objects.filter(kind="replica.placed")
    assert {e.subject for e in placed} == {r.name for r in replicas}
    assert {e.actor for e in placed} == {"reconciler"}
    assert Model.objects.get(pk=model.pk).placement_note == ""


def test_ports_in_use_are_not_given_again(db):
    node = make_agent_node("gpu-1", port_range=(21000, 21002))
    old = make_model("old", replicas=0)
    make_replica(old, node, S.STOPPED, port=21000)  # a stopped replica frees its port
    taken = make_replica(make_model("busy", replicas=1, memory_bytes=GIB), node, S.READY, port=21001)
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    reconciler.reconcile_once()
    ports = set(Replica.objects.filter(model=model).values_list("port", flat=True))
    assert ports == {21000, 21002}
    assert Replica.objects.get(pk=taken.pk).port == 21001


def test_a_node_out_of_ports_does_not_stop_the_rest_of_the_run(db):
    node = make_agent_node("gpu-1", port_range=(21000, 21000))
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    reconciler.reconcile_once()
    placed, unplaced = (
        Replica.objects.filter(model=model, node=node).get(),
        Replica.objects.filter(model=model, node__isnull=True).get(),
    )
    assert placed.port == 21000
    assert unplaced.state == S.PENDING and unplaced.port is None
    assert "no free port" in unplaced.reason
    # The next runs do not fail either (and write nothing new while nothing changes).
    before = Event.objects.count()
    reconciler.reconcile_once()
    assert Event.objects.count() == before
    assert Event.objects.filter(kind="replica.unplaceable", subject=unplaced.name).count() == 1
    # The port comes free (its replica stopped): the waiting replica gets it.
    Replica.objects.filter(pk=placed.pk).update(state=S.STOPPED)
    reconciler.reconcile_once()
    unplaced.refresh_from_db()
    assert (unplaced.node_id, unplaced.port) == (node.pk, 21000)


def test_an_unplaceable_model_gets_an_unplaced_replica_and_a_note(nodes):
    model = make_model("huge", replicas=1, memory_bytes=64 * GIB)
    reconciler.reconcile_once()
    [replica] = Replica.objects.filter(model=model)
    reason = "needs 64.0 GiB RAM; the most free is 16.0 GiB on gpu-1"
    assert (replica.state, replica.node_id, replica.port, replica.reason) == (S.PENDING, None, None, reason)
    assert replica.memory_bytes == 64 * GIB
    assert Model.objects.get(pk=model.pk).placement_note == reason
    [event] = Event.objects.filter(kind="replica.unplaceable")
    assert event.subject == replica.name and reason in event.message

    assert reconciler.reconcile_once() == 0  # nothing changed: nothing to do, nothing written
    assert Event.objects.count() == 1
    assert Replica.objects.filter(model=model).count() == 1


def test_without_nodes_the_reason_says_so_and_a_new_node_takes_the_replica(db):
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    reconciler.reconcile_once()
    [replica] = Replica.objects.filter(model=model)
    assert replica.reason == "no node is connected"
    assert Model.objects.get(pk=model.pk).placement_note == "no node is connected"

    node = make_agent_node("gpu-1")
    reconciler.reconcile_once()
    replica.refresh_from_db()
    assert (replica.node_id, replica.reason, replica.memory_bytes) == (node.pk, "", GIB)
    assert 21000 <= replica.port <= 21009
    assert replica.snapshot["engine"] == model.engine.spec()
    assert Event.objects.filter(kind="replica.placed", subject=replica.name).count() == 1
    assert Model.objects.get(pk=model.pk).placement_note == ""
    assert Replica.objects.filter(model=model).count() == 1


def test_placement_counts_a_nodes_cores_against_its_engines_threads(db):
    """The typo that took a cluster down: `--replicas 1000` on a 2-core node with the memory for hundreds."""
    node = make_agent_node("small", memory_bytes=1000 * GIB, cpu_count=2, port_range=(21000, 21999))
    model = make_model("chat", replicas=1000, memory_bytes=GIB)  # llama.cpp, no --threads: one core each
    reconciler.reconcile_once()
    placed = Replica.objects.filter(model=model, node=node)
    assert placed.count() == 2
    reason = "needs 1 CPU core (its threads); the most free is 0 of 2 on small"
    assert Model.objects.get(pk=model.pk).placement_note == reason  # `ctl models` "why not placed"
    assert Replica.objects.filter(model=model, node__isnull=True, reason=reason).count() == 998

    # the profile's --threads is what a replica takes; a running replica keeps the threads it started with
    model.replicas = 2
    model.save()
    reconciler.reconcile_once()
    wide = make_model("wide", replicas=1, memory_bytes=GIB, profile=make_profile("wide", threads=2).name)
    reconciler.reconcile_once()
    assert Replica.objects.filter(model=wide, node__isnull=True).get().reason == (
        "needs 2 CPU cores (its threads); the most free is 0 of 2 on small")


def test_an_operators_command_engine_counts_cores_only_when_its_profile_sets_threads(db):
    make_agent_node("small", memory_bytes=100 * GIB, cpu_count=1, engines={"command": ""})
    EngineVersion.objects.create(name="cmd", kind="command", command="{python} -m server --port {port}")
    free = make_model("free", engine="cmd", replicas=3, memory_bytes=GIB)
    counted = make_model("counted", engine="cmd", replicas=2, memory_bytes=GIB,
                         profile=make_profile("one", threads=1).name)
    reconciler.reconcile_once()
    assert Replica.objects.filter(model=free, node__isnull=False).count() == 3
    assert Replica.objects.filter(model=counted, node__isnull=False).count() == 1


def test_a_node_without_the_engine_takes_nothing(db):
    make_agent_node("gpu-1", engines={"vllm": "0.6"})
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    reconciler.reconcile_once()
    [replica] = Replica.objects.filter(model=model)
    assert replica.node_id is None
    assert replica.reason == "no connected, schedulable node has engine llama.cpp"


def test_a_second_run_with_nothing_changed_does_nothing(nodes):
    make_model("m1", replicas=3, memory_bytes=GIB)
    make_model("m2", replicas=1, memory_bytes=100 * GIB)
    assert reconciler.reconcile_once() > 0
    before = (Event.objects.count(), list(Replica.objects.values_list("name", "node_id", "port", "state")))
    assert reconciler.reconcile_once() == 0
    assert (Event.objects.count(), list(Replica.objects.values_list("name", "node_id", "port", "state"))) == before


def test_a_silent_node_is_marked_disconnected(db):
    node = make_agent_node("gpu-1")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=30))
    assert reconciler.reconcile_once() == 1
    node.refresh_from_db()
    assert not node.connected
    [event] = Event.objects.filter(kind="node.disconnected")
    assert event.actor == "reconciler" and "no word from the agent for 30s" in event.message


# Scaling down and removing


def test_a_node_that_reports_while_the_plan_is_made_is_not_marked_disconnected(db):
    node = make_agent_node("gpu-1")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=30))
    now = timezone.now()
    snapshot = reconciler.take_snapshot(now)
    [mark] = [a for a in planner.plan(snapshot) if isinstance(a, planner.MarkNodeDisconnected)]
    reports.seen(node.pk)  # its report lands after the snapshot was taken
    reconciler._Applier(snapshot, now).apply(mark)
    node.refresh_from_db()
    assert node.connected
    assert not Event.objects.filter(kind="node.disconnected").exists()


def test_a_node_whose_report_waited_on_a_lock_past_the_lost_grace_keeps_its_replicas(db):
    """A database lock never marks a node lost: its report, delayed past the grace, lands while the plan that
    saw it lost is made; the plan's Fail is not applied."""
    node = make_agent_node("gpu-1")
    replica = make_replica(make_model("m1", replicas=1, memory_bytes=GIB), node, S.READY)
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(minutes=3))
    now = timezone.now()
    snapshot = reconciler.take_snapshot(now)
    actions = planner.plan(snapshot)
    [fail] = [a for a in actions if isinstance(a, planner.Fail)]
    reports.report(node.pk, [{"name": replica.name, "state": "ready"}], full=True)  # it lands now
    applier = reconciler._Applier(snapshot, now)
    for action in actions:
        if isinstance(action, (planner.Fail, planner.MarkNodeDisconnected)):
            applier.apply(action)
    replica.refresh_from_db()
    node.refresh_from_db()
    assert replica.state == S.READY and node.connected
    assert not Event.objects.filter(kind__in=("replica.failed", "node.disconnected")).exists()


def test_after_every_control_plane_was_stopped_the_agents_have_their_grace_to_reconnect(db):
    """Stopped for five minutes, then started again; the first pass comes before any agent has reconnected. The
    nodes' silence while nothing listened is not theirs: the replicas a node ran are not failed (its agent would
    stop their engines), and a replica that only a node on its way back can take waits for it (its requests
    wait: tests/gateway/views/test_errors.py), where it would otherwise be unplaceable."""
    now = timezone.now()
    killed = make_agent_node("gpu-1", port_range=(21000, 21009))  # nobody marked it disconnected
    running = make_replica(make_model("m1", replicas=1, memory_bytes=GIB, nodes=["gpu-1"]), killed, S.READY)
    stopped = make_agent_node("gpu-2")  # its agent was stopped first (`llmgw up`'s Ctrl-C): disconnected
    wanted = make_model("m2", replicas=1, memory_bytes=GIB, nodes=["gpu-2"])
    Node.objects.filter(pk=killed.pk).update(last_seen=now - timedelta(seconds=302))
    Node.objects.filter(pk=stopped.pk).update(connected=False, last_seen=now - timedelta(seconds=303))
    ClusterSettings.objects.update(watched_at=now - timedelta(seconds=300))
    reconciler.reconcile_once()
    running.refresh_from_db()
    assert running.state == S.READY
    assert Node.objects.get(pk=killed.pk).connected
    [waiting] = Replica.objects.filter(model=wanted)
    assert (waiting.node_id, waiting.waiting_for_room) == (None, True)
    assert waiting.reason == "allowed nodes (gpu-2) are not connected; waiting for node gpu-2 to reconnect"
    [away] = Event.objects.filter(kind="control_plane.away")
    assert "after 300s with none" in away.message and away.data == {"away_seconds": 300}
    assert kinds() == ["control_plane.away", "replica.waiting"]

    # gpu-2's agent reconnects: its replica is placed there; gpu-1's never does: lost after the grace, as ever
    reports.connected(stopped, "10.0.0.2")
    reconciler.reconcile_once()
    waiting.refresh_from_db()
    assert waiting.node_id == stopped.pk and not waiting.waiting_for_room
    later = timezone.now() + timedelta(seconds=61)
    Node.objects.filter(pk=stopped.pk).update(last_seen=later)
    ClusterSettings.objects.update(watched_at=later - timedelta(seconds=4))  # passes ran meanwhile
    actions = reconciler.planner.plan(reconciler.take_snapshot(later))
    assert planner.Fail(running.pk, "node gpu-1 lost") in actions


def test_a_pass_a_little_late_is_no_control_plane_away(db):
    ClusterSettings.load()
    assert reconciler.reconcile_once() == 0
    first = ClusterSettings.objects.get().watched_at
    assert first is not None
    reconciler.reconcile_once()
    assert ClusterSettings.objects.get().watched_at == first  # written every few seconds, not on every pass
    # the interval, the tolerance and the write's own few seconds, less one
    late = first - timedelta(seconds=5 + 15 + reconciler.WATCH_EVERY - 1)
    ClusterSettings.objects.update(watched_at=late)
    reconciler.reconcile_once()
    assert ClusterSettings.objects.get().watched_at > first
    assert ClusterSettings.objects.get().away_from is None
    assert not Event.objects.exists()


def test_scaling_down_drains_the_surplus_then_stops_it(nodes):
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    reconciler.reconcile_once()
    replicas = list(Replica.objects.filter(model=model))
    report(replicas, "ready")

    operations.set_model("m1", ACTOR, replicas=1)
    Event.objects.all().delete()
    assert reconciler.reconcile_once() == 1
    draining = Replica.objects.get(model=model, state=S.DRAINING)
    assert draining.reason == "surplus: model wants 1"
    assert Replica.objects.filter(model=model, state=S.READY).count() == 1
    assert kinds() == ["replica.draining"]

    # Nothing is in flight on it: the next run stops it.
    assert reconciler.reconcile_once() == 1
    draining.refresh_from_db()
    assert (draining.state, draining.reason) == (S.STOPPING, "drained: idle")
    assert kinds() == ["replica.draining", "replica.stopping"]
    assert reconciler.reconcile_once() == 0

    # Its agent no longer lists it: stopped.
    report_none(draining.node)
    draining.refresh_from_db()
    assert draining.state == S.STOPPED
    assert reconciler.reconcile_once() == 0
    assert Replica.objects.filter(model=model, state=S.READY).count() == 1


def test_scaling_down_stops_replicas_not_ready_yet_at_once(nodes):
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    reconciler.reconcile_once()
    Model.objects.filter(pk=model.pk).update(replicas=0)
    assert reconciler.reconcile_once() == 2
    assert set(Replica.objects.filter(model=model).values_list("state", flat=True)) == {S.STOPPING}
    assert kinds().count("replica.stopping") == 2


def test_removing_a_model_stops_its_replicas_then_deletes_it(nodes):
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    reconciler.reconcile_once()
    replicas = list(Replica.objects.filter(model=model))
    report(replicas[:1], "ready")  # one ready (drained first), one still pending (stopped at once)

    operations.remove_model("m1", ACTOR)
    reconciler.reconcile_once()
    states = dict(Replica.objects.filter(model=model).values_list("name", "state"))
    assert states == {replicas[0].name: S.DRAINING, replicas[1].name: S.STOPPING}
    reconciler.reconcile_once()
    assert set(Replica.objects.filter(model=model).values_list("state", flat=True)) == {S.STOPPING}
    assert Model.objects.filter(pk=model.pk).exists()  # not while anything of it may still run
    assert reconciler.reconcile_once() == 0

    for node in nodes:
        report_none(node)
    assert set(Replica.objects.filter(model=model).values_list("state", flat=True)) == {S.STOPPED}
    assert reconciler.reconcile_once() == 1
    assert not Model.objects.filter(pk=model.pk).exists()
    assert not Replica.objects.filter(name__in=[r.name for r in replicas]).exists()
    [event] = Event.objects.filter(kind="model.removed")
    assert (event.actor, event.subject) == ("reconciler", "m1")
    assert reconciler.reconcile_once() == 0


def test_removing_a_model_without_replicas_deletes_it_at_once(db):
    model = make_model("m1", replicas=1, removing=True)
    assert reconciler.reconcile_once() == 1
    assert not Model.objects.filter(pk=model.pk).exists()
    assert Event.objects.filter(kind="model.removed", subject="m1").count() == 1


def test_an_unplaced_replica_of_a_removed_model_is_stopped_without_a_node(db):
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    reconciler.reconcile_once()
    [replica] = Replica.objects.filter(model=model)
    operations.remove_model("m1", ACTOR)
    reconciler.reconcile_once()
    replica.refresh_from_db()
    assert replica.state == S.STOPPED  # no agent to ask
    reconciler.reconcile_once()
    assert not Model.objects.filter(pk=model.pk).exists()


def test_serving_stopped_wants_no_replica(nodes):
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    ClusterSettings.objects.filter(pk=ClusterSettings.load().pk).update(serving_stopped=True)
    assert reconciler.reconcile_once() == 0
    assert not Replica.objects.filter(model=model).exists()


# Notifications


def test_touched_nodes_are_told_to_send_their_desired_list(db, django_capture_on_commit_callbacks):
    busy = make_agent_node("gpu-1", memory_bytes=4 * GIB)
    idle = make_agent_node("gpu-2", engines={"vllm": ""})  # cannot run llama.cpp: nothing for it
    busy_listener, idle_listener = Listener(busy), Listener(idle)
    make_model("m1", replicas=1, memory_bytes=GIB)

    with django_capture_on_commit_callbacks(execute=True):
        reconciler.reconcile_once()
    assert busy_listener.messages() == [{"type": "send.desired"}]
    assert idle_listener.messages(wait=0.1) == []

    with django_capture_on_commit_callbacks(execute=True):
        assert reconciler.reconcile_once() == 0
    assert busy_listener.messages(wait=0.1) == []


def test_nothing_is_sent_before_commit(db, django_capture_on_commit_callbacks):
    node = make_agent_node("gpu-1")
    listener = Listener(node)
    make_model("m1", replicas=1, memory_bytes=GIB)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        reconciler.reconcile_once()
    assert listener.messages(wait=0.1) == []
    for callback in callbacks:
        callback()
    assert listener.messages() == [{"type": "send.desired"}]


# The lock and the schedule


def test_reconcile_runs_and_clears_the_dirty_flag(nodes):
    make_model("m1", replicas=1, memory_bytes=GIB)
    r = redis_client()
    assert reconciler.reconcile() == 1
    assert r.get(reconciler.DIRTY_KEY) is None
    assert float(r.get(reconciler.LAST_RUN_KEY)) == pytest.approx(time.time(), abs=5)
    assert r.get(reconciler.LOCK_KEY) is None  # released
    assert reconciler.reconcile() == 0


def test_reconcile_stands_back_while_another_holds_the_lock(nodes):
    model = make_model("m1", replicas=1, memory_bytes=GIB)
    r = redis_client()
    lock = r.lock(reconciler.LOCK_KEY, timeout=30)
    assert lock.acquire(blocking=False)
    try:
        assert reconciler.reconcile() is None
        assert not Replica.objects.filter(model=model).exists()
        assert r.get(reconciler.DIRTY_KEY) is not None  # the holder goes round again for us
        assert r.get(reconciler.LAST_RUN_KEY) is None
    finally:
        lock.release()
    # What the holder does when its pass ends: the flag is there, so it runs once more and sees the model.
    assert reconciler.reconcile() == 1
    assert Replica.objects.filter(model=model).count() == 1
    assert r.get(reconciler.DIRTY_KEY) is None


def test_due_respects_the_reconcile_interval(db):
    r = redis_client()
    assert reconciler.due()  # never ran
    reconciler.reconcile()
    assert not reconciler.due()  # default interval: 5 s
    ClusterSettings.objects.filter(pk=1).update(reconcile_interval_seconds=0)
    assert reconciler.due()
    ClusterSettings.objects.filter(pk=1).update(reconcile_interval_seconds=30)
    r.set(reconciler.LAST_RUN_KEY, time.time() - 29)
    assert not reconciler.due()
    r.set(reconciler.LAST_RUN_KEY, time.time() - 31)
    assert reconciler.due()


def test_a_burst_of_kicks_queues_one_run_and_a_change_during_the_run_queues_the_next(db, monkeypatch,
                                                                                      django_capture_on_commit_callbacks):
    """Hundreds of agents reporting at once each kick the reconciler: one run is queued for all of them (it reads
    every change made before it begins), not one whole-cluster run per report."""
    from celery import current_app

    from cluster.events import RECONCILE_QUEUED, RECONCILE_TASK, kick_reconciler

    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, **kw: sent.append(name))
    r = redis_client()
    r.delete(RECONCILE_QUEUED)
    for _ in range(50):
        with django_capture_on_commit_callbacks(execute=True):
            kick_reconciler()
    assert sent == [RECONCILE_TASK]
    reconciler.reconcile()  # the run begins: a change from now on queues the next
    with django_capture_on_commit_callbacks(execute=True):
        kick_reconciler()
        kick_reconciler()
    assert sent == [RECONCILE_TASK] * 2
    r.delete(RECONCILE_QUEUED)
