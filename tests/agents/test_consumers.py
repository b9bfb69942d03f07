"""The agent stream, `/ws/agent/`, through the project's ASGI application with channels' WebsocketCommunicator."""

import asyncio
import json

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from agents.consumers import REFUSED
from cluster import operations
from cluster.models import ClusterSettings, Event, Model, Node, Replica
from cluster.notify import TRY_AGAIN, agent_group
from llmgw.asgi import application
from tests.factories import make_model, make_replica, node_facts, seed_defaults
from tests.sockets import ends_by_itself

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

S = Replica.State
HOST = "llmgw.test:8000"
GIB = 1024**3
FACTS = node_facts(memory_bytes=12 * GIB, port_range=(21000, 21009))
TIMEOUT = 3


@pytest.fixture(autouse=True)
def llmgw_test_is_ours(settings):
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "llmgw.test"]  # the name the agents here dial


def stream(token: str | None = None, authorization: str | None = None, host: str = HOST) -> WebsocketCommunicator:
    headers = [(b"host", host.encode())]
    if authorization is None and token is not None:
        authorization = f"Bearer {token}"
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    communicator = WebsocketCommunicator(application, "/ws/agent/", headers=headers)
    communicator.scope["client"] = ["10.0.0.7", 40000]  # read when the consumer starts, at the first await
    return communicator


@database_sync_to_async
def node_row(pk: int) -> Node:
    return Node.objects.get(pk=pk)


@database_sync_to_async
def replica_row(replica: Replica) -> Replica:
    return Replica.objects.get(pk=replica.pk)


@database_sync_to_async
def event_kinds(subject: str | None = None) -> list[str]:
    rows = Event.objects.all() if subject is None else Event.objects.filter(subject=subject)
    return sorted(rows.values_list("kind", flat=True))


@database_sync_to_async
def fetch(query):
    return query()


async def open_stream(token: str) -> WebsocketCommunicator:
    communicator = stream(token)
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    return communicator


async def hello(communicator, facts=FACTS, replicas=()) -> dict:
    await communicator.send_json_to({"type": "hello", "facts": facts, "replicas": list(replicas)})
    desired = await communicator.receive_json_from(timeout=TIMEOUT)
    assert desired["type"] == "desired"
    return desired


async def report(communicator, *statuses, full: bool = False) -> None:
    await communicator.send_json_to({"type": "report", "replicas": list(statuses), "full": full})


async def settle(communicator) -> dict:
    """The consumer handles messages in order: once a hello is answered, everything sent before it is done."""
    return await hello(communicator)


@pytest.fixture(autouse=True)
def _setup(transactional_db, settings):
    seed_defaults()  # an earlier transactional test's flush may have taken the engines and the profile
    settings.LLMGW_PUBLIC_URL = ""


@pytest.fixture
def node_token(transactional_db):
    """(node, token) as `llmgw node add` makes them."""
    return operations.add_node("gpu-1", "test")


@pytest.fixture
def model(transactional_db):
    return make_model("m1", memory_bytes=GIB)


# Who may connect


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Bearer lnt_wrong", "Basic bG50Og==", "TOKEN-AS-IS"],
)
async def test_a_stream_without_the_right_token_is_refused_and_changes_nothing(node_token, authorization):
    node, token = node_token
    if authorization == "TOKEN-AS-IS":
        authorization = token  # the token itself, without "Bearer "
    before = await fetch(lambda: Event.objects.count())
    communicator = stream(authorization=authorization)
    assert await communicator.connect(timeout=TIMEOUT) == (False, REFUSED)
    # The socket ends. So soon after the start, the consumer's channel-layer receive is still opening its Redis
    # connection, and redis-py (Python 3.11) swallows that first cancel; the communicator's own cancel after the
    # short timeout ends it.
    await communicator.disconnect(timeout=0.2)
    assert not (await node_row(node.pk)).connected
    assert await fetch(lambda: Event.objects.count()) == before


async def test_the_right_token_connects_and_marks_the_node_connected(node_token):
    node, token = node_token
    communicator = await open_stream(token)
    row = await node_row(node.pk)
    assert (row.connected, row.address) == (True, "10.0.0.7")
    assert row.last_seen is not None
    [event] = await fetch(lambda: list(Event.objects.filter(kind="node.connected")))
    assert (event.actor, event.subject) == ("agent:gpu-1", "gpu-1")
    assert "10.0.0.7" in event.message
    await communicator.disconnect()


async def test_disconnect_marks_the_node_disconnected(node_token):
    node, token = node_token
    communicator = await open_stream(token)
    await communicator.disconnect()
    assert not (await node_row(node.pk)).connected
    [event] = await fetch(lambda: list(Event.objects.filter(kind="node.disconnected")))
    assert (event.actor, event.subject) == ("agent:gpu-1", "gpu-1")


async def test_a_closed_stream_ends_even_if_the_channel_layer_swallows_its_cancel(node_token, a_swallowed_cancel):
    # else the consumer waits for a message for ever, and a web process's graceful stop with it
    communicator = await open_stream(node_token[1])
    assert await ends_by_itself(communicator)
    assert not (await node_row(node_token[0].pk)).connected


# hello and desired


async def test_hello_updates_the_facts_and_is_answered_with_the_desired_list(node_token, model):
    node, token = node_token
    snapshot = {"args": {"context_size": 777, "extra_args": []}, "engine": {"name": "llama.cpp", "kind": "llama.cpp"}}

    @database_sync_to_async
    def replicas():
        rows = {s: make_replica(model, node, s, snapshot=snapshot) for s in S.values}
        make_replica(model, operations.add_node("gpu-2", "test")[0], S.READY, snapshot=snapshot)
        return rows

    rows = await replicas()
    key = await fetch(lambda: ClusterSettings.load().engine_key)
    communicator = await open_stream(token)
    desired = await hello(communicator)

    row = await node_row(node.pk)
    assert row.facts == FACTS
    assert row.memory_bytes == 12 * GIB
    assert "node.facts" in await event_kinds("gpu-1")

    listed = {r["name"]: r for r in desired["replicas"]}
    assert set(listed) == {rows[s].name for s in (S.PENDING, S.DOWNLOADING, S.STARTING, S.READY, S.DRAINING)}
    ready = rows[S.READY]
    assert listed[ready.name] == {
        "name": ready.name,
        "model": "m1",
        "engine": snapshot["engine"],
        "args": snapshot["args"],
        "file": {
            "sha256": model.file.sha256,
            "name": model.file.name,
            "size": model.file.size,
            "url": f"http://{HOST}/mirror/{model.file.sha256}",
        },
        "port": ready.port,
        "gpu_index": None,
        "engine_key": key,
    }
    await communicator.disconnect()


async def test_the_public_url_wins_over_the_host_header(node_token, model, settings):
    settings.LLMGW_PUBLIC_URL = "https://llmgw.example.org/"
    node, token = node_token
    await database_sync_to_async(make_replica)(model, node, S.PENDING)
    communicator = await open_stream(token)
    [replica] = (await hello(communicator))["replicas"]
    assert replica["file"]["url"] == f"https://llmgw.example.org/mirror/{model.file.sha256}"
    await communicator.disconnect()


async def test_a_host_the_server_does_not_answer_to_is_refused_unless_the_public_url_is_set(node_token, model, settings):
    """The Host an agent dials is where it would download model files from: a forged one is refused, as an HTTP
    request with it would be; with LLMGW_PUBLIC_URL set, the Host is not used."""
    node, token = node_token
    await database_sync_to_async(make_replica)(model, node, S.PENDING)
    refused = stream(token, host="attacker.example:80")
    assert await refused.connect(timeout=TIMEOUT) == (False, REFUSED)
    assert await ends_by_itself(refused)  # the server's disconnect that follows ends the consumer
    assert not (await node_row(node.pk)).connected
    settings.LLMGW_PUBLIC_URL = "https://llmgw.example.org"
    communicator = stream(token, host="attacker.example:80")
    assert (await communicator.connect(timeout=TIMEOUT))[0]
    [replica] = (await hello(communicator))["replicas"]
    assert replica["file"]["url"] == f"https://llmgw.example.org/mirror/{model.file.sha256}"
    await communicator.disconnect()


async def test_hello_with_the_replicas_the_agent_runs_adopts_them(node_token, model):
    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.PENDING)
    communicator = await open_stream(token)
    desired = await hello(communicator, replicas=[{"name": replica.name, "state": "ready", "pid": 77}])
    assert [r["name"] for r in desired["replicas"]] == [replica.name]
    row = await replica_row(replica)
    assert (row.state, row.pid) == (S.READY, 77)
    await communicator.disconnect()


async def test_group_send_makes_the_stream_send_a_fresh_desired_list(node_token, model):
    node, token = node_token
    communicator = await open_stream(token)
    assert (await hello(communicator))["replicas"] == []
    replica = await database_sync_to_async(make_replica)(model, node, S.PENDING)
    await get_channel_layer().group_send(agent_group(node.pk), {"type": "send.desired"})
    desired = await communicator.receive_json_from(timeout=TIMEOUT)
    assert desired["type"] == "desired"
    assert [r["name"] for r in desired["replicas"]] == [replica.name]
    await communicator.disconnect()


async def test_group_send_restart_agent_is_passed_on(node_token):
    node, token = node_token
    communicator = await open_stream(token)
    await get_channel_layer().group_send(agent_group(node.pk), {"type": "send.restart_agent"})
    assert await communicator.receive_json_from(timeout=TIMEOUT) == {"type": "restart_agent"}
    await communicator.disconnect()


async def test_a_reset_token_closes_the_stream(node_token):
    node, token = node_token
    communicator = await open_stream(token)
    await get_channel_layer().group_send(agent_group(node.pk), {"type": "agent.close"})
    assert await communicator.receive_output(timeout=TIMEOUT) == {"type": "websocket.close", "code": REFUSED}
    await communicator.disconnect()
    assert not (await node_row(node.pk)).connected


# report


async def test_reports_move_replicas_forward_never_back(node_token, model):
    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.PENDING)
    communicator = await open_stream(token)
    await hello(communicator)

    await report(communicator, {"name": replica.name, "state": "starting", "pid": 50})
    await settle(communicator)
    row = await replica_row(replica)
    assert (row.state, row.pid) == (S.STARTING, 50)

    await report(communicator, {"name": replica.name, "state": "ready", "pid": 50})
    await settle(communicator)
    assert (await replica_row(replica)).state == S.READY

    await report(communicator, {"name": replica.name, "state": "starting", "pid": 50})
    await settle(communicator)
    assert (await replica_row(replica)).state == S.READY
    assert await event_kinds(replica.name) == ["replica.ready", "replica.starting"]
    assert await communicator.receive_nothing(timeout=0.05)
    await communicator.disconnect()


async def test_a_report_the_same_as_the_last_is_a_heartbeat_and_is_applied_again_after_a_change(node_token, model,
                                                                                                  monkeypatch):
    """Hundreds of agents report every 5 s: one that says what it said last only says it is alive (the node's
    last_seen), not a whole report's transaction; once its list changed, or after REAPPLY_EVERY, it is applied."""
    from agents import consumers

    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.STARTING)
    communicator = await open_stream(token)
    await hello(communicator)
    await report(communicator, {"name": replica.name, "state": "ready", "pid": 50}, full=True)
    await settle(communicator)
    assert (await replica_row(replica)).state == S.READY
    applied = []
    real = consumers.reports.report
    # the stream's own calls (a hello applies its replicas through it too, by keyword)
    monkeypatch.setattr(consumers.reports, "report", lambda *a, **k: (applied.append(a) if not k else None) or real(*a, **k))
    seen = (await node_row(node.pk)).last_seen
    await report(communicator, {"name": replica.name, "state": "ready", "pid": 50}, full=True)
    await settle(communicator)
    assert applied == [] and (await node_row(node.pk)).last_seen > seen

    # the server stops it meanwhile and says so: the same report is applied whole (still running, so stopping)
    await fetch(lambda: Replica.objects.filter(pk=replica.pk).update(state=S.STOPPING))
    await get_channel_layer().group_send(agent_group(node.pk), {"type": "send.desired"})
    assert (await communicator.receive_json_from(timeout=TIMEOUT))["replicas"] == []
    await report(communicator, {"name": replica.name, "state": "ready", "pid": 50}, full=True)
    await settle(communicator)
    assert len(applied) == 1
    await report(communicator, full=True)  # stopped: a report that differs
    await settle(communicator)
    await communicator.receive_json_from(timeout=TIMEOUT)  # it left the list: sent again, besides the hello's
    assert len(applied) == 2 and (await replica_row(replica)).state == S.STOPPED

    monkeypatch.setattr(consumers, "REAPPLY_EVERY", 0.0)
    await report(communicator, full=True)
    await settle(communicator)
    assert len(applied) == 3
    await communicator.disconnect()


async def test_a_failed_report_keeps_why_backs_off_and_sends_the_list_again(node_token, model):
    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.STARTING)
    communicator = await open_stream(token)
    await hello(communicator)

    await report(communicator, {"name": replica.name, "state": "failed", "reason": "exit 1", "log_tail": "oops"})
    desired = await communicator.receive_json_from(timeout=TIMEOUT)  # it left the list: the agent hears at once
    assert desired == {"type": "desired", "replicas": []}
    row = await replica_row(replica)
    assert (row.state, row.reason, row.log_tail) == (S.FAILED, "exit 1", "oops")
    model_row = await fetch(lambda: Model.objects.get(pk=model.pk))
    assert model_row.failures == 1 and model_row.backoff_until is not None
    assert await event_kinds(replica.name) == ["replica.failed"]
    await communicator.disconnect()


async def test_a_full_report_without_a_stopping_replica_marks_it_stopped(node_token, model):
    node, token = node_token
    stopping = await database_sync_to_async(make_replica)(model, node, S.STOPPING)
    ready = await database_sync_to_async(make_replica)(model, node, S.READY)
    communicator = await open_stream(token)
    assert [r["name"] for r in (await hello(communicator))["replicas"]] == [ready.name]

    await report(communicator, {"name": ready.name, "state": "ready"}, full=True)
    desired = await communicator.receive_json_from(timeout=TIMEOUT)
    assert [r["name"] for r in desired["replicas"]] == [ready.name]
    assert (await replica_row(stopping)).state == S.STOPPED
    assert (await replica_row(ready)).state == S.READY
    assert await event_kinds(stopping.name) == ["replica.stopped"]
    await communicator.disconnect()


async def test_progress_moves_pending_to_downloading(node_token, model):
    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.PENDING)
    communicator = await open_stream(token)
    await communicator.send_json_to({"type": "progress", "replica": replica.name, "done": 5, "total": 10})
    await settle(communicator)
    row = await replica_row(replica)
    assert (row.state, row.download_done, row.download_total) == (S.DOWNLOADING, 5, 10)
    await communicator.disconnect()


# Garbage in


MALFORMED = [
    [1, 2, 3],
    "hello",
    42,
    None,
    {},
    {"type": None},
    {"type": "bogus"},
    {"type": ["hello"]},
    {"type": {"hello": 1}},
    {"type": "hello"},
    {"type": "hello", "facts": "x"},
    {"type": "hello", "facts": {"gpus": [1]}},
    {"type": "hello", "facts": {"engines": ["llama.cpp"]}},
    {"type": "hello", "facts": {"port_range": [1]}},
    {"type": "hello", "facts": {"memory_bytes": "lots"}},
    {"type": "hello", "facts": {"memory_bytes": 2**70}},
    {"type": "hello", "facts": FACTS, "replicas": ["x"]},
    {"type": "report", "replicas": 5},
    {"type": "report", "replicas": "abc"},
    {"type": "report", "replicas": [1, None]},
    {"type": "report", "replicas": [{"name": "REPLICA", "state": "ready", "pid": "x"}]},
    {"type": "report", "replicas": [{"name": "REPLICA", "state": "ready", "pid": -3}]},
    {"type": "report", "replicas": [{"name": "REPLICA", "state": "ready", "pid": 2**40}]},
    {"type": "progress"},
    {"type": "progress", "replica": "REPLICA", "done": "x", "total": 1},
    {"type": "progress", "replica": "REPLICA", "done": 2**70, "total": 2**70},
    {"type": "progress", "replica": "REPLICA", "done": -1, "total": 10},
]


async def test_malformed_messages_are_ignored_and_the_stream_stays_open(node_token, model):
    node, token = node_token
    replica = await database_sync_to_async(make_replica)(model, node, S.PENDING)
    communicator = await open_stream(token)
    await hello(communicator)
    before = await fetch(lambda: Event.objects.count())
    for message in MALFORMED:
        await communicator.send_to(text_data=json.dumps(message).replace("REPLICA", replica.name))
    await communicator.send_to(text_data="{not json")
    await communicator.send_to(bytes_data=b"\x00\x01binary")
    # numbers JSON has no place for (Python's json reads them): each message is refused, the stream stays
    hello_facts = json.dumps({"type": "hello", "facts": FACTS, "replicas": []})
    for number in ("Infinity", "-Infinity", "NaN", "1e400"):
        await communicator.send_to(text_data=hello_facts.replace(str(FACTS["memory_bytes"]), number))
        await communicator.send_to(text_data=json.dumps(
            {"type": "progress", "replica": replica.name, "done": 0, "total": 1}).replace('"done": 0', f'"done": {number}'))
    # Still open, still answering: and once this hello (the same facts) is answered, all the above was handled.
    desired = await settle(communicator)
    assert [r["name"] for r in desired["replicas"]] == [replica.name]
    assert await communicator.receive_nothing(timeout=0.05)  # nothing else was sent for the garbage

    row = await replica_row(replica)
    assert (row.state, row.pid, row.download_done) == (S.PENDING, None, 0)
    assert (await node_row(node.pk)).facts == FACTS
    assert await fetch(lambda: Event.objects.count()) == before
    await communicator.disconnect()


# Two streams for one node


async def test_a_second_stream_supersedes_the_first(node_token):
    node, token = node_token
    first = await open_stream(token)
    second = await open_stream(token)
    assert await first.receive_output(timeout=TIMEOUT) == {"type": "websocket.close", "code": 4000}
    await first.disconnect()  # the old socket ends: the node stays connected through the new one
    assert (await node_row(node.pk)).connected
    assert "node.disconnected" not in await event_kinds("gpu-1")

    await hello(second)
    await get_channel_layer().group_send(agent_group(node.pk), {"type": "send.desired"})
    assert (await second.receive_json_from(timeout=TIMEOUT))["type"] == "desired"
    assert await first.receive_nothing(timeout=0.05)

    await second.disconnect()
    assert not (await node_row(node.pk)).connected
    assert (await event_kinds("gpu-1")).count("node.disconnected") == 1


async def test_one_nodes_slow_database_work_holds_up_no_other_nodes_stream(on_postgresql, node_token):
    """Each stream's database work runs on threads of the streams' own, several at once: on one thread for the
    whole process, hundreds of agents connecting at once each waited for all the work queued before theirs. On
    PostgreSQL: SQLite locks the whole file, one writer at a time is all it has."""
    import threading

    from django.db import connection, transaction

    slow, slow_token = node_token
    _, quick_token = await database_sync_to_async(operations.add_node)("gpu-2", "test")
    locked, release = threading.Event(), threading.Event()

    def hold_the_row():  # another transaction holds the slow node's row: its hello waits for it
        try:
            with transaction.atomic():
                Node.objects.select_for_update().get(pk=slow.pk)
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    waiting = await open_stream(slow_token)
    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert await asyncio.to_thread(locked.wait, 10)
        await waiting.send_json_to({"type": "hello", "facts": FACTS, "replicas": []})
        assert await waiting.receive_nothing(timeout=0.3)  # held up by the lock
        quick = await open_stream(quick_token)
        assert (await hello(quick))["replicas"] == []  # not held up behind it
    finally:
        release.set()
        await asyncio.to_thread(holder.join, 30)
    assert (await waiting.receive_json_from(timeout=TIMEOUT))["type"] == "desired"  # and then it goes on
    await quick.disconnect()
    await waiting.disconnect()


# The agent closes while its messages are still being handled


@pytest.mark.parametrize("refusal", [
    OSError("the peer closed the socket"),  # what uvicorn's ClientDisconnected is
    RuntimeError("Unexpected ASGI message 'websocket.send', after sending 'websocket.close' or response already "
                 "completed."),  # uvicorn, once it has finished the socket
])
async def test_an_answer_the_closed_socket_refuses_is_that_close_not_a_fault(node_token, caplog, refusal) -> None:
    """The agent sends a hello and closes; the server refuses the answer (an OSError, as the ASGI spec has a server
    do for a send after the close, or uvicorn's RuntimeError) before the consumer has heard the close: the hello
    still counts, nothing is logged as a failure, and the stream ends as a closed stream does."""
    node, token = node_token
    incoming: asyncio.Queue = asyncio.Queue()
    closed = asyncio.Event()
    refused = asyncio.Event()
    accepted = asyncio.Event()

    async def send(message):
        if message["type"] == "websocket.accept":
            accepted.set()
        elif closed.is_set():
            refused.set()
            raise refusal

    scope = {**stream(token).scope, "client": ["10.0.0.7", 40000]}
    app = asyncio.ensure_future(application(scope, incoming.get, send))
    await incoming.put({"type": "websocket.connect"})
    await asyncio.wait_for(accepted.wait(), TIMEOUT)
    closed.set()
    facts = {**FACTS, "memory_bytes": 3 * GIB}
    await incoming.put({"type": "websocket.receive", "text": json.dumps({"type": "hello", "facts": facts, "replicas": []})})
    await asyncio.wait_for(refused.wait(), TIMEOUT)
    await incoming.put({"type": "websocket.disconnect", "code": 1000})
    await asyncio.wait_for(app, TIMEOUT)

    assert (await node_row(node.pk)).memory_bytes == 3 * GIB
    assert not (await node_row(node.pk)).connected
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text



async def test_with_the_channel_layer_away_the_agent_is_told_to_try_again_and_no_node_is_left_connected(
        node_token, channel_layer_at, caplog):
    channel_layer_at()  # nothing listens there
    node, token = node_token
    communicator = stream(token)
    await communicator.send_input({"type": "websocket.connect"})
    answer = await communicator.receive_output(timeout=TIMEOUT)
    assert (answer["type"], answer["status"]) == ("websocket.http.response.start", 503)  # not a 500
    assert b"try again" in (await communicator.receive_output(timeout=TIMEOUT))["body"]
    await communicator.wait(timeout=TIMEOUT)
    assert not (await node_row(node.pk)).connected
    assert "Traceback" not in caplog.text and "the channel layer is away" in caplog.text


@pytest.mark.integration  # starts a Valkey of its own, to stop it
async def test_a_stream_whose_channel_layer_goes_away_later_is_closed_with_try_again(
        node_token, channel_layer_at, tmp_path, caplog):
    # Redis stopped under an open stream: its wait for messages fails; the agent hears 1013 and dials again
    from llmgw.valkey import EmbeddedValkey

    valkey = EmbeddedValkey(tmp_path / "valkey")
    url = await asyncio.to_thread(valkey.start)
    try:
        channel_layer_at(url)
        node, token = node_token
        communicator = await open_stream(token)
        await hello(communicator)
        await asyncio.to_thread(valkey.stop)
        assert await communicator.receive_output(timeout=10) == {"type": "websocket.close", "code": TRY_AGAIN}
        await communicator.wait(timeout=TIMEOUT)
    finally:
        await asyncio.to_thread(valkey.stop)
    assert not (await node_row(node.pk)).connected
    assert "Traceback" not in caplog.text and "the channel layer is away" in caplog.text
