"""What a client's connection to a uvicorn web process may hold, and for how long (docs/security.md, "Slow and
many connections").

uvicorn alone times out only a kept-alive connection idle between requests: a new connection that sends
nothing or half its headers, a body that stops half-way or a chunked body that never ends are held for ever,
and it takes every connection it is offered. `protocol(limits)` is uvicorn's HTTP protocol with:

- a header timeout: a request's headers are complete within `header_timeout` seconds of the connection's open
  or of their first byte on a kept-alive connection (whose idle wait before that byte is uvicorn's
  `timeout_keep_alive`); else a 408 (nothing, if nothing came) and the connection is closed. A websocket's
  upgrade request is headers like any other, so a half upgrade ends the same way;
- a body timeout: no silence longer than `body_timeout` seconds in the middle of a request body, of any length
  or chunked (nginx's `client_body_timeout`), counted only while the server is waiting for the client: not
  while the application has not yet asked for more (reading paused, or `Expect: 100-continue` not yet
  answered). 408 if no answer has begun; an answer under way is never cut (the connection closes once it is
  done), one already sent is followed by the close;
- at most `max_connections` connections at once, websockets included: past it a new connection is answered 503
  with `Retry-After` at once and closed.

An accepted websocket is no longer this protocol's (uvicorn hands the connection to its websockets protocol):
none of these timeouts reach it; its pings (every 20 s, 20 s to answer) close a dead one.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, replace

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("llmgw.web")

REFUSED_LINGER = 2.0  # seconds a connection refused past the limit is read (and dropped) before it is closed
FD_RESERVE = 256  # descriptors a web process keeps for its own (database, Redis, engines, logs) beside clients'
REFUSALS_SAID_EVERY = 10.0  # seconds between log lines about refused connections
POLL = 1.0  # seconds between looks while the application, not the client, holds up a body


@dataclass(frozen=True)
class Limits:
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int

    @classmethod
    def from_settings(cls) -> Limits:
        from django.conf import settings

        return cls(settings.LLMGW_HEADER_TIMEOUT, settings.LLMGW_BODY_TIMEOUT, settings.LLMGW_KEEPALIVE_TIMEOUT,
                   settings.LLMGW_MAX_CONNECTIONS)

    def within_descriptors(self) -> Limits:
        """These limits, with the process's open-file limit raised to what they need (up to its hard limit, which
        needs no privilege: systemd's soft default is 1024), and `max_connections` lowered to what it then
        allows, said once in the log."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.max_connections + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        if soft != resource.RLIM_INFINITY and soft < want:
            fewer = max(1, soft - FD_RESERVE)
            log.warning("at most %d connections (LLMGW_MAX_CONNECTIONS is %d): the open-file limit is %d",
                        fewer, self.max_connections, soft)
            return replace(self, max_connections=fewer)
        return self


class _Flow(FlowControl):
    """uvicorn's flow control, knowing when reading last resumed: a body's silence counts from then."""

    def __init__(self, transport, loop):
        super().__init__(transport)
        self.loop = loop
        self.resumed_at = 0.0

    def resume_reading(self) -> None:
        if self.read_paused:
            self.resumed_at = self.loop.time()
        super().resume_reading()


def _answer(status: int, text: str, default_headers, extra: bytes = b"") -> bytes:
    body = text.encode()
    head = [STATUS_LINE[status]]
    for name, value in default_headers:
        head += [name, b": ", value, b"\r\n"]
    head += [b"content-type: text/plain; charset=utf-8\r\ncontent-length: ", str(len(body)).encode(), b"\r\n",
             extra, b"connection: close\r\n\r\n", body]
    return b"".join(head)


_refusals = {"count": 0, "said_at": float("-inf")}


def _refused(now: float, limit: int) -> None:
    """Said in the log at most every `REFUSALS_SAID_EVERY` seconds, with how many: a flood of connections does
    not become a flood of log lines."""
    _refusals["count"] += 1
    if now - _refusals["said_at"] >= REFUSALS_SAID_EVERY:
        log.warning("refused %d connection(s) past LLMGW_MAX_CONNECTIONS (%d) since the last word on it",
                    _refusals["count"], limit)
        _refusals.update(count=0, said_at=now)


def protocol(limits: Limits):
    """uvicorn's httptools protocol under `limits` (the module's docstring), which also stops gracefully:
    every request that begins once its server is stopping is answered with `Connection: close`
    (`llmgw.web.graceful_server`)."""

    class Limited(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _refused = False
        _body_pending = False  # a request's headers are in, its body is not all in
        _request_bytes = False  # bytes of a request whose headers are not all in yet
        _last_read = 0.0
        _ours_at = 0.0  # when the application, not the client, last held the body up

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                self._refuse(transport)
                return
            super().connection_made(transport)
            self.flow = _Flow(transport, self.loop)
            self._arm(limits.header_timeout, self._headers_late)

        def _refuse(self, transport) -> None:
            """503 at once, the write side shut so the client reads the whole answer, what it still sends read
            and dropped for a moment (closing with it unread would reset the connection, the answer lost)."""
            self._refused = True
            self.transport = transport
            retry = b"retry-after: 1\r\n"
            transport.write(_answer(503, "Too many connections to this server; try again.",
                                    self.server_state.default_headers, retry))
            if transport.can_write_eof():
                transport.write_eof()
            self._timer = self.loop.call_later(REFUSED_LINGER, transport.close)
            _refused(self.loop.time(), limits.max_connections)

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._refused:
                return
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._last_read = self.loop.time()
            if not self._body_pending:
                self._request_bytes = True
                if self._timer is None:  # the first byte of a request on a kept-alive connection
                    self._arm(limits.header_timeout, self._headers_late)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._request_bytes = False
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not None and self.cycle is not before:  # a request (an upgrade makes no cycle)
                if getattr(self.server_state, "stopping", False):
                    self.cycle.keep_alive = False
                if self._has_body():
                    self._body_pending = True
                    self._arm(limits.body_timeout, self._body_late)

        def _has_body(self) -> bool:
            for name, value in self.headers:
                if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
                    return True
            return False

        def on_message_complete(self) -> None:
            if self._body_pending:
                self._body_pending = False
                self._disarm()
                if self.cycle.response_complete and not self.pipeline and not self.transport.is_closing():
                    # the body ended after its answer (read and dropped meanwhile, which stopped uvicorn's idle
                    # timer): the connection is idle from now
                    self._unset_keepalive_if_required()
                    self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                        self.timeout_keep_alive_handler)
            super().on_message_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            super().handle_websocket_upgrade()

        def _arm(self, seconds: float, then) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, then)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _under_way(self) -> bool:
            return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

        def _headers_late(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # the next request's headers stall behind an answer still being made: that answer is the last
                self.cycle.keep_alive = False
                return
            if self._request_bytes:
                self.transport.write(_answer(408, "Request headers too slow.", self.server_state.default_headers))
            self.transport.close()

        def _body_late(self) -> None:
            self._timer = None
            if self.transport.is_closing() or not self._body_pending:
                return
            now = self.loop.time()
            cycle = self.cycle
            if self.flow.read_paused or cycle.waiting_for_100_continue:  # the application's wait
                self._ours_at = now
                self._timer = self.loop.call_later(min(POLL, limits.body_timeout), self._body_late)
                return
            silent = now - max(self._last_read, self.flow.resumed_at, self._ours_at)
            if silent < limits.body_timeout:
                self._timer = self.loop.call_later(limits.body_timeout - silent, self._body_late)
                return
            if self._under_way():  # never cut an answer: it is the connection's last
                cycle.keep_alive = False
                return
            if not cycle.response_started:
                self.transport.write(_answer(408, "Request body too slow.", self.server_state.default_headers))
                cycle.disconnected = True  # what the application reads next is the end
                cycle.message_event.set()
            self.transport.close()

    return Limited
