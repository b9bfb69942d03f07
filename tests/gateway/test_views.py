"""The gateway, /v1/, through Django's AsyncClient against a real upstream: tests/engine.py as a subprocess.

The engine answers only with the engine key, so every 200 here also proves the gateway swapped the client's key
for it. With --echo-body it sends back the body and headers it received.
"""

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.db.backends.utils import CursorWrapper
from django.test import AsyncClient
from django.test.client import AsyncClientHandler
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cluster import operations
from cluster.locks import redis_client
from cluster.models import ClusterSettings, Replica
from gateway import runtime as gateway_runtime
from gateway.accounting import USAGE_HASH
from gateway.handler import GatewayHandler
from gateway.models import ApiKey
from gateway.runtime import inflight_totals, notify_change, runtime
from tests.factories import make_model, make_node, make_replica, seed_defaults

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

ENGINE = Path(__file__).resolve().parents[1] / "engine.py"
ENGINE_KEY = "lek_test_" + secrets.token_urlsafe(24)
ANSWER = "one two three four five"
SLOW_ANSWER = " ".join(f"w{i}" for i in range(60))
MESSAGES = [{"role": "user", "content": "say five words"}]


# The upstream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """tests/engine.py on a free loopback port, started with the cluster's engine key."""

    def __init__(self, directory: Path, *args: str):
        self.port = free_port()
        self.log = directory / f"engine-{self.port}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(ENGINE), "--port", str(self.port), *args],
                env={**os.environ, "LLMGW_ENGINE_KEY": ENGINE_KEY},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the test engine did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def logged(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    started = Engine(tmp_path_factory.mktemp("engine"), "--answer", ANSWER, "--echo-body")
    yield started
    started.stop()


@pytest.fixture
def slow_engine(tmp_path):
    """One token every 50 ms: a stream that is still running when the test acts on it."""
    started = Engine(tmp_path, "--answer", SLOW_ANSWER, "--delay-ms", "50")
    yield started
    started.stop()


# The cluster the gateway routes by


def ready_replica(model, node, port: int) -> Replica:
    snapshot = {"engine_key": ClusterSettings.fingerprint(ENGINE_KEY)}
    return make_replica(model, node, state=Replica.State.READY, port=port, snapshot=snapshot)


@pytest.fixture
def cluster(transactional_db, engine):
    """A node on loopback with model `qwen` ready on the engine, model `empty` with no replica that
    can be placed, and key `ci`."""
    seed_defaults()  # the transactional flush removed the migrations' profile and engines
    ClusterSettings.load()
    ClusterSettings.objects.filter(pk=1).update(engine_key=ENGINE_KEY)
    node = make_node("local", address="127.0.0.1")
    model = make_model("qwen")
    replica = ready_replica(model, node, engine.port)
    # the state the reconciler leaves a model in when no node has room for it
    make_replica(make_model("empty"), None, state=Replica.State.PENDING, reason="needs 64.0 GiB RAM")
    _, secret = operations.create_key("ci", "test")
    return SimpleNamespace(node=node, model=model, replica=replica, secret=secret, engine=engine)


def add_key(name: str, **limits) -> str:
    return operations.create_key(name, "test", **limits)[1]


@pytest_asyncio.fixture(autouse=True)
async def gateway(transactional_db):
    """After each test: stop this loop's gateway (its tasks, upstream pool, Redis) and close the database
    connection of the thread its table loads on, which Django's own clean-up never visits."""
    yield
    gw = gateway_runtime._runtimes.get(asyncio.get_running_loop())
    if gw is not None:
        await gw.aclose()
    await sync_to_async(connections.close_all)()


class GatewayClientHandler(AsyncClientHandler):
    """The test client's handler with the middleware GatewayHandler gives /v1/ in production: none."""

    load_middleware = GatewayHandler.load_middleware


class Client(AsyncClient):
    """Django's AsyncClient through the gateway's own handler stack, with these headers on every request.

    Not AsyncClient(headers=…): Django 5.2.19 sends those as `Http-Authorization` and the like (its CVE-2026-3902
    change), so they would never arrive."""

    def __init__(self, **headers):
        super().__init__()
        self.handler = GatewayClientHandler(enforce_csrf_checks=False)
        self.always = headers

    def generic(self, method, path, *args, headers=None, **extra):
        return super().generic(method, path, *args, headers={**self.always, **(headers or {})}, **extra)


def key_client(secret: str) -> Client:
    return Client(Authorization=f"Bearer {secret}")


@pytest.fixture
def client(cluster):
    return key_client(cluster.secret)


async def post(client, endpoint: str, body, **headers):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return await client.post(f"/v1/{endpoint}", data=data, content_type="application/json", headers=headers)


async def chat(client, model: str = "qwen", **fields):
    return await post(client, "chat/completions", {"model": model, "messages": MESSAGES, **fields})


async def read(response) -> bytes:
    if response.streaming:
        return b"".join([chunk async for chunk in response.streaming_content])
    return response.content


def events(content: bytes) -> list:
    """The server-sent events' data: JSON objects, and the final "[DONE]"."""
    out = []
    for event in content.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def openai_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    body = json.loads(response.content)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]


# Passing through


async def test_chat_passes_through_with_the_engine_key_only(cluster):
    client = Client(
        **{
            "Authorization": f"Bearer {cluster.secret}",
            "User-Agent": "my-client/1.0",
            "X-Forwarded-For": "203.0.113.9",
            "OpenAI-Organization": "org-client",
            "X-Client-Secret": "client-only",
        }
    )
    client.cookies["session"] = "client-cookie"
    body = {
        "model": "qwen",
        "messages": MESSAGES,
        "temperature": 0.2,
        "a_field_no_one_knows": {"nested": [1, "two", None, {"x": 1.5}]},
        "engine_specific": "kept",
    }
    response = await post(client, "chat/completions", body)
    assert response.status_code == 200, response.content
    answer = json.loads(response.content)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == ANSWER
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    received = answer["echo"]
    assert received["body"] == body  # unknown fields arrive untouched
    assert received["headers"]["authorization"] == f"Bearer {ENGINE_KEY}"
    seen = json.dumps(received["headers"])
    for client_value in (cluster.secret, "my-client", "client-cookie", "203.0.113.9", "org-client", "client-only"):
        assert client_value not in seen
    assert not {"cookie", "x-forwarded-for", "openai-organization", "x-client-secret"} & set(received["headers"])

    assert await usage_counted("ci", "qwen") == [1, 3, 5]
    # and the minute's traffic, for the dashboard's charts (read once the minute is over)
    from gateway.accounting import traffic

    minutes = traffic(redis_client(), 2, now=time.time() + 60)  # this minute and the one before (a boundary)
    assert [sum(m[k] for m in minutes) for k in ("requests", "errors", "tokens")] == [1, 0, 8]


async def usage_counted(key: str, model: str) -> list[int]:
    """Requests, prompt and completion tokens this process counted for the key and model, this hour."""
    gw = runtime()
    await gw.ledger.flush(gw.redis)  # what is left of it: the gateway flushes it every second
    key_id = (await sync_to_async(ApiKey.objects.get)(name=key)).pk
    fields = redis_client().hgetall(USAGE_HASH)
    hour = int(time.time() // 3600) * 3600
    kinds = ("requests", "prompt", "completion")
    return [int(fields.get(f"{hour}|{key_id}|{model}|{kind}".encode(), 0)) for kind in kinds]


async def test_stream_passes_through_and_hides_the_usage_chunk_it_asked_for(client, cluster):
    response = await chat(client, stream=True)
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    got = events(await read(response))
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"] for c in chunks) and not any("usage" in c for c in chunks)

    assert await usage_counted("ci", "qwen") == [1, 3, 5]  # the gateway asked for usage upstream all the same


async def test_stream_with_usage_asked_for_keeps_the_usage_chunk(client):
    got = events(await read(await chat(client, stream=True, stream_options={"include_usage": True})))
    assert got[-1] == "[DONE]"
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 5


async def test_completions_embeddings_and_models(client, cluster):
    response = await post(client, "completions", {"model": "qwen", "prompt": "count", "max_tokens": 2})
    assert response.status_code == 200
    assert json.loads(response.content)["choices"][0] == {
        "index": 0,
        "text": "one two",
        "logprobs": None,
        "finish_reason": "length",
    }
    streamed = events(await read(await post(client, "completions", {"model": "qwen", "prompt": "x", "stream": True})))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == ANSWER

    response = await post(client, "embeddings", {"model": "qwen", "input": ["a", "b"]})
    assert response.status_code == 200
    assert [len(d["embedding"]) for d in json.loads(response.content)["data"]] == [8, 8]

    listed = json.loads((await client.get("/v1/models")).content)
    assert listed["object"] == "list"
    assert [(m["id"], m["ready"]) for m in listed["data"]] == [("empty", False), ("qwen", True)]
    detail = await client.get("/v1/models/qwen")
    assert json.loads(detail.content)["id"] == "qwen"
    openai_error(await client.get("/v1/models/nope"), 404, "model_not_found")


async def test_engine_errors_below_500_are_the_engines_own(client):
    response = await chat(client, test_engine_status=400)
    assert response.status_code == 400
    assert json.loads(response.content)["error"]["code"] == "test_engine_status"


async def test_a_failing_engine_is_a_502_after_the_tries(client):
    openai_error(await chat(client, test_engine_status=503), 502, "upstream_error")
    assert not runtime().local


# Errors


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer sk-llmgw-not-a-key", "Bearer revoked", "Bearer expired"],
)
async def test_401_invalid_api_key(cluster, authorization):
    secrets_by_name = {
        "revoked": await sync_to_async(add_key)("revoked"),
        "expired": await sync_to_async(add_key)("expired", expires_at=timezone.now() + timedelta(days=1)),
    }
    await sync_to_async(operations.revoke_key)("revoked", "test")
    await sync_to_async(ApiKey.objects.filter(name="expired").update)(expires_at=timezone.now() - timedelta(seconds=1))
    headers = {}
    if authorization is not None:
        word = authorization.split(" ", 1)[-1]
        headers["Authorization"] = f"Bearer {secrets_by_name[word]}" if word in secrets_by_name else authorization
    client = Client(**headers)
    openai_error(await chat(client), 401, "invalid_api_key")
    openai_error(await client.get("/v1/models"), 401, "invalid_api_key")


async def test_403_model_not_allowed(cluster):
    secret = await sync_to_async(add_key)("only-empty", models=["empty"])
    client = key_client(secret)
    openai_error(await chat(client), 403, "model_not_allowed")


async def test_404s(client):
    openai_error(await chat(client, model="nope"), 404, "model_not_found")
    openai_error(await client.get("/v1/nope"), 404, "not_found")
    openai_error(await client.post("/v1/audio/speech", data="{}", content_type="application/json"), 404, "not_found")


@pytest.mark.parametrize(
    "endpoint, body, words",
    [
        ("chat/completions", "{not json", "not valid JSON"),
        ("chat/completions", b"\xff\xfe", "not valid JSON"),
        ("chat/completions", "", "not valid JSON"),
        ("chat/completions", "[1, 2]", "JSON object"),
        ("chat/completions", {"messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": 5, "messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": "", "messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": "qwen"}, "`messages` is required"),
        ("chat/completions", {"model": "qwen", "messages": "hi"}, "`messages` must be a list"),
        ("chat/completions", {"model": "qwen", "messages": MESSAGES, "stream": "yes"}, "`stream`"),
        ("chat/completions", {"model": "qwen", "messages": MESSAGES, "stream_options": 1}, "`stream_options`"),
        ("completions", {"model": "qwen"}, "`prompt` is required"),
        ("embeddings", {"model": "qwen"}, "`input` is required"),
    ],
)
async def test_400_invalid_request(client, endpoint, body, words):
    error = openai_error(await post(client, endpoint, body), 400, "invalid_request")
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_413_over_the_gateways_limit(client, settings):
    settings.LLMGW_MAX_BODY_BYTES = 2000
    response = await chat(client, messages=[{"role": "user", "content": "x" * 3000}])
    assert "2000 bytes" in openai_error(response, 413, "request_too_large")["message"]
    assert (await chat(client, messages=[{"role": "user", "content": "x" * 1000}])).status_code == 200


async def test_413_over_djangos_limit(client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    openai_error(await chat(client, messages=[{"role": "user", "content": "x" * 3000}]), 413, "request_too_large")


async def test_405_for_a_get_on_a_post_endpoint(client):
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_429_requests_per_minute(cluster):
    secret = await sync_to_async(add_key)("limited", rpm=2)
    client = key_client(secret)
    assert (await chat(client)).status_code == 200
    assert (await chat(client)).status_code == 200
    response = await chat(client)
    if response.status_code == 200:  # the minute turned between the requests: a new window
        response = await chat(client)
    assert "2 requests per minute" in openai_error(response, 429, "rate_limited")["message"]
    assert 1 <= int(response["Retry-After"]) <= 60


async def test_429_tokens_per_minute(cluster):
    secret = await sync_to_async(add_key)("tokens", tpm=8)
    client = key_client(secret)
    assert (await chat(client)).status_code == 200  # 3 + 5 tokens: the limit, reached
    response = await chat(client)
    if response.status_code == 200:  # the minute turned
        response = await chat(client)
    assert "8 tokens per minute" in openai_error(response, 429, "rate_limited")["message"]
    assert 1 <= int(response["Retry-After"]) <= 60


async def test_503_system_stopped_before_anything_else(cluster, client):
    await sync_to_async(operations.stop_serving)("test")
    error = openai_error(await chat(client), 503, "system_stopped")
    assert "stopped" in error["message"]
    response = await post(Client(), "embeddings", "{not json")  # no key, no JSON: stopped is said first
    openai_error(response, 503, "system_stopped")
    assert int(response["Retry-After"]) > 0
    assert (await client.get("/v1/models")).status_code == 200  # looking is not serving

    await sync_to_async(operations.start_serving)("test")
    await runtime().refresh()  # what the change event does in a running process
    assert (await chat(client)).status_code == 200


async def test_503_no_replica_ready_when_none_is_on_its_way(client):
    response = await chat(client, model="empty")
    assert "none is on its way" in openai_error(response, 503, "no_replica_ready")["message"]
    assert int(response["Retry-After"]) > 0


async def test_503_no_replica_ready_after_waiting_for_one(cluster, client):
    def starting_model():
        model = make_model("starting", wait_seconds=1)
        make_replica(model, cluster.node, state=Replica.State.STARTING, port=free_port())

    await sync_to_async(starting_model)()
    response = await chat(client, model="starting")
    assert "waited 1s" in openai_error(response, 503, "no_replica_ready")["message"]
    assert response["Retry-After"]


async def test_a_request_waits_for_a_replica_that_becomes_ready(cluster, client):
    def starting_model():
        model = make_model("restarting", wait_seconds=20)
        return make_replica(model, cluster.node, state=Replica.State.STARTING, port=cluster.engine.port)

    replica = await sync_to_async(starting_model)()
    waiting = asyncio.create_task(chat(client, model="restarting"))
    await asyncio.sleep(0.3)
    assert not waiting.done()

    def becomes_ready():
        with transaction.atomic():
            snapshot = {"engine_key": ClusterSettings.fingerprint(ENGINE_KEY)}
            Replica.objects.filter(pk=replica.pk).update(state=Replica.State.READY, snapshot=snapshot)
            notify_change()  # as the agent's report does

    await sync_to_async(becomes_ready)()
    response = await asyncio.wait_for(waiting, 15)
    assert response.status_code == 200, response.content


async def test_a_replica_that_refuses_connections_is_skipped(cluster, client):
    await sync_to_async(ready_replica)(cluster.model, cluster.node, free_port())  # nothing listens there
    for _ in range(12):
        assert (await chat(client)).status_code == 200
    assert not runtime().local


# No database query on the hot path


@contextmanager
def every_query():
    """Every SQL statement Django runs, on any connection in any thread. CaptureQueriesContext sees one
    connection only, and the gateway loads its table on another: sync_to_async(thread_sensitive=True) runs in
    asgiref's single worker thread, not the test's (there is no outer async_to_sync to hand it back to)."""
    seen: list[tuple[str, str]] = []
    real = CursorWrapper._execute_with_wrappers

    def counting(cursor, sql, params, many, executor):
        seen.append((threading.current_thread().name, sql))
        return real(cursor, sql, params, many, executor)

    CursorWrapper._execute_with_wrappers = counting
    try:
        yield seen
    finally:
        CursorWrapper._execute_with_wrappers = real


@asynccontextmanager
async def queries_where_the_table_loads():
    """CaptureQueriesContext on the connection of the thread the gateway's table loads on."""
    conn = await sync_to_async(lambda: connections["default"], thread_sensitive=True)()
    captured = CaptureQueriesContext(conn)
    await sync_to_async(captured.__enter__, thread_sensitive=True)()
    try:
        yield captured
    finally:
        await sync_to_async(captured.__exit__, thread_sensitive=True)(None, None, None)


async def routed_requests(client, n: int) -> None:
    for i in range(n):
        kind = i % 5
        if kind == 0:
            response = await chat(client)
        elif kind == 1:
            response = await chat(client, stream=True)
        elif kind == 2:
            response = await post(client, "completions", {"model": "qwen", "prompt": "hi"})
        elif kind == 3:
            response = await post(client, "embeddings", {"model": "qwen", "input": "hi"})
        else:
            response = await client.get("/v1/models")
        assert response.status_code == 200, response.content
        await read(response)


async def test_routed_requests_make_no_database_query_once_warm(client, settings):
    settings.LLMGW_GATEWAY_REFRESH = 300  # no timed reload inside the window: what is left is per request

    async with queries_where_the_table_loads() as loading_thread:
        with every_query() as warm_up:
            await routed_requests(client, 1)
    # the measurement is real: it sees the first request load the table, in the thread where that happens
    assert len(warm_up) >= 4, warm_up
    assert {thread for thread, _ in warm_up} != {threading.current_thread().name}
    assert len(loading_thread.captured_queries) == len(warm_up)

    async with queries_where_the_table_loads() as loading_thread:
        with every_query() as warm:
            await routed_requests(client, 50)
    assert warm == []
    assert loading_thread.captured_queries == []


# In-flight counts


async def test_in_flight_counts_concurrent_requests_and_returns_to_zero(client, cluster):
    gw = runtime()
    replica = cluster.replica.name
    for _ in range(3):
        # 12 at once: tests/engine.py (socketserver's listen backlog of 5) resets connections beyond about that
        results = await asyncio.gather(*(chat(client, stream=bool(i % 2)) for i in range(12)))
        assert {r.status_code for r in results} == {200}
        assert gw.local == {replica: 6}  # the streams, not yet read by their clients, are still in flight
        await shared_in_flight_becomes(replica, 6)
        await asyncio.gather(*(read(r) for r in results))
        assert not gw.local
        await shared_in_flight_becomes(replica, 0)


async def shared_in_flight_becomes(replica: str, n: int) -> None:
    """What a drain reads across web processes (Redis) follows this process's counts within a moment."""
    deadline = time.monotonic() + 5
    while inflight_totals(redis_client()).get(replica, 0) != n:
        assert time.monotonic() < deadline, inflight_totals(redis_client())
        await asyncio.sleep(0.05)


def asgi_scope(body: bytes, secret: str) -> dict:
    """An ASGI HTTP scope for POST /v1/chat/completions, as daphne or uvicorn hands it to the application."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {secret}".encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }


def hangs_up_after(body: bytes, gone: asyncio.Event):
    """An ASGI `receive` of a client that sends `body`, then disconnects once `gone` is set."""
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_a_client_that_goes_away_mid_stream_cancels_the_upstream(cluster, slow_engine):
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

    serving = asyncio.create_task(GatewayHandler()(scope, receive, send))
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

    serving = asyncio.create_task(GatewayHandler()(asgi_scope(body, cluster.secret), receive, send))
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


async def test_the_table_reloads_on_change_after_a_first_request_through_sync_middleware(cluster):
    """Background work runs in a context of its own: a first request through Django's default handler (sync
    middleware, a per-request thread pool that is gone afterwards) must not leave the reloads tied to it."""
    full_stack = AsyncClient()  # Django's default handler: the project's whole MIDDLEWARE
    response = await full_stack.post(
        "/v1/chat/completions",
        data=json.dumps({"model": "qwen", "messages": MESSAGES}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {cluster.secret}"},
    )
    assert response.status_code == 200
    gw = runtime()
    loaded = gw.table

    def change():
        with transaction.atomic():
            notify_change()

    await sync_to_async(change)()
    deadline = time.monotonic() + 3
    while gw.table is loaded and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gw.table is not loaded
