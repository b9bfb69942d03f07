"""HTTP/1.1 to the engines: keep-alive connections per replica, answers parsed by httptools.

The gateway's one upstream call is a POST of bytes it already has to a replica on the control plane's network,
whose answer it passes on as it comes. A general client pays for what this never uses (cookies, redirects,
proxies, TLS, compression, traces, per-request timers objects): aiohttp's request path was about 0.08 ms of CPU
of the gateway's 0.23 per proxied request on the test machine (bench/gateway.py). Here a request is one write
of a head built from a template, and its answer is parsed by httptools (llhttp, the parser of Node.js and of
uvicorn), which deals with Content-Length, chunked transfer and keep-alive.

What a caller can tell apart:

- `ConnectFailed` (`ConnectTimeout`): no connection, nothing sent; another replica may take the request;
- `Broken`: the connection ended or the answer could not be parsed; `before_answer` says whether any of the
  answer had come (before it, another replica may take the request);
- `ReadTimeout`: the engine sent nothing for `read_timeout` seconds (`Silent`: for a stream's idle timeout, once
  its answer had begun);
- `Lost` (a `Broken`): the gateway gave the answer up (`EngineAnswer.abandon`): its replica left the fleet;
- `Unreachable` (a `Broken`): the engine's host did not acknowledge the request within UNACKNOWLEDGED_SECONDS
  (TCP_USER_TIMEOUT on every connection): its node is cut off. An engine busy with a long prefill still
  acknowledges at once (its kernel does), so this is not a slow engine.

A pooled connection the engine closed while it sat idle is found out on its next use; such a request is sent
once more on a new connection (nothing of an answer had come, so the engine never began it, or began it and
dropped it, and an LLM request has no effect to repeat).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import time
import weakref
from collections.abc import AsyncGenerator
from typing import TypeVar, cast

import httptools

T = TypeVar("T")

# a connection whose sent bytes (the request) go unacknowledged this long is given up (`Unreachable`): its node is
# cut off, and nothing of an answer has come, so another replica takes the request. No keepalive probes: during
# an answer only the engine sends, and probes lost on a lossy link would end an answer that was still coming
UNACKNOWLEDGED_SECONDS = 5
SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKNOWLEDGED_SECONDS * 1000)] \
    if hasattr(socket, "TCP_USER_TIMEOUT") else []
HIGH_WATER = 1 << 20  # bytes of an answer held before reading from the engine pauses until the client takes them


class UpstreamError(Exception):
    before_answer = True  # nothing of an answer had come: another replica may take the request


class ConnectFailed(UpstreamError):
    pass


class ConnectTimeout(ConnectFailed):
    pass


class Broken(UpstreamError):
    def __init__(self, message: str, before_answer: bool):
        super().__init__(message)
        self.before_answer = before_answer


class Unreachable(Broken):
    pass


class Lost(Broken):
    pass


class ReadTimeout(UpstreamError):
    before_answer = False


class Silent(ReadTimeout):
    """The engine sent nothing of a stream already begun for its model's stream idle timeout."""


class EngineAnswer:
    """An engine's answer: its status and headers once they came, then its body as it comes."""

    __slots__ = ("_conn", "status", "headers", "_parts", "_size", "complete", "_error", "_waiter", "_done", "idle",
                 "__weakref__")

    def __init__(self, conn: Connection):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._parts: collections.deque[bytes] = collections.deque()
        self._size = 0
        self.complete = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # released or closed
        self.idle: float | None = None  # seconds it may send nothing before `Silent`, once its reader sets it

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    # fed by the connection

    def _feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self, error: UpstreamError | None = None) -> None:
        if error is None:
            self.complete = True
        elif not self.complete and self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # read by the gateway

    async def _wait(self, idle: float | None = None) -> None:
        self._waiter = self._conn.loop.create_future()
        if idle is not None and idle < self._conn.pool.read_timeout:
            timer = self._conn.loop.call_later(idle, _silent, self._waiter, idle)
        else:
            timer = self._conn.loop.call_later(self._conn.pool.read_timeout, _time_out, self._waiter)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _take(self) -> bytes:
        data = b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._parts.clear()
        if self._size > HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self) -> bytes:
        """The whole body."""
        body, _ = await self.read_upto(None)
        return body

    async def read_upto(self, limit: int | None) -> tuple[bytes, bool]:
        """The body, or its first part once more than `limit` bytes came: (what came, whether that is all of it).
        What came is taken as it comes, so an answer larger than HIGH_WATER keeps flowing."""
        parts: list[bytes] = []
        size = 0
        while True:
            if self._parts:
                part = self._take()
                parts.append(part)
                size += len(part)
            if self.complete and not self._parts:
                return b"".join(parts), True
            if limit is not None and size > limit:
                return b"".join(parts), False
            if self._error is not None:
                raise self._error
            if not self._parts:
                await self._wait()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it comes: whatever has arrived at each step, joined; `Silent` when nothing more comes for
        `idle` seconds (when set, and shorter than the pool's read timeout). Its reader sets it once the answer's
        first token came: an engine may send its head, and a stream its first events, at once, and its first
        token after the prompt's prefill, which may take minutes on a CPU."""
        while True:
            if self._parts:
                yield self._take()
            elif self.complete:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait(self.idle)

    def abandon(self, why: str) -> None:
        """Give up an answer still coming (its replica left the fleet): `Lost`, for the request waiting for its
        head (another replica may take it), or for its reader once it has read what already came."""
        conn = self._conn
        if self._done or self.complete or conn.answer is not self:
            return
        conn._failed(Lost(why, conn.head is not None))
        conn._drop()

    def release(self) -> None:
        """Done with it: a connection whose answer was read to the end goes back to the pool, else it closes (an
        engine that loses its client stops generating)."""
        if self._done:
            return
        self._done = True
        self._conn.finished(self.complete)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._conn.finished(False)


def _framed(headers: dict[str, str]) -> bool:
    return "content-length" in headers or "transfer-encoding" in headers


def _time_out(waiter: asyncio.Future[T]) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout("the engine sent nothing in time"))


def _silent(waiter: asyncio.Future[T], idle: float) -> None:
    if not waiter.done():
        waiter.set_exception(Silent(f"the engine sent nothing for {idle:g}s"))


class Connection(asyncio.Protocol):
    def __init__(self, pool: Pool, where: tuple[str, int]):
        self.pool = pool
        self.where = where
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: EngineAnswer | None = None
        self.head: asyncio.Future[EngineAnswer] | None = None
        self.lost = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._name: bytes = b""

    # asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's: a stream's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                for level, option, value in SOCKET_OPTIONS:
                    sock.setsockopt(level, option, value)

    def data_received(self, data: bytes) -> None:
        if self.answer is None:
            self._drop()  # an engine that speaks while it was not asked
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(Broken(f"the engine's answer could not be read ({exc})", self.head is not None))
            self._drop()

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        answer = self.answer
        if answer is not None and not answer.complete:
            if self.head is None and not exc and not _framed(answer.headers):
                answer._end()  # a body that lasts until the connection closes: it has
            else:
                if isinstance(exc, TimeoutError):  # ETIMEDOUT: the request went unacknowledged
                    self._failed(Unreachable("the engine's host stopped answering", self.head is not None))
                else:
                    what = f"the engine closed the connection ({type(exc).__name__ if exc else 'EOF'})"
                    self._failed(Broken(what, self.head is not None))
        self.pool.forget(self)

    def pause(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    # httptools

    # the parser is fed only while an answer is awaited (data_received): `answer` is set in these

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.answer is not None
        self.answer.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        answer.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        assert self.answer is not None
        self.answer._feed(body)

    def on_message_complete(self) -> None:
        assert self.answer is not None
        self.answer._end()

    # the gateway

    def send(self, data: bytes) -> asyncio.Future[EngineAnswer]:
        self.answer = EngineAnswer(self)
        self.head = self.loop.create_future()
        assert self.transport is not None  # connected: the pool hands out only connections it made
        self.transport.write(data)
        return self.head

    def finished(self, complete: bool) -> None:
        self.answer = None
        if complete and self.keep_alive and not self.lost:
            self.pool.put(self)
        else:
            self._drop()

    def _failed(self, error: UpstreamError) -> None:
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(error)
        if self.answer is not None:
            self.answer._end(error)

    def _drop(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to every replica this process sends to, most recently used first."""

    def __init__(self, connect_timeout: float, read_timeout: float, keepalive: float = 30.0):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self.idle: dict[tuple[str, int], collections.deque[Connection]] = {}
        self.closed = False
        self.answering: dict[str, weakref.WeakSet[EngineAnswer]] = {}  # the answers asked of each replica (`post`)

    def put(self, conn: Connection) -> None:
        if self.closed:
            conn._drop()
            return
        conn.idle_since = time.monotonic()
        self.idle.setdefault(conn.where, collections.deque()).append(conn)

    def forget(self, conn: Connection) -> None:
        idle = self.idle.get(conn.where)
        if idle is not None:
            try:
                idle.remove(conn)
            except ValueError:
                pass

    def _pooled(self, where: tuple[str, int]) -> Connection | None:
        idle = self.idle.get(where)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive:
                return conn
            conn._drop()
        return None

    async def _connect(self, where: tuple[str, int]) -> Connection:
        host, port = where
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: Connection(self, where), host, port)
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:  # its words may name the address: say only what happened
            raise ConnectFailed(f"cannot connect ({os.strerror(exc.errno) if exc.errno else type(exc).__name__})") from None
        return conn

    async def post(self, host: str, port: int, path: str, body: bytes, authorization: str, headers: str = "",
                   replica: str = "") -> EngineAnswer:
        """Send a JSON body, with `headers` (whole header lines, each ending in CRLF) besides its own; return once
        the answer's status and headers came (read its body from the Answer). An answer asked of a `replica` is
        given up by `abandon(replica)`, before its head or after."""
        data = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: {authorization}\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        where = (host.strip("[]"), port)
        conn = self._pooled(where)
        if conn is not None:
            try:
                return await self._ask(conn, data, replica)
            except Broken as exc:
                if not exc.before_answer or isinstance(exc, (Unreachable, Lost)):
                    raise
                # the engine closed it while it sat in the pool: once more, on a new connection
        return await self._ask(await self._connect(where), data, replica)

    def abandon(self, replica: str, why: str) -> None:
        """Give up every answer asked of the replica and still coming (`EngineAnswer.abandon`)."""
        for answer in list(self.answering.pop(replica, ())):
            answer.abandon(why)

    async def _ask(self, conn: Connection, data: bytes, replica: str = "") -> EngineAnswer:
        head = conn.send(data)
        if replica:
            assert conn.answer is not None  # send made it
            self.answering.setdefault(replica, weakref.WeakSet()).add(conn.answer)
        timer = self.loop.call_later(self.read_timeout, _time_out, head)
        try:
            return await head
        except BaseException:  # no answer (or cancelled while waiting for one): this connection is done
            conn.answer = None
            conn._drop()
            raise
        finally:
            timer.cancel()

    async def aclose(self) -> None:
        self.closed = True
        for idle in self.idle.values():
            for conn in idle:
                conn._drop()
        self.idle.clear()
