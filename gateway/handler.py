"""The ASGI application for /v1/ and /metrics: the gateway's own, not Django's request handling.

Django's `ASGIHandler` wraps every request in an asgiref `ThreadSensitiveContext` (a thread pool per request),
sends `request_started` and `request_finished`, runs the middleware, resolves the URL against every pattern,
builds an HttpRequest (META, a file for the body) and an HttpResponse, and watches for a disconnect with a task
of its own beside one for the view. For a proxy answering in a fraction of a millisecond that was most of its
CPU time (bench/gateway.py). This application reads the body into memory (a larger one than
`LLMGW_MAX_BODY_BYTES` is refused with 413 as soon as it passes the limit), finds the view by its path
(`gateway.urls`), hands it a `gateway.http.Request` and sends the `Answer` or `Streamed` it returns. The views
touch the database only through `channels.db.database_sync_to_async`, which closes stale connections itself.

A client that hangs up while its request runs cancels the view (and with it the upstream request, so the engine
stops generating), whether the answer is still being computed or already streaming.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing

from django.conf import settings

from gateway.errors import error_response
from gateway.http import Request

GATEWAY_PREFIXES = ("/v1", "/metrics")  # and whatever follows (/v1x, /metrics/): a JSON 404, never a page

View = Callable[..., Awaitable]


class BodyTooLarge(Exception):
    pass


class HungUp(Exception):
    pass


class GatewayHandler:
    def __init__(self, resolve: Callable[[str], tuple[View, dict]]):
        self.resolve = resolve

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"the gateway serves HTTP only, not {scope['type']}")
        try:
            body = await read_body(receive)
        except HungUp:
            return
        except BodyTooLarge:
            limit = settings.LLMGW_MAX_BODY_BYTES
            await send_answer(error_response(413, "request_too_large", f"the request body is over {limit} bytes"), send)
            return
        view, kwargs = self.resolve(scope.get("path", ""))
        request = Request.from_scope(scope, body)
        watch = Watch(receive)
        try:
            answer = await view(request, **kwargs)
            await send_answer(answer, send)
        except asyncio.CancelledError:
            if not watch.hung_up:
                raise  # the server is stopping this request, not the client
            watch.task.uncancel()  # the client left: its request ends here, and so does the cancellation
        finally:
            watch.stop()


class Watch:
    """Cancels the request when its client hangs up. The only message left to receive once the body is read is
    the disconnect, and only a task waiting on `receive` hears it; most requests are answered long before a
    client could hang up, so that task starts only once a request has run for WATCH_AFTER seconds (a timer
    costs a fraction of a task)."""

    WATCH_AFTER = 0.05

    def __init__(self, receive):
        self.receive = receive
        self.task = asyncio.current_task()
        self.hung_up = False
        self.watcher: asyncio.Task | None = None
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.WATCH_AFTER, self._start)

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
        self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()


async def read_body(receive) -> bytes:
    limit = settings.LLMGW_MAX_BODY_BYTES
    message = await receive()
    if message["type"] == "http.disconnect":
        raise HungUp()
    body = message.get("body", b"")
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


async def send_answer(answer, send) -> None:
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


def http_router(django_app, gateway_app):
    async def route(scope, receive, send):
        path = scope.get("path", "")
        app = gateway_app if path.startswith(GATEWAY_PREFIXES) else django_app
        return await app(scope, receive, send)

    return route
