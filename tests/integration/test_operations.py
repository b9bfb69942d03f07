"""Restart, drain, stop and start on the real processes, under steady client load through the gateway (the
official openai client, a few requests in flight at all times): zero failed requests where the design says so.

Each test prints its failed-request count and handover times (`pytest -s` shows them)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

import openai
import pytest
import redis

from cluster import control
from tests.integration.harness import add_test_engine, start_nginx, start_web, wait_for

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello please"}]


@pytest.fixture(scope="module")
def ops(system):
    """The test engine with two slots per replica (`--parallel {parallel}`, the profile's 2): the load of three
    clients waits in admission's queue, and an engine answers 500 if ever more than its slots are let in, so
    every restart, drain and stop under load below is a test of admission too (issue 35)."""
    add_test_engine(system, name="op-engine", args="--load-seconds 1 --parallel {parallel}")
    system.cli("ctl", "profile", "add", "op-two", "--parallel", "2")
    key = system.cli("ctl", "keys", "create", "op-load").stdout.split()[-1]
    return key


def add_model(system, name: str, *args: str, replicas: int = 1, memory: str = "300MiB") -> None:
    system.cli("ctl", "model", "add", name, "--file", system.sha, "--engine", "op-engine", "--profile", "op-two",
               "--replicas", str(replicas), "--memory", memory, *args)


def remove_model(system, name: str) -> None:
    system.cli("ctl", "model", "remove", name, check=False)
    wait_for(lambda: name not in [m["name"] for m in system.cli_json("ctl", "models")], 60, what=f"{name} removed")


class Load:
    """`threads` clients sending chat requests (every other one streamed) without pause or client retries."""

    def __init__(self, system, key: str, model: str, threads: int = 3, url: str | None = None):
        self.client = openai.OpenAI(base_url=(url or system.url) + "/v1", api_key=key, max_retries=0, timeout=120)
        self.model, self.threads = model, threads
        self.ok = 0
        self.failed: list[str] = []
        self.stopped_503 = 0
        self.expect_stopped = False
        self._done = threading.Event()
        self._lock = threading.Lock()

    def _run(self, n: int) -> None:
        stream = bool(n % 2)
        while not self._done.is_set():
            try:
                if stream:
                    text = "".join(c.choices[0].delta.content or "" for c in self.client.chat.completions.create(
                        model=self.model, messages=HELLO, stream=True) if c.choices)
                else:
                    text = self.client.chat.completions.create(model=self.model, messages=HELLO).choices[0].message.content
                assert text, "an empty answer"
                with self._lock:
                    self.ok += 1
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                with self._lock:
                    if self.expect_stopped and exc.status_code == 503 and body.get("code") == "system_stopped":
                        self.stopped_503 += 1
                    else:
                        self.failed.append(f"{exc.status_code} {body.get('code')}: {body.get('message')}")
                time.sleep(0.05)
            except Exception as exc:  # connection errors, broken streams, empty answers
                with self._lock:
                    self.failed.append(repr(exc))
                time.sleep(0.05)
            stream = not stream

    @contextmanager
    def running(self):
        workers = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(self.threads)]
        for w in workers:
            w.start()
        try:
            wait_for(lambda: self.ok >= self.threads, 60, what="the load to be served")
            yield self
        finally:
            self._done.set()
            for w in workers:
                w.join(120)


def replicas_by_name(system, model: str) -> dict[str, dict]:
    """Every replica of the model, stopped ones too (the REST API: far cheaper to poll than a CLI process)."""
    response = system.api("GET", f"/api/v1/replicas/?model={model}&limit=1000")
    assert response.status_code == 200, response.text
    return {r["name"]: r for r in response.json()["results"]}


def watch_handover(system, model: str, old: set[str], want: int, timeout: float = 120) -> dict:
    """Poll until every `old` replica is stopped and `want` new ones are ready; return when each new one became
    ready and each old one stopped, and the most replicas of the model ever being replaced at once (marked
    `replacing` and not yet stopped: serving, draining or stopping)."""
    seen_ready: dict[str, float] = {}
    seen_stopped: dict[str, float] = {}
    most_replacing = 0
    deadline = time.monotonic() + timeout
    while True:
        reps = replicas_by_name(system, model)
        now = time.monotonic()
        most_replacing = max(most_replacing, sum(
            1 for r in reps.values() if r["restart"] == "replacing" and r["state"] not in ("stopped", "failed")))
        for name, r in reps.items():
            if name not in old and r["state"] == "ready":
                seen_ready.setdefault(name, now)
            if name in old and r["state"] in ("stopped", "failed"):
                seen_stopped.setdefault(name, now)
        if len(seen_stopped) == len(old) and len([n for n in seen_ready if reps[n]["state"] == "ready"]) >= want:
            return {"ready": seen_ready, "stopped": seen_stopped, "most_replacing": most_replacing, "reps": reps}
        assert now < deadline, json.dumps(reps, indent=1, default=str)
        time.sleep(0.2)


def handover_seconds(system, seen: dict) -> list[float]:
    """For each replaced replica, from the Events: its replacement ready -> it stopped, in seconds."""
    from datetime import datetime

    def at(subject: str, kind: str) -> datetime:
        (event,) = [e for e in system.cli_json("ctl", "events", "--subject", subject, "--kind", kind, "--limit", "5")]
        return datetime.fromisoformat(event["created_at"])

    stopped = sorted(at(name, "replica.stopped") for name in seen["stopped"])
    ready = sorted(at(name, "replica.ready") for name in seen["ready"])
    return [round((s - r).total_seconds(), 1) for r, s in zip(ready, stopped)]


def test_restart_all_with_room_loses_no_request_and_replaces_one_at_a_time(system, ops):
    add_model(system, "op-roomy", replicas=2)
    before = {r["name"] for r in system.wait_ready("op-roomy", 2)}
    load = Load(system, ops, "op-roomy")
    with load.running():
        started = time.monotonic()
        said = system.cli("ctl", "restart", "--all").stdout
        assert "queued for restart; watch with: llmgw ctl replicas" in said
        seen = watch_handover(system, "op-roomy", before, 2)
        took = time.monotonic() - started
    print(f"\nrestart --all, room for a second copy: {load.ok} served, {len(load.failed)} failed, {took:.1f}s in all; "
          f"replacement ready -> old stopped (s): {handover_seconds(system, seen)}")
    assert not load.failed, load.failed[:5]
    assert seen["most_replacing"] == 1, "two replicas of one model were replaced at once"
    new = [n for n, r in seen["reps"].items() if n not in before and r["state"] == "ready"]
    assert len(new) == 2 and all(seen["reps"][n]["restart"] == "none" for n in new)
    remove_model(system, "op-roomy")


def test_restart_of_an_only_replica_with_no_room_waits_instead_of_failing(system, ops):
    """Pinned to one node with room for one copy: the old replica drains and stops, the new one starts in its
    place, and requests meanwhile wait for it (the engine loads in 1 s; the model waits up to 30 s)."""
    add_model(system, "op-tight", "--nodes", "n1", memory="1500MiB")
    (old,) = system.wait_ready("op-tight", 1)
    load = Load(system, ops, "op-tight", threads=2)
    with load.running():
        system.cli("ctl", "restart", old["name"])
        seen = watch_handover(system, "op-tight", {old["name"]}, 1)
        wait_for(lambda: load.ok >= 10, 30, what="requests after the restart")
    print(f"\nrestart with no room: {load.ok} served, {len(load.failed)} failed; replacement ready -> old stopped "
          f"(negative: the old one stopped first) (s): {handover_seconds(system, seen)}")
    assert not load.failed, load.failed[:5]
    outage = [line for line in system.cli("ctl", "events", "--subject", old["name"]).stdout.splitlines() if "outage" in line]
    assert outage, "the Event log says an outage was chosen"
    remove_model(system, "op-tight")


def test_drain_moves_replicas_with_no_failed_request_and_the_node_ends_drained(system, ops):
    add_model(system, "op-drain", replicas=2)
    reps = system.wait_ready("op-drain", 2)
    node = reps[0]["node"]
    on_node = {r["name"] for r in reps if r["node"] == node}
    load = Load(system, ops, "op-drain")
    with load.running():
        system.cli("ctl", "drain", node)
        seen = watch_handover(system, "op-drain", on_node, 2)
        wait_for(lambda: {n["name"]: n for n in system.cli_json("ctl", "nodes")}[node]["drain"] == "drained", 60,
                 what=f"{node} drained")
    print(f"\ndrain {node}: {load.ok} served, {len(load.failed)} failed; replacement ready -> old stopped (s): "
          f"{handover_seconds(system, seen)}")
    assert not load.failed, load.failed[:5]
    assert all(r["node"] != node for r in seen["reps"].values() if r["state"] == "ready")
    system.cli("ctl", "undrain", node)
    remove_model(system, "op-drain")


def test_stop_answers_503_at_once_stops_every_engine_and_start_serves_again(system, ops):
    add_model(system, "op-stop", replicas=2)
    reps = system.wait_ready("op-stop", 2)
    definition = ("name", "file", "engine", "profile", "replicas", "memory_bytes", "nodes", "wait_seconds")
    models_before = [{k: m.get(k) for k in definition} for m in system.cli_json("ctl", "models")]
    load = Load(system, ops, "op-stop", threads=2)
    started = False
    try:
        with load.running():
            load.expect_stopped = True
            system.cli("stop")
            asked = time.monotonic()  # the stop is committed once the command returns
            stopped_in = wait_for(lambda: load.stopped_503 and time.monotonic() - asked, 10, interval=0.05,
                                  what="503 system_stopped")
            wait_for(lambda: all(r["state"] == "stopped" for r in replicas_by_name(system, "op-stop").values()
                                 if r["name"] in {x["name"] for x in reps}), 60,
                     what="every engine stopped")
            for r in reps:
                assert not _alive(r["pid"]), f"engine {r['pid']} still running"
            said = system.cli("status").stdout
            assert "STOPPED" in said, said
            models_after = [{k: m.get(k) for k in definition} for m in system.cli_json("ctl", "models")]
            assert models_after == models_before
            served = load.ok
            system.cli("start")
            started = True
            # the start reaches each web process a moment after the command returns (the next request looks again,
            # gateway.runtime.may_look_again): from the first request served on, nothing may fail
            wait_for(lambda: load.ok > served, 30, interval=0.05, what="the first request served after the start")
            load.expect_stopped = False
            served = load.ok
            system.wait_ready("op-stop", 2)
            wait_for(lambda: load.ok > served + 4, 60, what="served again")
    finally:
        if not started:  # the tests after this one share the system: never leave it stopped
            system.cli("start", check=False)
    print(f"\nstop: 503 system_stopped {stopped_in:.2f}s after the command returned; {load.ok} served, "
          f"{len(load.failed)} failed")
    assert stopped_in < 1.0
    assert not load.failed, load.failed[:5]
    remove_model(system, "op-stop")


def test_profile_edit_shows_stale_and_restart_stale_makes_current(system, ops):
    system.cli("ctl", "profile", "add", "op-prof", "--context-size", "2048", "--parallel", "2")
    add_model(system, "op-stale", "--profile", "op-prof")
    (old,) = system.wait_ready("op-stale", 1)
    assert not old["stale"]
    system.cli("ctl", "profile", "set", "op-prof", "--context-size", "4096")
    wait_for(lambda: system.replicas("op-stale")[0]["stale"] == "profile edited", 10, what="stale")
    assert "(stale: profile edited)" in system.cli("ctl", "replicas", "--model", "op-stale").stdout
    assert "1 replica(s) queued" in system.cli("ctl", "restart", "--stale").stdout
    seen = watch_handover(system, "op-stale", {old["name"]}, 1)
    (new,) = [r for n, r in seen["reps"].items() if r["state"] == "ready"]
    assert not new["stale"]
    remove_model(system, "op-stale")
    system.cli("ctl", "profile", "remove", "op-prof")


def test_a_worker_killed_mid_drain_leaves_nothing_stuck(system, ops) -> None:
    """A replica draining with a long request in flight; the Celery worker is killed with SIGKILL and a new one
    started: the drain still finishes (every step is decided afresh from the database)."""
    add_test_engine(system, name="op-slow", args="--load-seconds 1 --delay-ms 500")
    system.cli("ctl", "model", "add", "op-slowdrain", "--file", system.sha, "--engine", "op-slow", "--memory", "300MiB")
    (old,) = system.wait_ready("op-slowdrain", 1)
    client = openai.OpenAI(base_url=system.url + "/v1", api_key=ops, max_retries=0, timeout=120)
    answers: list[str] = []
    first = threading.Event()

    def stream():
        text = ""
        for c in client.chat.completions.create(model="op-slowdrain", messages=HELLO, stream=True):
            if c.choices:
                text += c.choices[0].delta.content or ""
                first.set()
        answers.append(text)

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first.wait(30), "the stream began"  # a request in flight on the replica the restart drains
    system.cli("ctl", "restart", old["name"])
    wait_for(lambda: replicas_by_name(system, "op-slowdrain")[old["name"]]["state"] == "draining", 60, what="draining")
    worker = system.procs.pop("worker")
    worker.stop(signal.SIGKILL, 5)
    system.spawn("worker", [sys.executable, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "1",
                            "--without-gossip", "--without-mingle", "-n", f"it2-{system.port}@%h"])
    seen = watch_handover(system, "op-slowdrain", {old["name"]}, 1)
    streaming.join(120)
    assert answers and answers[0], "the request in flight during the drain finished"
    assert seen["reps"][old["name"]]["state"] == "stopped"
    remove_model(system, "op-slowdrain")


def test_system_restart_behind_a_proxy_loses_no_request_and_restarts_no_engine(system, ops):
    """Two web processes behind Debian's nginx, configured as docs/gateway.md tells operators to, and web, worker and
    beat supervised as systemd's `Restart=always` would: `llmgw restart` restarts every agent, then each
    control-plane process one at a time. No client request fails and no engine restarts. Last in this module:
    every control-plane process is new afterwards."""
    add_model(system, "op-sys", replicas=2)
    before = system.wait_ready("op-sys", 2)
    url2 = start_web(system, "web2")
    proxy_url, proxy = start_nginx(system, [system.url, url2])
    system.supervise("web", "web2", "worker", "beat")
    registry = redis.Redis.from_url(system.env["REDIS_URL"])
    # only the live ones: a process killed by an earlier test drops out of the registry within 10 s
    wait_for(lambda: sorted(p.role for p in control.processes(registry)) == ["beat", "web", "web", "worker"], 30,
             what=f"exactly two web processes, a worker and beat registered: {control.processes(registry)}")
    load = Load(system, ops, "op-sys", url=proxy_url)
    with load.running():
        started = time.monotonic()
        said = system.cli("restart", "--timeout", "90").stdout
        took = time.monotonic() - started
        served = load.ok
        wait_for(lambda: load.ok >= served + 6, 60, what="requests after the restart")
    errors = (system.home / "nginx" / "error.log").read_text(errors="replace")
    retries = errors.count("while connecting to upstream") + errors.count("while reading response header")
    print(f"\nsystem restart behind nginx: {load.ok} served, {len(load.failed)} failed, {took:.1f}s in all; "
          f"nginx retried {retries} request(s) refused or closed before an answer\n{said}")
    assert not load.failed, load.failed[:5]
    for node in system.agents:
        assert f"agent {node}: back after" in said, said
    assert len(re.findall(r"web web@\S+: back as web@", said)) == 2, said
    for role in ("beat", "worker"):
        assert re.search(rf"{role} {role}@\S+: back as {role}@", said), said
    after = system.wait_ready("op-sys", 2)
    assert {(r["name"], r["pid"]) for r in after} == {(r["name"], r["pid"]) for r in before}
    remove_model(system, "op-sys")


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
