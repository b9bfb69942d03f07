"""The gateway's requests and answers as they are on the wire: what an ASGI server hands over, and what goes back.

Django's HttpRequest and HttpResponse carry what a browser request needs (META, cookies, sessions, charsets, a
file for a large body); for a proxy that answers in a fraction of a millisecond, building them was a large part
of its CPU time (bench/gateway.py). The gateway builds these instead: the method, path, headers, the client's
address and the body it has already read; an answer is its status, headers and bytes, or a stream of them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from gateway.tracing import Trace

# ASGI's scope and messages as the server hands them over, typed as Django's ASGIHandler takes them: dicts whose
# keys the ASGI spec lists, some of them optional (asgiref.typing's TypedDicts make every key required, which a
# message the gateway sends omits)
Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HungUp(Exception):
    """The client went away before its whole body came."""


class Request:
    """A request as its headers came. Its body is read only when the view asks for it (`read_body`), once the
    client's key has been checked: a client with no key holds no memory of the web process with a body."""

    __slots__ = ("method", "path", "headers", "client", "body", "_read", "id", "trace")

    def __init__(self, method: str, path: str, headers: dict[str, str], client: str, body: bytes | None = None,
                 read: Callable[[], Awaitable[bytes]] | None = None):
        self.method = method
        self.path = path
        self.headers = headers  # lower-case names; a repeated header keeps its first value
        self.client = client  # the peer's address, as the ASGI server saw it
        self.body = body  # None until read
        self._read = read
        self.id = ""  # the request's id and its trace (gateway/tracing.py), once the handler gave it them
        self.trace: Trace | None = None

    @classmethod
    def from_scope(cls, scope: Scope, body: bytes | None = None,
                   read: Callable[[], Awaitable[bytes]] | None = None) -> Request:
        headers: dict[str, str] = {}
        for name, value in scope.get("headers") or ():
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        client = scope.get("client")
        return cls(scope.get("method", "GET"), scope.get("path", ""), headers, client[0] if client else "", body, read)

    async def read_body(self) -> bytes:
        """The whole body (the handler's reader refuses one over the limit as it comes)."""
        if self.body is None:
            self.body = await self._read() if self._read is not None else b""
        return self.body

    def header(self, name: str) -> str:
        """One header's value ("" when absent); `name` in lower case."""
        return self.headers.get(name, "")


def _header(name: str, value: str) -> tuple[bytes, bytes]:
    return name.lower().encode("latin-1"), value.encode("latin-1")


class Answer:
    """A whole answer: status, headers, body."""

    streaming: ClassVar[Literal[False]] = False
    __slots__ = ("status", "body", "headers")

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json"):
        self.status = status
        self.body = body
        self.headers = [(b"content-type", content_type.encode("latin-1"))]

    def __setitem__(self, name: str, value: str) -> None:
        self.headers.append(_header(name, value))

    def __getitem__(self, name: str) -> str:
        wanted = name.lower().encode("latin-1")
        return next(v.decode("latin-1") for k, v in self.headers if k == wanted)


class Streamed:
    """An answer sent as it comes (server-sent events, or a large answer passed on), with what lets its upstream go
    however it ends: read to the end, cut short, or never started (a client gone between the view's answer and its
    first byte, when the generator never ran and so ran no `finally`). The handler calls `settle` once the answer is
    out or abandoned; it is a no-op when the stream already ended its own way."""

    streaming: ClassVar[Literal[True]] = True
    __slots__ = ("status", "chunks", "headers", "settle")

    def __init__(self, chunks: AsyncGenerator[bytes, None], settle: Callable[[int], None], content_type: str = ""):
        self.status = 200
        self.chunks = chunks
        self.settle = settle
        if content_type:  # a whole answer too large to hold, passed on as it comes
            self.headers = [(b"content-type", content_type.encode("latin-1"))]
        else:
            self.headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    def __setitem__(self, name: str, value: str) -> None:
        self.headers.append(_header(name, value))


def json_answer(data: object, status: int = 200) -> Answer:
    return Answer(json.dumps(data).encode(), status)
