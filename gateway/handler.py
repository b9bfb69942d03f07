"""The ASGI handler for /v1/ and /metrics: Django's, without what a browser request needs and the gateway does not.

Django's `ASGIHandler` wraps every request in an asgiref `ThreadSensitiveContext` (a fresh thread pool per
request, started and joined around it), sends `request_started` and `request_finished` (their database
receivers run in that pool), and spools the body to a temporary file. For a proxy answering in a millisecond
those thread hops were most of its CPU time. This handler keeps Django's request, URL resolution, views and
responses, and the cancellation of a view when the client disconnects; it drops

- the middleware (sessions, CSRF, the auth user, messages: the gateway authenticates each request by its key);
- the per-request thread pool and the two signals: the gateway's views touch the database only through
  `channels.db.database_sync_to_async`, which closes stale connections itself;
- the temporary file: the body is read into memory up to `LLMGW_MAX_BODY_BYTES`, and a larger one is refused
  with 413 as soon as it passes the limit, without reading the rest.
"""

from __future__ import annotations

import asyncio
import io
from contextlib import aclosing

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.urls import set_script_prefix

from gateway.errors import error_response

GATEWAY_PREFIXES = ("/v1/", "/metrics")


class BodyTooLarge(Exception):
    pass


class GatewayHandler(ASGIHandler):
    def load_middleware(self, is_async=False):
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"the gateway serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        except BodyTooLarge:
            limit = settings.LLMGW_MAX_BODY_BYTES
            await self.send_response(
                error_response(413, "request_too_large", f"the request body is over {limit} bytes"), send
            )
            return
        set_script_prefix(get_script_prefix(scope))
        request, early = self.create_request(scope, body_file)
        if request is None:
            await self.send_response(early, send)
            return

        async def process_request():
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client went away while the answer was going out

        # as Django's handler does: a disconnect while the view runs cancels it (and its upstream request)
        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request()),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def read_body(self, receive):
        limit = settings.LLMGW_MAX_BODY_BYTES
        body = io.BytesIO()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            chunk = message.get("body", b"")
            if chunk:
                if body.tell() + len(chunk) > limit:
                    raise BodyTooLarge()
                body.write(chunk)
            if not message.get("more_body", False):
                break
        body.seek(0)
        return body

    async def send_response(self, response, send):
        """Django's, for the responses the gateway gives (no cookies, no files), and with no sync `close()`."""
        headers = [
            (header.encode("ascii") if isinstance(header, str) else header, value.encode("latin1") if isinstance(value, str) else value)
            for header, value in response.items()
        ]
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            if response.streaming:
                async with aclosing(aiter(response)) as content:
                    async for part in content:
                        await send({"type": "http.response.body", "body": part, "more_body": True})
                await send({"type": "http.response.body"})
            else:
                await send({"type": "http.response.body", "body": response.content})
        finally:
            settle = getattr(response, "settle", None)  # a gateway stream: its upstream and in-flight count
            if settle is not None:
                settle(499)  # a no-op when the stream already ended its own way


def http_router(django_app, gateway_app):
    async def route(scope, receive, send):
        path = scope.get("path", "")
        app = gateway_app if path.startswith(GATEWAY_PREFIXES) or path == "/v1" else django_app
        return await app(scope, receive, send)

    return route
