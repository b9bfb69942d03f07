"""The ASGI application for /v1/ and /metrics: the gateway's own, not Django's request handling.

Django's `ASGIHandler` wraps every request in an asgiref `ThreadSensitiveContext` (a thread pool per request),
sends `request_started` and `request_finished`, runs the middleware, resolves the URL against every pattern,
builds an HttpRequest (META, a file for the body) and an HttpResponse, and watches for a disconnect with a task
of its own beside one for the view. For a proxy answering in a fraction of a millisecond that was most of its
CPU time (bench/gateway.py). This application finds the view by its path (`gateway.urls`), hands it a
`gateway.http.Request` of the headers and sends the `Answer` or `Streamed` it returns. The view reads the body
(into memory; a larger one than `LLMGW_MAX_BODY_BYTES` is refused with 413 as soon as it passes the limit) only
once the client's key is known: a client without one is answered from its headers, its connection closed. The views
touch the database only through `channels.db.database_sync_to_async`, which closes stale connections itself.

A client that hangs up while its request runs cancels the view (and with it the upstream request, so the engine
stops generating), whether the answer is still being computed or already streaming.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.conf import settings

from gateway import tracing
from gateway.errors import GatewayError
from gateway.http import Answer, ASGIApp, HungUp, Receive, Request, Scope, Send, Streamed

GATEWAY_PREFIXES = ("/v1", "/metrics")  # and whatever follows (/v1x, /metrics/): a JSON 404, never a page

View = Callable[..., Awaitable[Answer | Streamed]]  # a request, and its arguments from the path


class BodyTooLarge(Exception):
    pass


class GatewayHandler:
    def __init__(self, resolve: Callable[[str], tuple[View, dict[str, str]]]):
        self.resolve = resolve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the gateway serves HTTP only, not {scope['type']}")
        view, kwargs = self.resolve(scope.get("path", ""))
        watch = Watch(receive)

        async def read() -> bytes:
            try:
                body = await read_body(receive)
            except BodyTooLarge:
                limit = settings.LLMGW_MAX_BODY_BYTES
                raise GatewayError(413, "request_too_large", f"the request body is over {limit} bytes") from None
            watch.arm()  # from here on the only message left is the client's hang-up
            return body

        request = Request.from_scope(scope, read=read)
        request.id, request.trace = tracing.identify(request.header("x-request-id"), request.header("traceparent"))
        tracing.current_id.set(request.id)  # this task's request: the errors made for it name it
        try:
            answer = await view(request, **kwargs)
            answer[tracing.HEADER] = answer[tracing.ANTHROPIC_HEADER] = request.id
            if request.body is None and _has_body(request):
                # answered without reading what the client sends (no key, say): the connection cannot be reused
                answer["Connection"] = "close"
            await send_answer(answer, send)
        except HungUp:
            return
        except asyncio.CancelledError:
            if not watch.hung_up:
                raise  # the server is stopping this request, not the client
            watch.task.uncancel()  # the client left: its request ends here, and so does the cancellation
        finally:
            watch.stop()


def _has_body(request: Request) -> bool:
    return request.header("content-length") not in ("", "0") or bool(request.header("transfer-encoding"))


class Watch:
    """Cancels the request when its client hangs up. The only message left to receive once the body is read is
    the disconnect, and only a task waiting on `receive` hears it; most requests are answered long before a
    client could hang up, so that task starts only once a request has run for WATCH_AFTER seconds (a timer
    costs a fraction of a task)."""

    WATCH_AFTER = 0.05

    def __init__(self, receive: Receive):
        self.receive = receive
        task = asyncio.current_task()
        assert task is not None  # the ASGI server runs each request in a task of its own
        self.task: asyncio.Task[Any] = task
        self.hung_up = False
        self.watcher: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start watching, once the body is read (before, `receive` is the body's)."""
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.WATCH_AFTER, self._start)

    def _start(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.hung_up = True
                self.task.cancel()
                return

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()


async def read_body(receive: Receive) -> bytes:
    limit = settings.LLMGW_MAX_BODY_BYTES
    message = await receive()
    if message["type"] == "http.disconnect":
        raise HungUp()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge()
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HungUp()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_answer(answer: Answer | Streamed, send: Send) -> None:
    try:
        await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
        if answer.streaming:
            async with aclosing(answer.chunks) as chunks:
                async for part in chunks:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body"})
        else:
            await send({"type": "http.response.body", "body": answer.body})
    finally:
        if answer.streaming:
            answer.settle(499)  # its upstream and in-flight count, however the stream ended


def http_router(django_app: ASGIApp, gateway_app: ASGIApp) -> ASGIApp:
    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        app = gateway_app if path.startswith(GATEWAY_PREFIXES) else django_app
        return await app(scope, receive, send)

    return route
