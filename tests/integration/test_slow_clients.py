"""Slow and many connections against a real web process (llmgw/uvicorn_limits.py, docs/security.md): every slow
variant on the gateway, the REST API, the login page and the agent socket's path is closed within its timeout;
past the connection limit a connection is answered 503 at once; an accepted agent socket outlives every
timeout. The web runs with timeouts of a second, set as an operator would, through the environment."""

from __future__ import annotations

import socket
import time

import pytest
from websockets.sync.client import connect

from ground.ports import free_port
from llmgw.web import web_argv
from tests.integration.harness import _http_ok, start_system, wait_for

pytestmark = pytest.mark.integration

TIMEOUT = 1.0  # LLMGW_HEADER_TIMEOUT and LLMGW_BODY_TIMEOUT
SLACK = 2.0  # what a busy machine may add
PATHS = ("/v1/chat/completions", "/api/v1/", "/login/", "/ws/agent/")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = start_system(tmp_path_factory.mktemp("llmgw-slow"), redis_db=7, extra_env={
        "LLMGW_HEADER_TIMEOUT": str(TIMEOUT), "LLMGW_BODY_TIMEOUT": str(TIMEOUT), "LLMGW_KEEPALIVE_TIMEOUT": "5"})
    try:
        s.key = s.cli("ctl", "keys", "create", "slow").stdout.split()[-1]  # the gateway reads a body only with a key
        yield s
    finally:
        s.stop()


def slow_requests(path: str, key: str) -> dict[str, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\n")
    return {
        "partial headers": f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le".encode(),
        "stalled body": (head + "Content-Length: 7000000\r\n\r\n" + "{" + " " * 60000).encode(),
        "chunked body that never ends": (head + "Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n").encode(),
        "half websocket upgrade": (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                                   "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n").encode(),
    }


def test_every_slow_request_is_answered_408_and_closed_within_its_timeout(system):
    socks = {}
    for path in PATHS:
        for name, data in slow_requests(path, system.key).items():
            sock = socket.create_connection((system.host, system.port), timeout=10)
            sock.sendall(data)
            socks[(path, name)] = (sock, time.monotonic())
    late, wrong = [], []
    for (path, name), (sock, sent) in socks.items():
        got = b""
        sock.settimeout(max(0.1, sent + TIMEOUT + SLACK - time.monotonic()))
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            late.append(f"{name} on {path}")
            continue
        except ConnectionResetError:
            pass
        finally:
            sock.close()
        if not got.startswith(b"HTTP/1.1 408 "):
            wrong.append(f"{name} on {path}: {got[:60]!r}")
    assert not late, f"still open {TIMEOUT + SLACK} s on: {late}"
    assert not wrong


def test_an_agent_socket_outlives_every_timeout(system):
    out = system.cli("node", "add", "slow-n1", "--server", system.url).stdout
    token = next(w for w in out.split() if w.startswith("lnt_"))
    url = f"ws://{system.host}:{system.port}/ws/agent/"
    with connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
        time.sleep(4 * TIMEOUT)  # silent through four header and body timeouts
        assert ws.ping().wait(5), "the agent socket no longer answers"


def test_a_connection_past_the_limit_is_answered_503_at_once(system):
    port = free_port()  # a web process of its own, with a limit of 3
    system.spawn("web-limited", web_argv(system.host, port), env=dict(system.env, LLMGW_MAX_CONNECTIONS="3",
                                                                      LLMGW_KEEPALIVE_TIMEOUT="60"))
    url = f"http://{system.host}:{port}"
    wait_for(lambda: _http_ok(url + "/login/"), 60, what="the limited web process to answer")
    held = []
    try:
        for _ in range(3):  # three kept-alive connections, each answered
            sock = socket.create_connection((system.host, port), timeout=10)
            sock.sendall(b"GET /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            held.append(sock)
        started = time.monotonic()
        with socket.create_connection((system.host, port), timeout=10) as fourth:
            fourth.sendall(b"GET /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while chunk := fourth.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in got.lower(), got
        assert time.monotonic() - started < 1.5
        held.pop().close()  # one fewer: served again
        wait_for(lambda: _http_ok(url + "/login/"), 10, interval=0.1, what="a connection to be served again")
    finally:
        for sock in held:
            sock.close()
        system.procs.pop("web-limited").stop()
