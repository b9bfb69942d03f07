"""cluster.reports, called directly: what an agent's hello, reports and progress do to nodes, replicas and models."""

from datetime import timedelta

import pytest
from django.utils import timezone

from cluster import reports
from cluster.models import ClusterSettings, Event, Model, Node, Replica
from tests.factories import make_agent_node, make_model, make_node, make_replica, node_facts, row_counts

S = Replica.State


def events(kind: str, subject: str | None = None) -> int:
    rows = Event.objects.filter(kind=kind)
    return (rows.filter(subject=subject) if subject is not None else rows).count()


def status(replica: Replica, state: str, **fields) -> dict:
    return {"name": replica.name, "state": state, **fields}


@pytest.fixture
def node(db):
    return make_agent_node("gpu-1")


@pytest.fixture
def model(db):
    return make_model("m1")


# hello


def test_hello_stores_the_cleaned_facts_and_says_so_once(db):
    node = make_node("gpu-1", alive=False)
    facts = node_facts(memory_bytes=8 * 1024**3, gpus=[{"index": 0, "name": "RTX", "memory_bytes": 24 * 1024**3}])
    facts["unexpected"] = "dropped"
    reports.hello(node.pk, facts, [])
    node.refresh_from_db()
    assert node.connected and node.last_seen is not None
    assert node.memory_bytes == 8 * 1024**3
    assert "unexpected" not in node.facts
    assert node.facts["gpus"] == [{"index": 0, "name": "RTX", "memory_bytes": 24 * 1024**3}]
    assert node.facts["engines"] == {"llama.cpp": "b4000"}
    assert node.facts["port_range"] == [21000, 21009]
    [event] = Event.objects.filter(kind="node.facts", subject="gpu-1")
    assert event.actor == "agent:gpu-1"
    assert "8 CPUs, 8.0 GiB offered, 1 GPU(s), engines: llama.cpp b4000" in event.message

    reports.hello(node.pk, facts, [])  # the same facts again: nothing to say
    assert events("node.facts") == 1
    Event.objects.filter(kind="node.facts").update(created_at=timezone.now() - timedelta(minutes=2))
    reports.hello(node.pk, {**facts, "memory_bytes": 4 * 1024**3}, [])
    node.refresh_from_db()
    assert node.memory_bytes == 4 * 1024**3
    assert events("node.facts") == 2


def test_hellos_with_new_facts_again_and_again_do_not_flood_the_log(db):
    node = make_node("gpu-1", alive=False)
    for i in range(200):
        reports.hello(node.pk, node_facts(memory_bytes=(i + 1) * 1024**3), [])
    node.refresh_from_db()
    assert node.memory_bytes == 200 * 1024**3  # the facts are kept, each time
    assert events("node.facts") == 1  # one Event for the interval


def test_hello_applies_the_replicas_the_agent_runs(node, model):
    adopted = make_replica(model, node, S.PENDING)
    reports.hello(node.pk, node.facts, [status(adopted, "ready", pid=4242)])
    adopted.refresh_from_db()
    assert (adopted.state, adopted.pid) == (S.READY, 4242)
    assert events("replica.ready", adopted.name) == 1


def test_clean_facts_fills_defaults():
    assert reports._clean_facts({}) == {
        "hostname": "",
        "cpu_count": 0,
        "memory_bytes": 0,
        "memory_total_bytes": 0,
        "gpus": [],
        "engines": {},
        "port_range": [20000, 20999],
        "agent_version": "",
    }
    clean = reports._clean_facts({"memory_bytes": -5, "engines": {"vllm": None}, "gpus": [{"memory_bytes": "7"}]})
    assert clean["memory_bytes"] == 0
    assert clean["engines"] == {"vllm": ""}
    assert clean["gpus"] == [{"index": 0, "name": "", "memory_bytes": 7}]


@pytest.mark.parametrize("address", ["198.18.0.10", "fd00::5", "node-3.example.com", "gpu1"])
def test_clean_facts_keeps_the_address_an_agent_advertises(address):
    assert reports._clean_facts({"advertise_address": f" {address} "})["advertise_address"] == address
    assert "advertise_address" not in reports._clean_facts({"advertise_address": ""})


@pytest.mark.parametrize(
    "facts",
    [
        None,
        "facts",
        [1, 2],
        {"memory_bytes": "lots"},
        {"memory_bytes": [1]},
        {"memory_bytes": 2**64},
        {"cpu_count": "many"},
        {"gpus": [{"name": "no memory"}]},
        {"gpus": [1]},
        {"gpus": 3},
        {"engines": ["llama.cpp"]},
        {"port_range": [20000]},
        {"port_range": 20000},
        {"port_range": ["a", "b"]},
        {"port_range": [20999, 20000]},
        {"port_range": [0, 10**12]},
        {"advertise_address": "http://10.0.0.1"},
        {"advertise_address": "10.0.0.1:8000"},
        {"advertise_address": "a b"},
        {"advertise_address": "x" * 300},
    ],
)
def test_clean_facts_rejects_garbage_with_value_error(facts):
    with pytest.raises(ValueError):
        reports._clean_facts(facts)


def test_hello_with_garbage_facts_changes_nothing(node):
    before, facts = row_counts(), dict(node.facts)
    with pytest.raises(ValueError):
        reports.hello(node.pk, {"gpus": [1]}, [])
    node.refresh_from_db()
    assert node.facts == facts
    assert row_counts() == before


# report


def test_report_moves_replicas_forward_with_an_event_each(node, model):
    replica = make_replica(model, node, S.PENDING)
    assert reports.report(node.pk, [status(replica, "downloading")], full=False) is False
    assert reports.report(node.pk, [status(replica, "starting", pid=100)], full=False) is False
    replica.refresh_from_db()
    assert (replica.state, replica.pid) == (S.STARTING, 100)
    [starting] = Event.objects.filter(kind="replica.starting", subject=replica.name)
    assert starting.actor == "agent:gpu-1" and f"on port {replica.port}" in starting.message
    assert reports.report(node.pk, [status(replica, "ready", pid=100)], full=False) is False
    replica.refresh_from_db()
    assert replica.state == S.READY
    assert [events(f"replica.{s}", replica.name) for s in ("downloading", "starting", "ready")] == [1, 1, 1]


def test_a_replica_placed_a_while_ago_that_the_agent_does_not_run_has_the_desired_list_sent_again(node, model):
    # the channel layer drops a message that waited past its expiry: the agent was never told of the replica
    told_late = make_replica(model, node, S.PENDING, state_changed_at=timezone.now() - timedelta(seconds=11))
    running = make_replica(model, node, S.READY)
    assert reports.report(node.pk, [status(running, "ready")], full=True) is True
    assert reports.report(node.pk, [status(running, "ready"), status(told_late, "downloading")], full=True) is False
    just_placed = make_replica(model, node, S.PENDING)  # its message may be on its way
    assert reports.report(node.pk, [status(running, "ready"), status(told_late, "downloading")], full=True) is False
    assert reports.report(node.pk, [status(running, "ready")], full=False) is False  # a partial list says nothing
    just_placed.refresh_from_db()
    assert just_placed.state == S.PENDING


def test_report_may_skip_states_but_never_goes_back(node, model):
    replica = make_replica(model, node, S.PENDING)
    reports.report(node.pk, [status(replica, "ready")], full=False)
    replica.refresh_from_db()
    assert replica.state == S.READY
    before = row_counts()
    for state in ("starting", "downloading", "pending", "ready"):
        reports.report(node.pk, [status(replica, state)], full=False)
    replica.refresh_from_db()
    assert replica.state == S.READY
    assert row_counts() == before


def test_report_of_an_adopted_engine_updates_its_pid_without_a_state_change(node, model):
    replica = make_replica(model, node, S.READY, pid=10)
    reports.report(node.pk, [status(replica, "ready", pid=11)], full=False)
    replica.refresh_from_db()
    assert (replica.state, replica.pid) == (S.READY, 11)
    assert not Event.objects.exists()


def test_report_failed_keeps_reason_and_log_and_backs_the_model_off(node, model, settings):
    settings.LLMGW_BACKOFF_BASE, settings.LLMGW_BACKOFF_CAP = 5, 300
    replica = make_replica(model, node, S.STARTING)
    before = timezone.now()
    left = reports.report(
        node.pk, [status(replica, "failed", reason="exit code 1", log_tail="x" * 9000 + "the end")], full=False
    )
    assert left is True  # it left the desired list: the consumer sends the list again
    replica.refresh_from_db()
    assert replica.state == S.FAILED
    assert replica.reason == "exit code 1"
    assert len(replica.log_tail) == 8000 and replica.log_tail.endswith("the end")
    model.refresh_from_db()
    assert model.failures == 1
    assert before + timedelta(seconds=5) <= model.backoff_until <= timezone.now() + timedelta(seconds=5)
    [event] = Event.objects.filter(kind="replica.failed", subject=replica.name)
    assert event.actor == "agent:gpu-1" and "exit code 1" in event.message


def test_backoff_doubles_up_to_the_cap(node, model, settings):
    settings.LLMGW_BACKOFF_BASE, settings.LLMGW_BACKOFF_CAP = 5, 30
    delays = []
    for _ in range(5):
        replica = make_replica(model, node, S.STARTING)
        before = timezone.now()
        reports.report(node.pk, [status(replica, "failed")], full=False)
        model.refresh_from_db()
        delays.append(round((model.backoff_until - before).total_seconds()))
    assert delays == [5, 10, 20, 30, 30]
    assert model.failures == 5


def test_ready_resets_the_backoff(node, model):
    Model.objects.filter(pk=model.pk).update(failures=4, backoff_until=timezone.now() + timedelta(minutes=5))
    replica = make_replica(model, node, S.STARTING)
    reports.report(node.pk, [status(replica, "ready")], full=False)
    model.refresh_from_db()
    assert (model.failures, model.backoff_until) == (0, None)


def test_a_replica_that_stops_unasked_failed(node, model):
    replica = make_replica(model, node, S.READY)
    assert reports.report(node.pk, [status(replica, "stopped")], full=False) is True
    replica.refresh_from_db()
    assert replica.state == S.FAILED
    assert replica.reason == "engine stopped without being asked"
    assert Model.objects.get(pk=model.pk).failures == 1


def test_an_engine_stopped_on_purpose_on_its_node_is_stopped_not_failed(node, model):
    # what the next agent says of the engines `llmgw up` stopped on Ctrl-C: no failure, no back-off
    replica = make_replica(model, node, S.READY)
    reason = "stopped with `llmgw up`"
    reports.hello(node.pk, node_facts(), [status(replica, "stopped", on_purpose=True, reason=reason)])
    replica.refresh_from_db()
    assert (replica.state, replica.reason) == (S.STOPPED, reason)
    model.refresh_from_db()
    assert (model.failures, model.backoff_until) == (0, None)
    assert events("replica.failed") == 0 and events("replica.stopped", replica.name) == 1
    # `on_purpose` must be the boolean true: anything else is the old meaning, a crash
    other = make_replica(model, node, S.READY)
    reports.report(node.pk, [status(other, "stopped", on_purpose="yes")], full=False)
    assert Replica.objects.get(pk=other.pk).state == S.FAILED


def test_a_draining_replica_stays_draining_until_it_fails_or_stops(node, model):
    replica = make_replica(model, node, S.DRAINING)
    reports.report(node.pk, [status(replica, "ready")], full=False)
    replica.refresh_from_db()
    assert replica.state == S.DRAINING
    reports.report(node.pk, [status(replica, "failed", reason="oom")], full=False)
    replica.refresh_from_db()
    assert (replica.state, replica.reason) == (S.FAILED, "oom")


@pytest.mark.parametrize("reported", ["stopped", "failed"])
def test_a_stopping_replica_that_exited_is_stopped_without_back_off(node, model, reported):
    replica = make_replica(model, node, S.STOPPING)
    reports.report(node.pk, [status(replica, "ready")], full=False)
    replica.refresh_from_db()
    assert replica.state == S.STOPPING
    assert reports.report(node.pk, [status(replica, reported)], full=False) is True
    replica.refresh_from_db()
    assert replica.state == S.STOPPED
    assert events("replica.stopped", replica.name) == 1
    assert Model.objects.get(pk=model.pk).failures == 0


def test_a_full_report_without_a_stopping_replica_marks_it_stopped(node, model):
    stopping = make_replica(model, node, S.STOPPING, reason="surplus")
    ready = make_replica(model, node, S.READY)
    pending = make_replica(model, node, S.PENDING)
    assert reports.report(node.pk, [status(ready, "ready")], full=False) is False
    assert Replica.objects.get(pk=stopping.pk).state == S.STOPPING  # a partial report says nothing of the rest

    assert reports.report(node.pk, [status(ready, "ready")], full=True) is True
    stopping.refresh_from_db()
    assert (stopping.state, stopping.reason) == (S.STOPPED, "surplus")
    assert events("replica.stopped", stopping.name) == 1
    # Only a stopping replica is concluded stopped; a missing pending one is still to be started.
    assert Replica.objects.get(pk=pending.pk).state == S.PENDING
    assert Replica.objects.get(pk=ready.pk).state == S.READY


def test_terminal_replicas_and_unknown_states_are_left_alone(node, model):
    failed = make_replica(model, node, S.FAILED, reason="boom")
    pending = make_replica(model, node, S.PENDING)
    before = row_counts()
    reports.report(node.pk, [status(failed, "ready"), status(pending, "exploded"), {"state": "ready"}], full=True)
    assert Replica.objects.get(pk=failed.pk).state == S.FAILED
    assert Replica.objects.get(pk=pending.pk).state == S.PENDING
    assert row_counts() == before


def test_reports_for_replicas_of_another_node_are_ignored(node, model):
    other = make_agent_node("gpu-2")
    theirs = make_replica(model, other, S.PENDING)
    stopping = make_replica(model, other, S.STOPPING)
    before = row_counts()
    assert reports.report(node.pk, [status(theirs, "ready"), status(stopping, "stopped")], full=True) is False
    assert reports.report(node.pk, [status(theirs, "failed")], full=False) is False
    assert Replica.objects.get(pk=theirs.pk).state == S.PENDING
    assert Replica.objects.get(pk=stopping.pk).state == S.STOPPING
    assert Model.objects.get(pk=model.pk).failures == 0
    assert row_counts() == before


def test_a_report_marks_the_node_seen(node):
    Node.objects.filter(pk=node.pk).update(connected=False, last_seen=timezone.now() - timedelta(hours=1))
    reports.report(node.pk, [], full=True)
    node.refresh_from_db()
    assert node.connected and timezone.now() - node.last_seen < timedelta(seconds=5)


# the node's stream: only the one that connected last moves `connected` and `last_seen`


def test_an_old_streams_late_disconnect_after_a_reconnect_leaves_the_node_connected(node):
    reports.connected(node, "10.0.0.1", "stream-old")
    reports.connected(node, "10.0.0.1", "stream-new")  # the agent reconnected before its old socket died
    reports.disconnected(node.pk, "stream-old")  # the old socket's close comes late
    node.refresh_from_db()
    assert node.connected
    assert events("node.disconnected", "gpu-1") == 0

    reports.disconnected(node.pk, "stream-new")
    node.refresh_from_db()
    assert not node.connected
    assert events("node.disconnected", "gpu-1") == 1


def test_an_old_streams_report_and_heartbeat_change_nothing_of_the_node(node):
    reports.connected(node, "10.0.0.1", "stream-old")
    reports.connected(node, "10.0.0.1", "stream-new")
    reports.disconnected(node.pk, "stream-new")
    node.refresh_from_db()
    gone_at = node.last_seen
    reports.seen(node.pk, "stream-old")
    reports.report(node.pk, [], False, "stream-old")
    reports.hello(node.pk, node_facts(), [], "stream-old")
    node.refresh_from_db()
    assert (node.connected, node.last_seen) == (False, gone_at)


def test_a_heartbeat_that_connects_a_silent_node_again_says_so(node):
    reports.connected(node, "10.0.0.1", "stream-1")
    Node.objects.filter(pk=node.pk).update(connected=False)  # the reconciler had marked it, for its silence
    before = events("node.connected", "gpu-1")
    reports.seen(node.pk, "stream-1")
    node.refresh_from_db()
    assert node.connected
    assert events("node.connected", "gpu-1") == before + 1
    reports.seen(node.pk, "stream-1")  # connected already: only seen
    assert events("node.connected", "gpu-1") == before + 1


def test_a_report_for_a_removed_node_does_nothing(db):
    assert reports.report(999_999, [{"name": "x", "state": "ready"}], full=True) is False


@pytest.mark.parametrize(
    "statuses",
    [
        ["not a status"],
        [1],
        [{"name": "NAME", "state": "starting", "pid": "abc"}],
        [{"name": "NAME", "state": "starting", "pid": -5}],
        [{"name": "NAME", "state": "starting", "pid": 2**40}],
    ],
)
def test_a_malformed_report_is_refused_and_changes_nothing(node, model, statuses):
    replica = make_replica(model, node, S.PENDING)
    statuses = [{**s, "name": replica.name} if isinstance(s, dict) else s for s in statuses]
    before = row_counts()
    with pytest.raises(ValueError):
        reports.report(node.pk, statuses, full=True)
    replica.refresh_from_db()
    assert (replica.state, replica.pid) == (S.PENDING, None)
    assert row_counts() == before


# progress


def test_progress_moves_pending_to_downloading_once(node, model):
    replica = make_replica(model, node, S.PENDING)
    reports.progress(node.pk, replica.name, 10, 100)
    replica.refresh_from_db()
    assert (replica.state, replica.download_done, replica.download_total) == (S.DOWNLOADING, 10, 100)
    [event] = Event.objects.filter(kind="replica.downloading", subject=replica.name)
    assert event.actor == "agent:gpu-1"
    reports.progress(node.pk, replica.name, 90, 100)
    replica.refresh_from_db()
    assert (replica.state, replica.download_done) == (S.DOWNLOADING, 90)
    assert events("replica.downloading") == 1


def test_progress_does_not_move_a_replica_further_along(node, model):
    replica = make_replica(model, node, S.STARTING)
    reports.progress(node.pk, replica.name, 5, 10)
    replica.refresh_from_db()
    assert (replica.state, replica.download_done) == (S.STARTING, 5)
    assert not Event.objects.exists()


def test_progress_for_another_nodes_replica_or_an_unknown_one_is_ignored(node, model):
    theirs = make_replica(model, make_agent_node("gpu-2"), S.PENDING)
    before = row_counts()
    reports.progress(node.pk, theirs.name, 10, 100)
    reports.progress(node.pk, "nope-00000000", 10, 100)
    theirs.refresh_from_db()
    assert (theirs.state, theirs.download_done) == (S.PENDING, 0)
    assert row_counts() == before


@pytest.mark.parametrize("done, total", [(-1, 100), (10, -1), (2**63, 2**63), (0, 2**70)])
def test_progress_out_of_range_is_refused(node, model, done, total):
    replica = make_replica(model, node, S.PENDING)
    with pytest.raises(ValueError):
        reports.progress(node.pk, replica.name, done, total)
    replica.refresh_from_db()
    assert (replica.state, replica.download_done) == (S.PENDING, 0)


# desired


def test_desired_lists_the_running_replicas_with_what_they_were_started_with(node, model):
    model.profile.context_size = 1234  # edited after the replicas started: they keep their snapshot
    model.profile.save()
    snapshot = {"args": {"context_size": 512, "extra_args": ["--x"]}, "engine": {"name": "old", "kind": "llama.cpp"}}
    running = {s: make_replica(model, node, s, snapshot=snapshot) for s in sorted(Replica.RUNNING)}
    for s in (S.STOPPING, S.STOPPED, S.FAILED):
        make_replica(model, node, s, snapshot=snapshot)
    make_replica(model, make_agent_node("gpu-2"), S.READY)
    unsnapped = make_replica(model, node, S.PENDING)
    key = ClusterSettings.load().engine_key

    desired = reports.desired(node.pk, "http://server.test:8000/")
    assert desired["type"] == "desired"
    by_name = {r["name"]: r for r in desired["replicas"]}
    assert set(by_name) == {r.name for r in running.values()} | {unsnapped.name}
    assert [r["name"] for r in desired["replicas"]] == sorted(by_name)
    ready = by_name[running[S.READY].name]
    assert ready == {
        "name": running[S.READY].name,
        "model": "m1",
        "engine": snapshot["engine"],
        "args": snapshot["args"],
        "file": {
            "sha256": model.file.sha256,
            "name": model.file.name,
            "size": model.file.size,
            "url": f"http://server.test:8000/mirror/{model.file.sha256}",
        },
        "port": running[S.READY].port,
        "gpu_index": None,
        "engine_key": key,
    }
    # Without a snapshot (a row from before snapshots), the model's current engine and profile.
    assert by_name[unsnapped.name]["args"] == model.profile.args()
    assert by_name[unsnapped.name]["args"]["context_size"] == 1234
    assert by_name[unsnapped.name]["engine"] == model.engine.spec()


def test_a_replica_without_a_port_is_left_out_of_its_nodes_desired_list_and_the_rest_go(node, model, caplog):
    fine = make_replica(model, node, S.READY)
    portless = make_replica(model, node, S.STARTING)
    Replica.objects.filter(pk=portless.pk).update(port=None)  # never made so: the reconciler places with a port
    assert [r["name"] for r in reports.desired(node.pk, "http://x")["replicas"]] == [fine.name]
    assert f"replica {portless.name} is placed without a port" in caplog.text


def test_desired_for_a_node_without_replicas_is_empty(node):
    assert reports.desired(node.pk, "http://x") == {"type": "desired", "replicas": []}


# connected / disconnected


def test_connected_and_disconnected_write_events(db):
    node = make_node("gpu-1", alive=False)
    reports.connected(node, "10.0.0.7")
    node.refresh_from_db()
    assert (node.connected, node.address) == (True, "10.0.0.7")
    assert events("node.connected", "gpu-1") == 1
    reports.disconnected(node.pk)
    reports.disconnected(node.pk)  # twice: said once
    node.refresh_from_db()
    assert not node.connected
    assert events("node.disconnected", "gpu-1") == 1


def gateway_reloads(action) -> int:
    """How many `routing.changed` messages the gateways hear from `action` (its commit's messages sent), read
    from the real channel layer up to a message of our own sent after them."""
    from asgiref.sync import async_to_sync, sync_to_async
    from channels.layers import get_channel_layer

    from cluster import notify

    layer = get_channel_layer()

    async def listen(step) -> int:
        channel = await layer.new_channel()
        await layer.group_add(notify.GATEWAY_GROUP, channel)
        try:
            await sync_to_async(step)()
            await layer.send(channel, {"type": "end"})
            heard = 0
            while (await layer.receive(channel))["type"] != "end":
                heard += 1
            return heard
        finally:
            await layer.group_discard(notify.GATEWAY_GROUP, channel)

    return async_to_sync(listen)(action)


def test_an_agent_connecting_from_a_new_address_reloads_the_gateways_only_where_a_route_moves(
        db, model, django_capture_on_commit_callbacks):
    # hundreds of new nodes connecting at once made every web process reload its table hundreds of times
    empty = make_node("gpu-1", alive=False)
    serving = make_node("gpu-2", alive=False, address="10.0.0.8")
    make_replica(model, serving, S.READY)

    def connect(node, address):
        def step():
            with django_capture_on_commit_callbacks(execute=True):
                reports.connected(node, address)
        return step

    assert gateway_reloads(connect(empty, "10.0.0.7")) == 0  # no replica: no route to move
    assert gateway_reloads(connect(serving, "10.0.0.8")) == 0  # back from where it was
    assert gateway_reloads(connect(serving, "10.0.0.9")) == 1  # its engines are dialled elsewhere now
    serving.refresh_from_db()
    assert (serving.connected, serving.address) == (True, "10.0.0.9")


def test_node_for_token(db):
    node = make_node("gpu-1")
    assert reports.node_for_token("token-gpu-1") == node
    assert reports.node_for_token("token-gpu-2") is None
    assert reports.node_for_token("") is None


def test_hello_with_a_bad_replica_list_changes_nothing(node, model):
    replica = make_replica(model, node, S.PENDING)
    before, facts = row_counts(), dict(node.facts)
    with pytest.raises(ValueError):
        reports.hello(node.pk, node_facts(memory_bytes=1), [{"name": replica.name, "state": "ready"}, "garbage"])
    node.refresh_from_db()
    assert (node.facts, node.memory_bytes) == (facts, facts["memory_bytes"])
    assert Replica.objects.get(pk=replica.pk).state == S.PENDING
    assert row_counts() == before
