"""A web process's own affairs, on the session's system: the books it finishes when it is told to stop (the usage
it counted reaches Redis before it exits, under uvicorn and daphne). Usage is read straight from Redis (and the
database, where the beat's flush may have moved it): no Celery needed."""

import signal
from types import SimpleNamespace

import httpx
import pytest
import redis

from gateway.accounting import USAGE_HASH
from gateway.usage import BATCH
from llmgw.web import SERVERS
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


def requests_in_redis(system, model: str) -> int:
    """Requests for `model` as web processes flushed them to Redis: its hash, and a batch the beat's flush is moving
    to the database."""
    r = redis.Redis.from_url(system.env["REDIS_URL"])
    try:
        return sum(int(v) for name in [USAGE_HASH.encode(), *r.scan_iter(match=f"{USAGE_HASH}{BATCH}*")]
                   for k, v in r.hgetall(name).items() if k.decode().endswith(f"|{model}|requests"))
    finally:
        r.close()


def requests_counted(system, model: str) -> int:
    """... and in the database, where the beat's flush moves them."""
    return requests_in_redis(system, model) + sum(row["requests"] for row in
                                                  system.cli_json("ctl", "usage", "--model", model))


@pytest.mark.parametrize("server", SERVERS)
def test_a_web_process_told_to_stop_right_after_a_request_leaves_its_usage_in_redis(system, served, server):
    model, name = f"wp-{server}", f"wp-web-{server}"
    url = start_web(system, name, server)
    try:
        chat(url, served.key, model)
        # its usage reaches Redis with the process's next flush (one a second): the one after is a second away
        try:
            wait_for(lambda: requests_in_redis(system, model) == 1, 3, interval=0.005, what="the first flush")
        except AssertionError:  # the beat's flush took it to the database first
            wait_for(lambda: requests_counted(system, model) == 1, 10, what="the first request counted")
        chat(url, served.key, model, stream=True)
        web = system.procs[name]
        web.send(signal.SIGTERM)  # what `llmgw restart` and `llmgw up`'s Ctrl-C send
        web.popen.wait(30)
        assert web.returncode in (0, -signal.SIGTERM), web.tail()
        # counted before it exited: (a moment's wait only for a batch the beat's flush is moving)
        wait_for(lambda: requests_counted(system, model) == 2, 5, interval=0.1, what="both requests counted")
    finally:
        system.procs.pop(name).stop()
