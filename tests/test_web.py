"""llmgw.web's graceful stop, on a real uvicorn (in a thread, on a socket of the test's) with a tiny ASGI app:
what a web process told to restart does with the keep-alive connections its clients hold."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time

import pytest
import uvicorn

from llmgw.uvicorn_limits import Limits
from llmgw.web import SETTLE, graceful_server

ROOMY = Limits(header_timeout=20, body_timeout=30, keepalive_timeout=20, max_connections=4096)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


async def app(scope, receive, send):
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(0.005)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Running:
    """`graceful_server` serving `sock` from a thread of its own, as a web process serves the socket it inherits."""

    def __init__(self, sock: socket.socket, limits: Limits = ROOMY, application=app):
        config = uvicorn.Config(application, loop="uvloop", lifespan="off", access_log=False, log_level="warning")
        self.server = graceful_server(config, limits)
        # its own descriptor of the socket, as each web process has: uvicorn closes the one it serves as it stops
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock.dup()]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        """Begin the stop (what SIGTERM does) and return once it is under way: no longer accepting."""
        self.server.should_exit = True
        deadline = time.monotonic() + 5
        while not getattr(self.server.server_state, "stopping", False):
            assert time.monotonic() < deadline, "the stop did not begin"
            time.sleep(0.001)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the server still runs {timeout} s after it was told to stop"


@pytest.fixture
def listener():
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


@pytest.fixture
def long_settle(monkeypatch):
    """A settle of a second: what a test sends "as the stop begins" then arrives within it on a busy machine."""
    monkeypatch.setattr("llmgw.web.SETTLE", 1.0)


def get(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    conn.request("GET", "/")
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"ok")
    return response


def test_a_request_on_a_kept_alive_connection_as_the_stop_begins_is_answered_and_told_to_close(listener, long_settle):
    running = Running(listener)
    conn = http.client.HTTPConnection(*listener.getsockname())
    assert get(conn).getheader("connection") is None  # kept alive
    running.stop()
    # the client sends its next request on the connection it holds, the server no longer accepting: it is
    # answered (uvicorn alone closes a connection idle at that moment), and told to go elsewhere for the next
    assert get(conn).getheader("connection") == "close"
    running.join(5)
    conn.close()


def test_a_connection_idle_all_through_the_settle_is_closed_and_the_stop_ends(listener):
    running = Running(listener)
    conn = http.client.HTTPConnection(*listener.getsockname())
    get(conn)
    started = time.monotonic()
    running.stop()
    running.join(5)
    assert time.monotonic() - started >= SETTLE
    conn.sock.settimeout(5)
    assert conn.sock.recv(1) == b""  # closed by the server, nothing sent


def test_clients_sending_back_to_back_lose_nothing_while_one_of_two_processes_on_a_socket_stops(listener, long_settle):
    first, second = Running(listener), Running(listener)
    failures, answers, done = [], [], threading.Event()

    def client():
        conn = http.client.HTTPConnection(*listener.getsockname(), timeout=10)
        while not done.is_set():
            try:
                if get(conn).getheader("connection") == "close":
                    conn.close()  # the next request goes over a new connection, to the process that stays
                answers.append(1)
            except Exception as exc:  # every failure counts
                failures.append(repr(exc))
                conn.close()

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: len(answers) >= 50)  # both processes answering
    first.stop()
    first.join(10)
    before = len(answers)
    wait_until(lambda: len(answers) >= before + 50 or failures)
    done.set()
    for t in threads:
        t.join(10)
    second.server.should_exit = True
    second.join(10)
    assert not failures, f"{len(failures)} of {len(answers) + len(failures)} requests failed: {failures[:3]}"
    assert len(answers) > before  # the survivor went on answering


# Slow and many connections (llmgw/uvicorn_limits.py): short limits, a raw socket as the client.

SHORT = Limits(header_timeout=1.0, body_timeout=1.0, keepalive_timeout=5.0, max_connections=4096)
SLACK = 1.5  # seconds a busy machine may add to a timeout


async def echo(scope, receive, send):
    """Reads the whole body, then answers its length; `/stream` answers in ten parts 0.4 s apart; a websocket
    echoes."""
    if scope["type"] == "websocket":
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message.get("text") or ""})
        return
    if scope["path"] == "/early":  # answers before it reads a byte of the body (as the gateway does without a key)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"early"})
        return
    if scope["path"] == "/late-reader":  # the application takes its time before it asks for the body
        await asyncio.sleep(3)
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(10):
            await asyncio.sleep(0.4)
            await send({"type": "http.response.body", "body": b"%d\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"end\n"})
        return
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def short(listener):
    running = Running(listener, SHORT, echo)
    yield listener.getsockname()
    running.server.should_exit = True
    running.join(10)


def dial(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took; fails if it is still open
    `within` seconds on."""
    started = time.monotonic()
    got = b""
    sock.settimeout(within)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {within} s; got {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    return got, time.monotonic() - started


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(short):
    sock = dial(short)
    got, took = until_closed(sock, SHORT.header_timeout + SLACK)
    assert got == b"" and took >= SHORT.header_timeout - 0.1


@pytest.mark.parametrize("partial", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
    b"GET /ws/agent/ HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n",  # a half upgrade
])
def test_headers_that_never_end_are_answered_408_and_closed(short, partial):
    sock = dial(short)
    sock.sendall(partial)
    got, took = until_closed(sock, SHORT.header_timeout + SLACK)
    assert got.startswith(b"HTTP/1.1 408 ") and b"connection: close" in got
    assert took >= SHORT.header_timeout - 0.1


def test_headers_sent_a_byte_at_a_time_still_end_at_the_header_timeout(short):
    sock = dial(short)
    request = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 100
    started = time.monotonic()
    try:
        for byte in request:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
            if time.monotonic() - started > SHORT.header_timeout + SLACK:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    got, _ = until_closed(sock, SHORT.header_timeout + SLACK)
    assert got.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < SHORT.header_timeout + 2 * SLACK


def test_the_next_request_on_a_kept_alive_connection_has_the_header_timeout_from_its_first_byte(short):
    sock = dial(short)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    time.sleep(SHORT.header_timeout + 0.5)  # idle, within the keep-alive timeout: still open
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    got, took = until_closed(sock, SHORT.header_timeout + SLACK)
    assert got.startswith(b"HTTP/1.1 408 ") and took >= SHORT.header_timeout - 0.1


def test_a_stalled_body_is_answered_408_and_closed(short):
    sock = dial(short)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 7000000\r\n\r\n" + b"x" * 100_000)
    got, took = until_closed(sock, SHORT.body_timeout + SLACK)
    assert got.startswith(b"HTTP/1.1 408 ") and took >= SHORT.body_timeout - 0.1


def test_a_chunked_body_is_timed_from_its_last_chunk_not_its_first(short):
    sock = dial(short)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    started = time.monotonic()
    while time.monotonic() - started < 3 * SHORT.body_timeout:  # a chunk every 0.3 s: never silent for long
        sock.sendall(b"3\r\nabc\r\n")
        time.sleep(0.3)
    sock.sendall(b"0\r\n\r\n")  # it ends: answered
    sock.settimeout(5)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")  # never ends
    got, took = until_closed(sock, SHORT.body_timeout + SLACK)
    assert got.startswith(b"HTTP/1.1 408 ") and took >= SHORT.body_timeout - 0.1


def test_an_answer_that_takes_longer_than_every_timeout_is_not_cut(short):
    sock = dial(short)
    sock.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    got, took = b"", time.monotonic()
    sock.settimeout(10)
    while not got.endswith(b"end\n\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-answer: {got!r}"
        got += chunk
    assert time.monotonic() - took >= 4 * SHORT.body_timeout  # ten parts 0.4 s apart


def test_a_body_the_application_is_slow_to_ask_for_is_not_the_clients_silence(short):
    sock = dial(short)
    body = b"x" * 1_000_000  # past uvicorn's 64 KiB buffer: reading pauses until the application asks
    sock.sendall(b"POST /late-reader HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    sock.settimeout(10)
    got = sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"1000000")


def server_end(address, client: socket.socket) -> bool:
    """The server (in this process) still holds its end of `client`'s connection."""
    import psutil

    mine = client.getsockname()
    return any(c.laddr == address and c.raddr == mine for c in psutil.Process().net_connections("tcp"))


def test_connections_past_the_limit_are_answered_503_at_once(listener):
    running = Running(listener, Limits(20, 30, 20, max_connections=2), echo)
    try:
        address = listener.getsockname()
        held = [dial(address), dial(address)]
        for sock in held:  # both served
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        third = dial(address)
        third.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got, took = until_closed(third, 5)
        assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in got.lower() and took < 1
        # the server's end let go of within a moment while the client holds on to its own: its request read, the
        # client quiet (it was held 2 s, a descriptor each, by a flood of them)
        wait_until(lambda: not server_end(address, third), 1.0)
        assert not server_end(address, third)
        held.pop().close()
        wait_until(lambda: len(running.server.server_state.connections) < 2)
        fourth = dial(address)
        fourth.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert fourth.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        running.server.should_exit = True
        running.join(10)


def test_an_accepted_websocket_outlives_every_timeout(short):
    from websockets.sync.client import connect

    with connect(f"ws://{short[0]}:{short[1]}/ws/") as ws:
        for i in range(4):  # four header and body timeouts, silent in between
            time.sleep(SHORT.header_timeout)
            ws.send(f"hello {i}")
            assert ws.recv(timeout=5) == f"hello {i}"


def test_a_body_sent_after_its_answer_is_timed_too_and_then_the_connection_idles_out(listener):
    running = Running(listener, Limits(1.0, 1.0, keepalive_timeout=1.0, max_connections=4096), echo)
    try:
        address = listener.getsockname()
        sock = dial(address)
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        got, took = until_closed(sock, 1.0 + SLACK)  # the rest of the body never comes
        assert got == b"" and took >= 0.9
        sock = dial(address)
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"x" * 990)  # the rest, after the answer: then idle, closed as any idle connection
        got, took = until_closed(sock, 1.0 + SLACK)
        assert got == b""
    finally:
        running.server.should_exit = True
        running.join(10)



def test_the_open_file_limit_is_raised_for_the_connections_or_they_are_fewer():
    """systemd starts a service with 1024 files (the soft limit): a web process raises it to what its connection
    limit needs beside its own descriptors and the refused connections' few, as far as the hard limit lets it,
    else takes fewer connections."""
    import resource

    from llmgw.uvicorn_limits import FD_RESERVE, REFUSED_AT_ONCE

    kept = FD_RESERVE + REFUSED_AT_ONCE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 4096 + kept:
        pytest.skip(f"a hard limit of {hard} files")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        assert Limits(20, 30, 20, 4096).within_descriptors().max_connections == 4096
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 4096 + kept
        assert Limits(20, 30, 20, hard).within_descriptors().max_connections == hard - kept
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
