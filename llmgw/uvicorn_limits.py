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
  with `Retry-After` at once and closed as soon as its client has said what it was saying (so the close does not
  reset the connection under the answer): at its end of the connection, after `REFUSED_QUIET` seconds without a
  byte, or `REFUSED_LINGER` seconds after the refusal at most. At most `REFUSED_AT_ONCE` refused connections are
  held so; past them one is answered and closed at once. The descriptors these take are counted apart from the
  clients' and the process's own (its database, Redis and engine connections, `FD_RESERVE`), so a flood of
  connections past the limit never takes the descriptors the process needs to go on serving.

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

REFUSED_LINGER = 0.5  # seconds a connection refused past the limit is read (and dropped) at most before its close
REFUSED_QUIET = 0.1  # ... and closed sooner once its client has sent nothing for this long
REFUSED_AT_ONCE = 64  # refused connections held so at once; past them a refused connection is closed at once
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
        allows beside the process's own (`FD_RESERVE`) and the refused connections' (`REFUSED_AT_ONCE`), said
        once in the log."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        kept = FD_RESERVE + REFUSED_AT_ONCE
        want = self.max_connections + kept
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        if soft != resource.RLIM_INFINITY and soft < want:
            fewer = max(1, soft - kept)
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


class _Refusals:
    """A server's connections past its limit: each answered 503, the answer made once for each set of default
    headers (uvicorn makes a new one every second, for its date), at most `REFUSED_AT_ONCE` held open meanwhile,
    and said in the log at most every `REFUSALS_SAID_EVERY` seconds, with how many (a flood of connections does
    not become a flood of log lines)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # refused connections not yet closed
        self.count = 0  # refused since the log last said so
        self.said_at = float("-inf")
        self._headers = None
        self._answer = b""

    def answer(self, default_headers) -> bytes:
        if default_headers is not self._headers:
            self._headers = default_headers
            self._answer = _answer(503, "Too many connections to this server; try again.", default_headers,
                                   b"retry-after: 1\r\n")
        return self._answer

    def refused(self, now: float) -> None:
        self.count += 1
        if now - self.said_at >= REFUSALS_SAID_EVERY:
            log.warning("refused %d connection(s) past LLMGW_MAX_CONNECTIONS (%d) since the last word on it",
                        self.count, self.limit)
            self.count, self.said_at = 0, now


class _Refused(asyncio.Protocol):
    """A connection past the limit, and nothing more: not uvicorn's protocol, whose parser and state it never
    needs. 503 at once, the write side shut so the client reads the whole answer; what the client still sends is
    read and dropped (a close with it unread would reset the connection, the answer lost) until it ends its side,
    is quiet for `REFUSED_QUIET` seconds, or `REFUSED_LINGER` seconds have passed. Past `REFUSED_AT_ONCE` held
    so, closed at once."""

    __slots__ = ("refusals", "loop", "server_state", "transport", "timer", "held", "until", "last_read")

    def __init__(self, refusals: _Refusals, server_state, loop):
        self.refusals, self.server_state, self.loop = refusals, server_state, loop
        self.transport: asyncio.Transport  # set by connection_made, the first call a protocol gets
        self.timer: asyncio.TimerHandle | None = None
        self.held = False
        self.until = self.last_read = 0.0

    def connection_made(self, transport) -> None:
        refusals, now = self.refusals, self.loop.time()
        self.transport = transport
        refusals.refused(now)
        transport.write(refusals.answer(self.server_state.default_headers))
        if refusals.held >= REFUSED_AT_ONCE or not transport.can_write_eof():
            transport.close()  # its descriptor back at once
            return
        transport.write_eof()
        refusals.held += 1
        self.held = True
        self.until, self.last_read = now + REFUSED_LINGER, now
        self.timer = self.loop.call_at(now + REFUSED_QUIET, self.look)

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()

    def eof_received(self) -> bool:
        return False  # the client said all it will: closed now

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.held:
            self.held = False
            self.refusals.held -= 1

    def look(self) -> None:
        now = self.loop.time()
        quiet_until = self.last_read + REFUSED_QUIET
        if now < self.until and now < quiet_until:
            self.timer = self.loop.call_at(min(self.until, quiet_until), self.look)
            return
        self.timer = None
        self.transport.close()


def protocol(limits: Limits):
    """What makes a uvicorn server's connections (its `config.http`): uvicorn's httptools protocol under `limits`
    (the module's docstring), which also stops gracefully: every request that begins once its server is stopping
    is answered with `Connection: close` (`llmgw.web.graceful_server`). A connection past the limit gets a
    `_Refused` instead."""
    refusals = _Refusals(limits.max_connections)

    class Limited(HttpToolsProtocol):
        flow: _Flow
        _timer: asyncio.TimerHandle | None = None
        _body_pending = False  # a request's headers are in, its body is not all in
        _request_bytes = False  # bytes of a request whose headers are not all in yet
        _last_read = 0.0
        _ours_at = 0.0  # when the application, not the client, last held the body up

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                # accepted with others at once (the loop accepts all that wait, then makes them connections), past
                # the room the limit had for them
                refused = _Refused(refusals, self.server_state, self.loop)
                transport.set_protocol(refused)
                refused.connection_made(transport)
                return
            super().connection_made(transport)
            self.flow = _Flow(transport, self.loop)
            self._arm(limits.header_timeout, self._headers_late)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
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

    def connection(config, server_state, app_state, _loop=None) -> asyncio.Protocol:
        if len(server_state.connections) >= limits.max_connections:
            return _Refused(refusals, server_state, _loop or asyncio.get_running_loop())
        return Limited(config=config, server_state=server_state, app_state=app_state, _loop=_loop)

    return connection
