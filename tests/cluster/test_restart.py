"""Restart, drain and engine-key rotation as operations (cluster.operations), and their CLI commands.

The planner's rules have their own tests (tests/cluster/planner/); the reconciler applying them is in
test_reconciler_restart.py; the REST endpoints in test_api_restart.py.
"""

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from cluster import operations, reports
from cluster.models import ClusterSettings, EngineVersion, Event, Node, Profile, Replica
from cluster.operations import NotFound, OperationError
from tests.factories import make_file, make_model, make_node, make_replica, row_counts

S = Replica.State
R = Replica.Restart
ACTOR = "test"


def current_snapshot(model) -> dict:
    """What the reconciler records when it places a replica of the model now."""
    return {
        "profile": model.profile.name,
        "args": model.profile.args(),
        "engine": model.engine.spec(),
        "file": model.file.sha256,
        "engine_key": ClusterSettings.fingerprint(ClusterSettings.load().engine_key),
    }


def running(model, node, state=S.READY, **fields):
    return make_replica(model, node, state, snapshot=current_snapshot(model), **fields)


def markers() -> dict[str, str]:
    return dict(Replica.objects.values_list("name", "restart"))


def cli(*args) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def fleet(db):
    """Two nodes; model `a` with two ready replicas, model `b` with one, and one of `b` not placed."""
    n1, n2 = make_node("gpu-1"), make_node("gpu-2")
    a = make_model("a", replicas=2)
    b = make_model("b", replicas=2)
    return {
        "nodes": (n1, n2),
        "a": (running(a, n1), running(a, n2)),
        "b": (running(b, n1), make_replica(b, None, S.PENDING, reason="no room")),
        "models": (a, b),
    }


# restart


def test_restart_needs_something_to_restart(fleet):
    before = (row_counts(), markers())
    with pytest.raises(OperationError, match=r"^name replicas, --model, --all or --stale$"):
        operations.restart_replicas(ACTOR)
    assert (row_counts(), markers()) == before


def test_restart_queues_named_replicas_and_says_so_in_the_log(fleet):
    first = fleet["a"][0]
    queued = operations.restart_replicas(ACTOR, replicas=[first.name])
    assert queued == [first.name] and queued.skipped == {}
    assert markers()[first.name] == R.QUEUED
    assert Replica.objects.get(pk=first.pk).state == S.READY  # it keeps serving
    [event] = Event.objects.filter(kind="replica.restart_queued")
    assert (event.actor, event.subject) == (ACTOR, first.name)
    assert event.message == f"replica {first.name} queued for restart"


def test_restart_of_an_unknown_replica_queues_nothing(fleet):
    before = (row_counts(), markers())
    with pytest.raises(NotFound, match="no replica named 'a-nope'; nothing queued"):
        operations.restart_replicas(ACTOR, replicas=[fleet["a"][0].name, "a-nope"])
    assert (row_counts(), markers()) == before


def test_restart_of_a_stopped_replica_is_refused(fleet):
    gone = make_replica(fleet["models"][0], fleet["nodes"][0], S.STOPPED)
    before = (row_counts(), markers())
    with pytest.raises(OperationError, match=f"only running replicas can be restarted: {gone.name} is stopped"):
        operations.restart_replicas(ACTOR, replicas=[fleet["a"][0].name, gone.name])
    assert (row_counts(), markers()) == before


def test_restart_again_is_a_no_op_that_says_so(fleet):
    first, second = fleet["a"]
    operations.restart_replicas(ACTOR, replicas=[first.name])
    Replica.objects.filter(pk=second.pk).update(restart=R.REPLACING)
    events = Event.objects.count()
    queued = operations.restart_replicas(ACTOR, replicas=[first.name, second.name])
    assert queued == []
    assert queued.skipped == {first.name: "already queued for restart", second.name: "already being replaced"}
    assert Event.objects.count() == events


def test_restart_by_model_takes_its_running_placed_replicas(fleet):
    queued = operations.restart_replicas(ACTOR, models=["b"])
    assert queued == [fleet["b"][0].name] and queued.skipped == {}  # the unplaced one starts current anyway
    with pytest.raises(NotFound, match="no model named 'zzz'"):
        operations.restart_replicas(ACTOR, models=["a", "zzz"])
    assert markers()[fleet["a"][0].name] == R.NONE


def test_restart_all_skips_what_is_going_away(fleet):
    draining = make_replica(fleet["models"][0], fleet["nodes"][0], S.DRAINING)
    queued = operations.restart_replicas(ACTOR, all=True)
    assert sorted(queued) == sorted([fleet["a"][0].name, fleet["a"][1].name, fleet["b"][0].name])
    assert markers()[draining.name] == R.NONE and draining.name not in queued.skipped
    # named, a replica that is going away is accounted for
    named = operations.restart_replicas(ACTOR, replicas=[draining.name])
    assert named.skipped == {draining.name: "already draining"}


def test_restart_is_refused_while_serving_is_stopped(fleet):
    operations.stop_serving(ACTOR)
    with pytest.raises(OperationError, match="llmgw is stopped"):
        operations.restart_replicas(ACTOR, all=True)
    assert set(markers().values()) == {R.NONE}


# staleness


def test_a_replica_started_with_the_current_settings_is_not_stale(fleet):
    cluster = ClusterSettings.load()
    replica = fleet["a"][0]
    assert operations.staleness(replica, replica.model, cluster) is None
    unplaced = fleet["b"][1]
    assert operations.staleness(unplaced, unplaced.model, cluster) is None


def test_staleness_names_what_changed(db):
    node = make_node("gpu-1")
    model = make_model("m", profile="default")
    replica = running(model, node)
    cluster = ClusterSettings.load()

    def stale():
        fresh = Replica.objects.select_related("model__profile", "model__engine", "model__file").get(pk=replica.pk)
        return operations.staleness(fresh, fresh.model, ClusterSettings.load())

    operations.set_profile("default", ACTOR, context_size=8192)
    assert stale() == "profile edited"
    EngineVersion.objects.filter(pk=model.engine_id).update(version="b9999")
    assert stale() == "profile edited, engine version"
    operations.rotate_engine_key(ACTOR)
    assert stale() == "profile edited, engine version, engine key"
    model.file = make_file("other.gguf")
    model.save(update_fields=["file"])
    assert stale() == "profile edited, engine version, engine key, model file"
    assert cluster.engine_key != ClusterSettings.load().engine_key


def test_restart_stale_queues_exactly_the_stale_ones(fleet):
    a1, a2 = fleet["a"]
    b1 = fleet["b"][0]
    Replica.objects.filter(pk=a2.pk).update(snapshot={**a2.snapshot, "args": {"context_size": 1}})
    Replica.objects.filter(pk=b1.pk).update(snapshot={**b1.snapshot, "engine_key": "0" * 12})
    assert sorted(operations.restart_replicas(ACTOR, stale=True)) == sorted([a2.name, b1.name])
    assert markers()[a1.name] == R.NONE
    Replica.objects.update(restart=R.NONE)
    # with names or models, only the stale ones among them
    queued = operations.restart_replicas(ACTOR, models=["a"], stale=True)
    assert queued == [a2.name]
    queued = operations.restart_replicas(ACTOR, replicas=[a1.name], stale=True)
    assert queued == [] and queued.skipped == {a1.name: "not stale"}


# drain and undrain


def test_drain_marks_the_node_and_says_what_happens(fleet):
    node = operations.drain_node("gpu-1", ACTOR)
    node.refresh_from_db()
    assert (node.draining, node.drain_force, node.drain_note) == (True, False, "")
    [event] = Event.objects.filter(kind="node.draining")
    assert event.subject == "gpu-1" and "its 2 replica(s) are replaced elsewhere, one at a time per model" in event.message
    with pytest.raises(OperationError, match="node gpu-1 is already draining; --force stops"):
        operations.drain_node("gpu-1", ACTOR)


def test_drain_force_can_be_added_to_a_drain(fleet):
    operations.drain_node("gpu-1", ACTOR)
    operations.drain_node("gpu-1", ACTOR, force=True)
    assert Node.objects.get(name="gpu-1").drain_force
    assert Event.objects.filter(kind="node.drain_forced", subject="gpu-1").count() == 1
    with pytest.raises(OperationError, match=r"^node gpu-1 is already draining$"):
        operations.drain_node("gpu-1", ACTOR, force=True)


def test_drain_and_undrain_of_an_unknown_node(db):
    with pytest.raises(NotFound, match="no node named 'gpu-9'"):
        operations.drain_node("gpu-9", ACTOR)
    with pytest.raises(NotFound, match="no node named 'gpu-9'"):
        operations.undrain_node("gpu-9", ACTOR)


def test_undrain_leaves_the_replicas_still_to_move_where_they_are(fleet):
    operations.drain_node("gpu-1", ACTOR, force=True)
    moving = fleet["a"][0]
    Replica.objects.filter(pk=moving.pk).update(restart=R.REPLACING)
    Node.objects.filter(name="gpu-1").update(drain_note="replica x has nowhere else to go")
    operations.undrain_node("gpu-1", ACTOR)
    node = Node.objects.get(name="gpu-1")
    assert (node.draining, node.drain_force, node.drain_note) == (False, False, "")
    assert markers()[moving.name] == R.NONE
    [event] = Event.objects.filter(kind="node.undrained")
    assert f"{moving.name} stay(s) on it" in event.message
    with pytest.raises(OperationError, match="node gpu-1 is not draining"):
        operations.undrain_node("gpu-1", ACTOR)


def test_drain_state(db):
    node = make_node("gpu-1")
    assert node.drain_state(3) == ""
    node.draining = True
    assert (node.drain_state(3), node.drain_state(0)) == ("draining", "drained")
    node.drain_note = "replica x has nowhere else to go"
    assert node.drain_state(1) == "blocked"


# engine key


def test_rotate_keeps_the_old_key_for_running_replicas(fleet):
    old = ClusterSettings.load().engine_key
    cluster = operations.rotate_engine_key(ACTOR)
    assert cluster.previous_engine_key == old and cluster.engine_key.startswith("lek_") and cluster.engine_key != old
    [event] = Event.objects.filter(kind="engine_key.rotated")
    assert "3 running replica(s) keep the old one until restarted" in event.message
    # Agents are told each replica's own key: the old one for those started before.
    desired = reports.desired(fleet["nodes"][0].pk, "http://server")["replicas"]
    assert {r["engine_key"] for r in desired} == {old}


def test_a_second_rotation_waits_until_no_replica_uses_the_oldest_key(fleet):
    operations.rotate_engine_key(ACTOR)
    before = ClusterSettings.load().engine_key
    with pytest.raises(OperationError, match=r"3 replica\(s\) still use the engine key before the current one"):
        operations.rotate_engine_key(ACTOR)
    assert ClusterSettings.load().engine_key == before
    # restarted (their replacements carry the current key's fingerprint): it may rotate again
    fingerprint = ClusterSettings.fingerprint(before)
    for r in Replica.objects.all():
        Replica.objects.filter(pk=r.pk).update(snapshot={**r.snapshot, "engine_key": fingerprint})
    operations.rotate_engine_key(ACTOR)


# CLI


def test_cli_restart(fleet):
    first, second = fleet["a"]
    with pytest.raises(CommandError, match="name replicas, --model, --all or --stale"):
        cli("ctl", "restart")
    assert cli("ctl", "restart", first.name) == "1 replica(s) queued for restart; watch with: llmgw ctl replicas\n"
    out = cli("ctl", "restart", "--model", "a")
    assert out == (
        f"{first.name}: already queued for restart; nothing to do\n"
        "1 replica(s) queued for restart; watch with: llmgw ctl replicas\n"
    )
    with pytest.raises(CommandError, match="no replica named 'nope'"):
        cli("ctl", "restart", "nope")
    assert markers()[second.name] == R.QUEUED


def test_cli_replicas_show_restart_and_staleness(fleet):
    first, second = fleet["a"]
    operations.restart_replicas(ACTOR, replicas=[first.name])
    Profile.objects.filter(name="default").update(context_size=123)
    out = cli("ctl", "replicas", "--model", "a")
    line = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "(restart queued) (stale: profile edited)" in line[first.name]
    assert "(stale: profile edited)" in line[second.name] and "restart" not in line[second.name]
    import json

    rows = {r["name"]: r for r in json.loads(cli("ctl", "replicas", "--json"))}
    assert rows[first.name]["stale"] == "profile edited" and rows[first.name]["restart"] == "queued"
    assert rows[fleet["b"][1].name]["stale"] is None


def test_cli_drain_undrain_and_nodes(fleet):
    out = cli("ctl", "drain", "gpu-1", "--force")
    assert out.startswith("node gpu-1 draining: its replicas are replaced elsewhere, one at a time per model; forced")
    assert "draining (forced)" in cli("ctl", "nodes")
    Node.objects.filter(name="gpu-1").update(drain_force=False, drain_note="replica a-1 has nowhere else to go")
    assert "blocked - replica a-1 has nowhere else to go" in cli("ctl", "nodes")
    Replica.objects.filter(node__name="gpu-1").update(state=S.STOPPED)
    line = next(ln for ln in cli("ctl", "nodes").splitlines() if ln.startswith("gpu-1"))
    assert line.rstrip().endswith("drained")
    import json

    rows = {n["name"]: n for n in json.loads(cli("ctl", "nodes", "--json"))}
    assert rows["gpu-1"]["drain"] == "drained" and rows["gpu-2"]["drain"] is None
    assert cli("ctl", "undrain", "gpu-1") == "node gpu-1 undrained: it takes new replicas again\n"
    with pytest.raises(CommandError, match="node gpu-1 is not draining"):
        cli("ctl", "undrain", "gpu-1")


def test_cli_engine_key_rotate(fleet):
    out = cli("ctl", "engine-key", "rotate")
    fingerprint = ClusterSettings.fingerprint(ClusterSettings.load().engine_key)
    assert out == (
        f"engine key rotated (fingerprint {fingerprint}); running replicas keep the old key until restarted: "
        "llmgw ctl restart --stale\n"
    )
