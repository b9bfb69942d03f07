"""What the gateway's view tests share: tests/engine.py as the upstream, a client for /v1/ through the gateway's
own handler, its requests and answers, and ASGI scopes for a client that hangs up."""

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
from django.db import transaction

from cluster import inflight, notify
from cluster.locks import redis_client
from cluster.models import ClusterSettings, Replica
from gateway import operations as gateway_operations
from gateway.urls import application
from ground.ports import free_port
from tests.factories import make_replica

ENGINE = Path(__file__).resolve().parents[2] / "engine.py"
ENGINE_KEY = "lek_test_" + secrets.token_urlsafe(24)
ANSWER = "one two three four five"
SLOW_ANSWER = " ".join(f"w{i}" for i in range(60))
MESSAGES = [{"role": "user", "content": "say five words"}]


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


def ready_replica(model, node, port: int) -> Replica:
    snapshot = {"engine_key": ClusterSettings.fingerprint(ENGINE_KEY)}
    return make_replica(model, node, state=Replica.State.READY, port=port, snapshot=snapshot)


def becomes_ready(replica: Replica) -> None:
    """A replica on its way comes ready, as the agent's report makes it: the routing table hears of it at once."""
    with transaction.atomic():
        snapshot = {"engine_key": ClusterSettings.fingerprint(ENGINE_KEY)}
        Replica.objects.filter(pk=replica.pk).update(state=Replica.State.READY, snapshot=snapshot)
        notify.routing_changed()


def add_key(name: str, **limits) -> str:
    return gateway_operations.create_key(name, "test", **limits)[1]


class Answered:
    """What a client got: status, headers (by any case of their name) and the body, or for an event stream the
    chunks as they come (read them with `read`; until then the gateway holds the next one, as for a client that
    has not read it yet)."""

    def __init__(self, status: int, headers: dict[str, str], content: bytes = b"", chunks=None):
        self.status_code = status
        self.headers = headers
        self.content = content
        self.streaming = chunks is not None
        self.streaming_content = chunks

    def __getitem__(self, name: str) -> str:
        return self.headers[name.lower()]

    def get(self, name: str, default=None):
        return self.headers.get(name.lower(), default)


class Client:
    """A client of the gateway's own ASGI application (gateway.urls), as uvicorn hands it each request, from
    `address`, with these headers on every request."""

    def __init__(self, address: str = "127.0.0.1", **headers):
        self.address = address  # the client's address (the ASGI scope's `client`)
        self.always = {name.replace("_", "-"): value for name, value in headers.items()}
        self.cookies: dict[str, str] = {}
        self.app = application()

    async def get(self, path: str, headers=None) -> Answered:
        return await self.request("GET", path, b"", headers)

    async def post(self, path: str, data=b"", content_type: str = "application/json", headers=None) -> Answered:
        body = data.encode() if isinstance(data, str) else data
        return await self.request("POST", path, body, {"Content-Type": content_type, **(headers or {})})

    async def request(self, method: str, path: str, body: bytes, headers=None) -> Answered:
        sent = {**self.always, "Content-Length": str(len(body)), **(headers or {})}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"testserver"), *((k.lower().encode(), str(v).encode()) for k, v in sent.items())],
            "client": (self.address, 40000), "server": ("testserver", 80),
        }
        receive = hangs_up_after(body, asyncio.Event())  # a client that stays: it never hangs up

        messages: asyncio.Queue = asyncio.Queue()

        async def send(message):  # returns once the client took it: one that has not read yet holds the gateway
            await messages.put(message)
            await messages.join()

        serving = asyncio.get_running_loop().create_task(self.app(scope, receive, send))
        start = await _next(messages, serving)
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in start["headers"]}
        if headers.get("content-type") == "text/event-stream":
            return Answered(start["status"], headers, chunks=_chunks(messages, serving))
        content = b""
        while True:
            message = await _next(messages, serving)
            content += message.get("body", b"")
            if not message.get("more_body"):
                break
        await serving
        return Answered(start["status"], headers, content)


async def _next(messages: asyncio.Queue, serving: asyncio.Task) -> dict:
    getting = asyncio.ensure_future(messages.get())
    await asyncio.wait({getting, serving}, return_when=asyncio.FIRST_COMPLETED)
    if getting.done():
        messages.task_done()
        return getting.result()
    getting.cancel()
    serving.result()  # the application's own error, if it raised one
    raise AssertionError("the gateway ended without answering")


async def _chunks(messages: asyncio.Queue, serving: asyncio.Task):
    while True:
        message = await _next(messages, serving)
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body"):
            await serving
            return


def key_client(secret: str) -> Client:
    return Client(Authorization=f"Bearer {secret}")


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
    assert set(body) == {"error", "request_id"} and set(body["error"]) == {"message", "type", "code"}, body
    assert body["request_id"] == response["X-Request-Id"], body  # the id it answers with (gateway/tracing.py)
    assert body["error"]["code"] == code, body
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]


async def shared_in_flight_becomes(replica: str, n: int) -> None:
    """What a drain reads across web processes (Redis) follows this process's counts within a moment."""
    deadline = time.monotonic() + 5
    while inflight.totals(redis_client()).get(replica, 0) != n:
        assert time.monotonic() < deadline, inflight.totals(redis_client())
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
