"""In-flight counts: shared across web processes, back to zero however a request ends (a client that hangs up
mid-stream, before the stream starts, or once it has the [DONE])."""

import asyncio
import json
import logging
import time

import pytest
from asgiref.sync import sync_to_async

from cluster.models import Profile
from gateway import metrics
from gateway.runtime import runtime
from gateway.urls import application
from tests.factories import make_model, make_profile
from tests.gateway.views.harness import (
    MESSAGES,
    asgi_scope,
    chat,
    hangs_up_after,
    read,
    ready_replica,
    shared_in_flight_becomes,
)

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


# In-flight counts


async def test_in_flight_counts_concurrent_requests_and_returns_to_zero(client, cluster, slow_engine):
    gw = runtime()
    replica = cluster.replica.name
    # twelve slots, so admission lets all twelve in at once: with qwen's two, the ten waiting would wait for the
    # two streams this test reads only once all twelve have answered (a client that does not read its stream
    # holds its slot)
    await sync_to_async(lambda: Profile.objects.filter(name="embeds").update(parallel=12))()  # read on the first request
    for _ in range(3):
        # 12 at once: tests/engine.py (socketserver's listen backlog of 5) resets connections beyond about that
        results = await asyncio.gather(*(chat(client, stream=bool(i % 2)) for i in range(12)))
        assert {r.status_code for r in results} == {200}, [r.content for r in results if r.status_code != 200]
        await asyncio.gather(*(read(r) for r in results))
        assert not gw.local
        await shared_in_flight_becomes(replica, 0)

    # streams the engine is still writing are counted, here and for the other web processes
    # four slots: admission lets all four streams into the engine at once (gateway/admission.py)
    slow = await sync_to_async(lambda: ready_replica(make_model("slow", profile=make_profile(parallel=4).name),
                                                     cluster.node, slow_engine.port))()
    await gw.refresh()
    streams = await asyncio.gather(*(chat(client, model="slow", stream=True) for _ in range(4)))
    assert [r.status_code for r in streams] == [200] * 4, [r.content for r in streams]
    assert gw.local == {slow.name: 4}
    await shared_in_flight_becomes(slow.name, 4)
    await asyncio.gather(*(read(r) for r in streams))
    assert not gw.local
    await shared_in_flight_becomes(slow.name, 0)


async def test_a_client_that_goes_away_mid_stream_cancels_the_upstream(cluster, slow_engine) -> None:
    """As daphne does it: the ASGI application, and an http.disconnect while the answer streams."""

    def slow_model():
        return ready_replica(make_model("slow"), cluster.node, slow_engine.port)

    replica = await sync_to_async(slow_model)()
    body = json.dumps({"model": "slow", "messages": MESSAGES, "stream": True}).encode()
    scope = asgi_scope(body, cluster.secret)
    gone = asyncio.Event()
    receive = hangs_up_after(body, gone)
    chunks: list[bytes] = []
    some_sent = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message.get("body"):
            chunks.append(message["body"])
            if len(chunks) >= 3:
                some_sent.set()

    serving = asyncio.create_task(application()(scope, receive, send))
    await asyncio.wait_for(some_sent.wait(), 10)
    gw = runtime()
    assert gw.local == {replica.name: 1}
    assert len(chunks) >= 3  # chunk by chunk as the engine sends them, not one buffered answer

    gone.set()  # the client hangs up
    await asyncio.wait_for(serving, 10)
    assert not gw.local
    assert b"[DONE]" not in b"".join(chunks)
    await shared_in_flight_becomes(replica.name, 0)

    # the engine's next write found the connection closed, long before its 60 tokens (3 s) were out
    deadline = time.monotonic() + 2
    while not any(e in slow_engine.logged() for e in ("BrokenPipeError", "ConnectionResetError")):
        assert time.monotonic() < deadline, slow_engine.logged()
        await asyncio.sleep(0.05)


async def test_a_client_that_goes_away_before_the_stream_starts_leaves_no_count(cluster, slow_engine):
    """The engine answered, the view returned its stream, and the client hangs up while the response headers are
    going out: the stream's generator never runs, yet the upstream is let go and the in-flight count returns."""

    def slow_model():
        return ready_replica(make_model("slow"), cluster.node, slow_engine.port)

    replica = await sync_to_async(slow_model)()
    body = json.dumps({"model": "slow", "messages": MESSAGES, "stream": True}).encode()
    gone = asyncio.Event()
    receive = hangs_up_after(body, gone)
    starting = asyncio.Event()

    async def send(message):
        assert message["type"] == "http.response.start", "no byte of the body may go out"
        starting.set()
        await asyncio.Event().wait()  # a client that never reads: the server's send does not return

    serving = asyncio.create_task(application()(asgi_scope(body, cluster.secret), receive, send))
    await asyncio.wait_for(starting.wait(), 10)
    gw = runtime()
    assert gw.local == {replica.name: 1}
    gone.set()
    await asyncio.wait_for(serving, 10)
    assert not gw.local
    await shared_in_flight_becomes(replica.name, 0)
    deadline = time.monotonic() + 2  # the engine saw its client go
    while not any(e in slow_engine.logged() for e in ("BrokenPipeError", "ConnectionResetError")):
        assert time.monotonic() < deadline, slow_engine.logged()
        await asyncio.sleep(0.05)


async def test_a_client_that_goes_away_once_it_has_the_done_got_a_whole_stream(cluster, lingering_engine,
                                                                                caplog) -> None:
    """A stream whose last event went out is complete, for a client that closes the moment it reads [DONE]:
    logged 200 with its usage counted, and its in-flight count returns."""

    def lingering_model():
        return ready_replica(make_model("linger"), cluster.node, lingering_engine.port)

    replica = await sync_to_async(lingering_model)()
    body = json.dumps({"model": "linger", "messages": MESSAGES, "stream": True}).encode()
    gone = asyncio.Event()
    chunks: list[bytes] = []

    async def send(message):
        if message.get("body"):
            chunks.append(message["body"])
            if b"data: [DONE]" in message["body"]:
                gone.set()  # it has what it wants and hangs up, while the engine has not ended the stream yet

    caplog.set_level(logging.INFO, logger="llmgw.access")
    before = metrics.REQUESTS.labels("linger", "200")._value.get()
    serving = asyncio.create_task(application()(asgi_scope(body, cluster.secret), hangs_up_after(body, gone), send))
    await asyncio.wait_for(serving, 10)
    assert b"data: [DONE]" in b"".join(chunks)
    [line] = [r.getMessage() for r in caplog.records if r.name == "llmgw.access" and "model=linger" in r.getMessage()]
    assert "status=200" in line and "completion_tokens=0" not in line
    assert metrics.REQUESTS.labels("linger", "200")._value.get() == before + 1
    gw = runtime()
    assert not gw.local
    await shared_in_flight_becomes(replica.name, 0)


async def test_a_streams_count_is_let_go_when_the_engines_done_passes_before_the_client_has_it(cluster, lingering_engine):
    """A conversation's next turn may come the moment its answer ends, through another web process: by then the
    replica must not be counted busy with the answer. The engine here keeps the stream open half a second after
    its [DONE]; the count is already let go when the [DONE] goes to the client, and let go once."""

    def lingering_model():
        return ready_replica(make_model("linger"), cluster.node, lingering_engine.port)

    replica = await sync_to_async(lingering_model)()
    body = json.dumps({"model": "linger", "messages": MESSAGES, "stream": True}).encode()
    gw = runtime()
    counted_at_done = []

    async def send(message):
        if b"data: [DONE]" in message.get("body", b""):
            counted_at_done.append(gw.local.get(replica.name, 0))

    gauge = metrics.of("linger").inflight
    before = gauge._value.get()
    serving = asyncio.create_task(application()(asgi_scope(body, cluster.secret), hangs_up_after(body, asyncio.Event()), send))
    await asyncio.wait_for(serving, 10)
    assert counted_at_done == [0]
    assert not gw.local and gauge._value.get() == before  # not let go twice when the stream closed after it
    await shared_in_flight_becomes(replica.name, 0)
