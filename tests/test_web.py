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

from llmgw.web import SETTLE, graceful_server


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

    def __init__(self, sock: socket.socket):
        config = uvicorn.Config(app, loop="uvloop", lifespan="off", access_log=False, log_level="warning")
        self.server = graceful_server(config)
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
