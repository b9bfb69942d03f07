#!/usr/bin/env python
"""Issue 35's "a request lost in a restart", on a real llmgw: restarts of a one-replica, one-slot model under
clients that send one short chat each, back to back.

    . .venv/bin/activate
    python bench/restart_loss.py                      # xllamacpp serving the SmolLM2 GGUF, 5 restarts
    python bench/restart_loss.py --engine fake --restarts 10   # bench/fake_upstream.py --slots 1: faster

A llmgw of its own (bench/instance.py: `llmgw up --no-demo`, its two web processes, the local agent), a profile of
`--parallel 1` (the replica has one slot; admission lets one request into it at a time) and room for a second copy
(the restart places the replacement beside the old replica, then drains the old one). Each request has
--timeout seconds (60: as the issue's check); one taking longer than --slow is printed as it waits, with what
admission holds in Redis for the model then (its queue, its tickets, each replica's slots) and the replicas the
database has. Exits 1 when a request failed or was slow.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import TypedDict

import httpx
import redis
from instance import ROOT, Instance, gguf_path

MESSAGES = [{"role": "user", "content": "Say hello in five words."}]
FAKE = ROOT / "bench" / "fake_upstream.py"


class Request(TypedDict, total=False):
    """One client's request: when it went; once answered (or not), how and after how long."""

    client: int
    sent: float
    status: int
    replica: str
    error: str
    seconds: float


class Run(Instance):
    done: list[Request]  # answered or failed
    outstanding: dict[int, Request]  # by id()
    dumped: set[int]  # the outstanding ones shown as slow

    def __init__(self, o):
        super().__init__("restart-loss", agent_memory=o.agent_memory)
        self.o = o
        self.cli("ctl", "settings", "--reconcile-interval", "1")
        self.cli("ctl", "profile", "add", "one", "--context-size", "512", "--parallel", "1", "--threads", "1")
        engine = "xllamacpp"
        if o.engine == "fake":
            engine = "fake1"
            self.cli("ctl", "engine", "add", engine, "--kind", "command", "--command",
                     f"{{python}} {FAKE} --host {{host}} --port {{port}} --key {{engine_key}} --slots {{parallel}} "
                     f"--step-ms {o.step_ms} --chunks 8")
        self.cli("ctl", "model", "add", o.model, "--file", str(gguf_path()), "--engine", engine, "--profile", "one",
                 "--memory", o.model_memory, "--max-tokens", "8", "--wait", "120")
        self.key = self.cli("ctl", "keys", "create", "restart-loss").stdout.split()[-1]
        self.redis = redis.Redis.from_url((self.home / "run" / "redis-url").read_text().strip())
        self.wait(lambda: len(self.ready(o.model)) == 1, 300, f"{o.model} to be ready")
        self.lock = threading.Lock()
        self.done = []
        self.outstanding = {}
        self.dumped = set()
        self.stop_clients = threading.Event()

    def client(self, n: int) -> None:
        http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=self.o.timeout)
        body = {"model": self.o.model, "messages": MESSAGES, "max_tokens": 8}
        while not self.stop_clients.is_set():
            request: Request = {"client": n, "sent": time.time()}
            with self.lock:
                self.outstanding[id(request)] = request
            try:
                response = http.post("/v1/chat/completions", json=body)
                request["status"] = response.status_code
                request["replica"] = response.headers.get("x-llmgw-replica", "-")
                if response.status_code != 200:
                    request["error"] = response.text[:300]
            except httpx.HTTPError as exc:
                request["status"], request["error"] = 0, f"{type(exc).__name__}: no answer within {self.o.timeout}s"
            request["seconds"] = time.time() - request["sent"]
            with self.lock:
                del self.outstanding[id(request)]
                self.done.append(request)
            if request["status"] != 200:
                say(f"client {n}: {request['status']} after {request['seconds']:.1f}s: {request.get('error')}")

    def watch(self) -> None:
        """A request outstanding longer than --slow: what admission and the database hold now."""
        while not self.stop_clients.is_set():
            time.sleep(1)
            now = time.time()
            with self.lock:
                slow = [r for r in self.outstanding.values() if now - r["sent"] > self.o.slow and id(r) not in self.dumped]
                self.dumped.update(id(r) for r in slow)
            for r in slow:
                say(f"client {r['client']}: no answer after {now - r['sent']:.0f}s (sent at {stamp(r['sent'])})")
                self.dump()

    def dump(self) -> None:
        if self.o.py_spy:  # where every web process is, as the request waits
            import psutil

            for proc in psutil.Process(self.up.pid).children(recursive=True):
                if "llmgw.web" in " ".join(proc.cmdline()):
                    stacks = subprocess.run([self.o.py_spy, "dump", "--pid", str(proc.pid)], capture_output=True,
                                            text=True).stdout
                    say(f"  web process {proc.pid}:\n{stacks}")
        r = self.redis
        for key in sorted(k.decode() for k in r.scan_iter(match="llmgw:adm:*", count=1000)):
            kind = r.type(key).decode()
            shown: object
            if kind == "zset":
                shown = [(m.decode(), s) for m, s in r.zrange(key, 0, -1, withscores=True)]
            elif kind == "hash":
                shown = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
            elif kind == "set":
                shown = sorted(m.decode() for m in r.smembers(key))
            else:
                shown = r.get(key).decode() if kind == "string" else kind
            say(f"  redis {key}: {shown}")
        for rep in self.replicas(self.o.model):
            say(f"  replica {rep['name']}: {rep['state']} (restart {rep['restart']})")

    def restart_once(self) -> float:
        old = set(self.ready(self.o.model))
        began = time.monotonic()
        self.cli("ctl", "restart", "--model", self.o.model)

        def replaced() -> bool:
            now = {rep["name"]: rep["state"] for rep in self.replicas(self.o.model)}
            return all(name not in now or now[name] in ("stopped", "failed") for name in old) and any(
                state == "ready" for name, state in now.items() if name not in old)

        self.wait(replaced, 300, "the restart's handover", interval=0.5)
        return time.monotonic() - began


def stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def say(text: str) -> None:
    print(f"{stamp(time.time())} {text}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("xllamacpp", "fake"), default="xllamacpp")
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a client waits for its answer")
    p.add_argument("--slow", type=float, default=20.0, help="seconds after which a request is shown as it waits")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load between one restart and the next")
    p.add_argument("--step-ms", type=int, default=100, help="the fake engine's milliseconds per token (8 tokens)")
    p.add_argument("--py-spy", metavar="BIN", help="with a slow request, dump the web processes' stacks with this")
    p.add_argument("--model", default="lost")
    p.add_argument("--model-memory", default="300MiB")
    p.add_argument("--agent-memory", default="2GiB", help="what the node offers: room for a second copy")
    o = p.parse_args()
    run = Run(o)
    say(f"llmgw up in {run.home} (its logs: {run.home / 'up.log'}, {run.home / 'log'})")
    threads = [threading.Thread(target=run.client, args=(n,), daemon=True) for n in range(o.clients)]
    threads.append(threading.Thread(target=run.watch, daemon=True))
    try:
        for t in threads:
            t.start()
        time.sleep(o.settle)
        for i in range(o.restarts):
            took = run.restart_once()
            say(f"restart {i + 1}: handed over in {took:.1f}s")
            time.sleep(o.settle)
        run.stop_clients.set()
        for t in threads:
            t.join(o.timeout + 5)
    finally:
        run.stop()
    failed = [r for r in run.done if r["status"] != 200]
    slow = [r for r in run.done if r["seconds"] > o.slow]
    seconds = sorted(r["seconds"] for r in run.done)
    print(json.dumps({"engine": o.engine, "restarts": o.restarts, "requests": len(run.done), "failed": len(failed),
                      f"over {o.slow:g}s": len(slow), "slowest_s": [round(s, 1) for s in seconds[-5:]],
                      "failures": [{k: r.get(k) for k in ("client", "status", "seconds", "error")} for r in failed]},
                     indent=1))
    return 1 if failed or slow else 0


if __name__ == "__main__":
    sys.exit(main())
