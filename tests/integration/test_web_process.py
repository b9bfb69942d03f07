"""A web process's own affairs, on the session's system: the books it finishes when it is told to stop (the usage
it counted reaches the database before it exits, under uvicorn and daphne), and the descriptors it keeps for its
own database, Redis and engine sockets while a flood of connections past its limit is refused
(llmgw/uvicorn_limits.py)."""

import http.client
import json
import signal
import socket
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest

from ground.ports import free_port
from llmgw.uvicorn_limits import REFUSED_AT_ONCE, REFUSED_LINGER
from llmgw.web import SERVERS, web_argv
from tests.integration.harness import add_test_engine, start_web, wait_for

pytestmark = pytest.mark.integration

HELLO = {"messages": [{"role": "user", "content": "Say hello please"}]}


@pytest.fixture(scope="module")
def served(system):
    """A model of the test engine for each web server (usage is counted per model: each test reads its own), and a
    key for them."""
    add_test_engine(system, name="wp-engine")
    for server in SERVERS:
        system.cli("ctl", "model", "add", f"wp-{server}", "--file", system.sha, "--engine", "wp-engine",
                   "--memory", "100MiB")
    key = system.cli("ctl", "keys", "create", "wp-key").stdout.split()[-1]
    for server in SERVERS:
        system.wait_ready(f"wp-{server}", 1)
    yield SimpleNamespace(key=key)
    for server in SERVERS:
        system.cli("ctl", "model", "remove", f"wp-{server}", check=False)
    wait_for(lambda: not {f"wp-{s}" for s in SERVERS} & {m["name"] for m in system.cli_json("ctl", "models")}, 60,
             what="the models removed")


def chat(url: str, key: str, model: str, stream: bool = False) -> httpx.Response:
    answer = httpx.post(url + "/v1/chat/completions", json={"model": model, "stream": stream, **HELLO}, timeout=30,
                        headers={"Authorization": f"Bearer {key}", "Connection": "close"})
    assert answer.status_code == 200, answer.text
    return answer


def requests_counted(system, model: str) -> int:
    """Requests for `model` in the database, where the web processes write their usage every second."""
    return sum(row["requests"] for row in system.cli_json("ctl", "usage", "--model", model))


@pytest.mark.parametrize("server", SERVERS)
def test_a_web_process_told_to_stop_right_after_a_request_leaves_its_usage_in_the_database(system, served, server):
    model, name = f"wp-{server}", f"wp-web-{server}"
    url = start_web(system, name, server)
    try:
        chat(url, served.key, model)
        # its usage reaches the database with the process's next write (one a second): the one after is a second away
        wait_for(lambda: requests_counted(system, model) == 1, 5, interval=0.02, what="the first write")
        chat(url, served.key, model, stream=True)
        web = system.procs[name]
        web.send(signal.SIGTERM)  # what `llmgw restart` and `llmgw up`'s Ctrl-C send
        web.popen.wait(30)
        assert web.returncode in (0, -signal.SIGTERM), web.tail()
        assert requests_counted(system, model) == 2  # written before it exited
    finally:
        system.procs.pop(name).stop()


# Connections past the limit

LIMITED_NOFILE = 360  # the web process's open-file limit: a few dozen of its own, one client, the refused, the rest


def limited_web(system, port: int) -> list[str]:
    """The web process's command line, run under an open-file limit of LIMITED_NOFILE (as `prlimit` would)."""
    limit = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMITED_NOFILE}, "
             f"{LIMITED_NOFILE})); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    return [sys.executable, "-c", limit, *web_argv(system.host, port, "uvicorn")[1:]]


def test_a_flood_past_the_connection_limit_leaves_the_process_its_own_sockets(system, served) -> None:
    """A web process at its limit of one connection, flooded with connections that each send a request and then
    hold on: each is refused and let go of within a moment (not held for seconds, a descriptor each), and the one
    connection it serves is answered a real /v1/ request meanwhile, its first: the process opens its database,
    Redis and engine sockets while the flood goes on."""
    port = free_port()
    name = "wp-web-limited"
    system.spawn(name, limited_web(system, port), env=dict(system.env, LLMGW_MAX_CONNECTIONS="1",
                                                          LLMGW_KEEPALIVE_TIMEOUT="60"))
    flood: list[tuple[socket.socket, float]] = []
    try:
        def served_one() -> http.client.HTTPConnection | None:  # the one connection, its first answer static
            conn = http.client.HTTPConnection(system.host, port, timeout=30)
            try:
                conn.request("GET", "/static/dashboard/dashboard.css")
                answer = conn.getresponse()
                answer.read()
            except OSError:
                conn.close()
                return None
            if answer.status != 200:
                conn.close()
                return None
            return conn

        one = wait_for(served_one, 60, interval=0.2, what="the limited web process to serve a connection")
        web = psutil.Process(system.procs[name].pid)
        own = web.num_fds()
        stop = threading.Event()

        def flood_it() -> None:  # a connection a millisecond, each sending a request and holding on
            for _ in range(600):
                if stop.is_set():
                    return
                try:
                    sock = socket.create_connection((system.host, port), timeout=10)
                    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                except OSError:
                    continue
                flood.append((sock, time.monotonic()))
                time.sleep(0.001)

        flooding = threading.Thread(target=flood_it)
        flooding.start()
        # as many as would take every descriptor it has, were each held for seconds
        wait_for(lambda: len(flood) >= LIMITED_NOFILE + 40, 20, interval=0.01, what="the flood under way")
        peak = web.num_fds()
        one.request("POST", "/v1/chat/completions", body=json.dumps({"model": "wp-uvicorn", **HELLO}),
                    headers={"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"})
        answer = one.getresponse()
        body = answer.read()
        peak = max(peak, web.num_fds())
        stop.set()
        flooding.join(30)
        assert answer.status == 200, body[:300]
        assert peak <= own + REFUSED_AT_ONCE + 60, f"{peak} descriptors open (its own and one client's: {own})"

        # each refused connection let go of within a moment, while its client holds on: none is left
        time.sleep(max(0.0, flood[-1][1] + REFUSED_LINGER + 0.5 - time.monotonic()))
        mine = one.sock.getsockname()[1]
        left = [c for c in web.net_connections("tcp") if c.laddr.port == port and c.raddr and c.raddr.port != mine]
        assert not left, f"{len(left)} of {len(flood)} refused connections still held {REFUSED_LINGER + 0.5} s on"
        refused = 0
        for sock, _ in flood:
            sock.settimeout(5)
            try:
                refused += sock.recv(4096).startswith(b"HTTP/1.1 503 ")
            except ConnectionResetError:  # closed at once, past the few held: the request unread
                pass
        assert refused >= REFUSED_AT_ONCE  # the 503 reached those it could
    finally:
        for sock, _ in flood:
            sock.close()
        system.procs.pop(name).stop()
