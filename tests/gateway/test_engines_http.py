"""The gateway's HTTP/1.1 to the engines (gateway/engines_http.py), against real servers on loopback: keep-alive,
bodies framed every way, answers as they come, and each way a connection fails."""

import asyncio
import socket

import pytest
import pytest_asyncio

from gateway.engines_http import (
    UNACKNOWLEDGED_SECONDS,
    Broken,
    ConnectFailed,
    ConnectTimeout,
    Pool,
    ReadTimeout,
    Unreachable,
)
from ground.ports import free_port

pytestmark = pytest.mark.asyncio


class Server:
    """A raw HTTP server on loopback that answers each request with `answer(request_bytes)`: a list of byte
    strings to write (a float among them: a pause of that many seconds; None: close the connection)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = free_port()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                for part in self.answer(request):
                    if part is None:
                        writer.close()
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def whole(body: bytes, status: str = "200 OK", extra: str = "") -> list:
    return [f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
            + body]


def chunked(*events: bytes, pause: float = 0.0) -> list:
    out: list[bytes | float] = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for event in events:
        out += [f"{len(event):x}\r\n".encode() + event + b"\r\n", pause]
    return out + [b"0\r\n\r\n"]


@pytest_asyncio.fixture
async def pool():
    made = Pool(connect_timeout=1.0, read_timeout=1.0)
    yield made
    await made.aclose()


async def post(pool, server, body=b'{"x": 1}'):
    return await pool.post("127.0.0.1", server.port, "/v1/chat/completions", body, "Bearer lek_test")


async def test_a_request_is_sent_with_the_engine_key_and_its_answer_read_whole(pool):
    async with Server(lambda request: whole(b'{"ok": true}')) as server:
        answer = await post(pool, server, b'{"model": "m"}')
        assert answer.status == 200 and answer.content_type == "application/json"
        assert await answer.read() == b'{"ok": true}'
        answer.release()
    head, body = server.requests[0].split(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer lek_test" in head and b"\r\nContent-Length: 14" in head
    assert body == b'{"model": "m"}'


async def test_connections_are_kept_alive_and_reused(pool):
    async with Server(lambda request: whole(b"{}")) as server:
        for _ in range(5):
            answer = await post(pool, server)
            await answer.read()
            answer.release()
        assert server.connections == 1
        # one not read to the end is not given back: its connection closes (the engine stops generating)
        cut = await post(pool, server)
        cut.close()
        answer = await post(pool, server)
        await answer.read()
        answer.release()
        assert server.connections == 2


async def test_an_engine_that_closes_an_idle_connection_costs_nothing(pool):
    async with Server(lambda request: [*whole(b"{}"), None]) as server:  # closes after every answer, unannounced
        for _ in range(3):
            answer = await post(pool, server)
            assert await answer.read() == b"{}"
            answer.release()
        assert server.connections == 3


async def test_connection_close_is_obeyed(pool):
    async with Server(lambda request: whole(b"{}", extra="Connection: close\r\n")) as server:
        for _ in range(2):
            answer = await post(pool, server)
            await answer.read()
            answer.release()
        assert server.connections == 2


async def test_a_stream_comes_as_it_is_sent(pool):
    async with Server(lambda request: chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n", pause=0.2)) as server:
        answer = await post(pool, server)
        assert answer.content_type == "text/event-stream"
        chunks = answer.chunks()
        first = await asyncio.wait_for(anext(chunks), 0.15)  # before the second is even sent
        assert first == b"data: 1\n\n"
        rest = [chunk async for chunk in chunks]
        assert b"".join(rest) == b"data: 2\n\ndata: [DONE]\n\n"
        assert answer.complete
        answer.release()
        again = await post(pool, server)  # the connection went back to the pool
        assert b"[DONE]" in await again.read()
        again.release()
        assert server.connections == 1


async def test_a_body_that_lasts_until_the_connection_closes(pool):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\": "
    async with Server(lambda request: [head, 0.05, b"1}", None]) as server:
        answer = await post(pool, server)
        assert await answer.read() == b'{"a": 1}'
        answer.release()


async def test_a_large_answer_is_read_whole_past_the_high_water_mark(pool):
    big = b"x" * (5 << 20)
    async with Server(lambda request: whole(big)) as server:
        answer = await post(pool, server)
        chunks = answer.chunks()
        got = [await anext(chunks)]
        await asyncio.sleep(0.2)  # the engine wrote more than the mark meanwhile: reading paused, nothing lost
        got += [chunk async for chunk in chunks]
        assert b"".join(got) == big
        answer.release()


async def test_refused(pool):
    with pytest.raises(ConnectFailed) as failed:
        await pool.post("127.0.0.1", free_port(), "/v1/chat/completions", b"{}", "Bearer k")
    assert failed.value.before_answer and "127.0.0.1" not in str(failed.value)


async def test_a_listener_that_never_accepts_is_a_connect_timeout():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    pool = Pool(connect_timeout=0.3, read_timeout=1.0)
    try:
        for _ in range(8):  # fill the accept queue: the kernel drops the next handshake
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        with pytest.raises(ConnectTimeout):
            await pool.post("127.0.0.1", port, "/v1/chat/completions", b"{}", "Bearer k")
    finally:
        await pool.aclose()
        for filler in fillers:
            filler.close()
        listener.close()


async def test_no_answer_in_time_is_a_read_timeout(pool):
    async with Server(lambda request: [5.0]) as server:
        with pytest.raises(ReadTimeout):
            await post(pool, server)


async def test_an_engine_that_stops_sending_mid_stream_is_a_read_timeout(pool):
    async with Server(lambda request: chunked(b"data: 1\n\n", b"data: 2\n\n", pause=5.0)) as server:
        answer = await post(pool, server)
        chunks = answer.chunks()
        assert await anext(chunks) == b"data: 1\n\n"
        with pytest.raises(ReadTimeout):
            await anext(chunks)
        answer.close()


async def test_closed_before_an_answer_and_closed_midway(pool):
    async with Server(lambda request: [None]) as server:
        with pytest.raises(Broken) as before:
            await post(pool, server)
        assert before.value.before_answer
    async with Server(lambda request: [whole(b"0123456789")[0][:-5], 0.05, None]) as server:
        answer = await post(pool, server)
        with pytest.raises(Broken) as midway:
            await answer.read()
        assert not midway.value.before_answer
        answer.close()


async def test_an_answer_that_is_not_http_is_broken(pool):
    async with Server(lambda request: [b"SSH-2.0-OpenSSH\r\n\r\n"]) as server:
        with pytest.raises(Broken):
            await post(pool, server)


async def test_a_client_that_gives_up_waiting_closes_the_connection(pool):
    async with Server(lambda request: [5.0, *whole(b"{}")]) as server:
        waiting = asyncio.ensure_future(post(pool, server))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not pool.idle.get(("127.0.0.1", server.port))


async def test_a_connection_gives_up_on_a_host_that_stops_acknowledging(pool):
    """TCP_USER_TIMEOUT on every connection: a request to a node cut off is found out in seconds, where on a
    pooled connection it would otherwise wait out the read timeout (the fleet tests cut one for real); no
    keepalive probes, which a lossy link would lose in the middle of an answer."""
    async with Server(lambda request: whole(b"{}")) as server:
        answer = await post(pool, server)
        await answer.read()
        answer.release()
        [conn] = pool.idle[("127.0.0.1", server.port)]
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == UNACKNOWLEDGED_SECONDS * 1000
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0

        # what the kernel says when it gives up (ETIMEDOUT) is `Unreachable`, before any of an answer: the caller
        # passes the replica over and another takes the request
        waiting = asyncio.ensure_future(conn.pool._ask(conn, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
        await asyncio.sleep(0)
        conn.connection_lost(TimeoutError(110, "Connection timed out"))
        with pytest.raises(Unreachable) as lost:
            await waiting
        assert lost.value.before_answer


async def test_a_whole_answer_larger_than_the_buffer_is_read_to_its_end(pool):
    """Reading pauses at HIGH_WATER until the reader takes what came: `read` takes as it goes, so an answer of many
    megabytes arrives whole (it waited out the read timeout before), and `read_upto` stops at its limit with the
    rest still to come."""
    body = b'{"data": "' + b"x" * (5 << 20) + b'"}'
    async with Server(lambda request: whole(body)) as server:
        answer = await pool.post("127.0.0.1", server.port, "/v1/embeddings", b"{}", "Bearer k")
        assert await answer.read() == body
        answer.release()
        answer = await pool.post("127.0.0.1", server.port, "/v1/embeddings", b"{}", "Bearer k")
        head, complete = await answer.read_upto(1 << 20)
        assert not complete and (1 << 20) < len(head) < len(body)
        rest = b"".join([chunk async for chunk in answer.chunks()])
        assert head + rest == body and answer.complete
        answer.release()
        assert server.connections == 1  # read to the end both times: the connection went back to the pool
