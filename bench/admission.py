#!/usr/bin/env python
"""Admission at a GPU's pace: a fake engine of many slots, straight and through llmgw with admission on and off.

    . .venv/bin/activate
    python bench/admission.py                                   # c=1,16,64,256 on 64 slots, 20 s a cell (~5 min)
    python bench/admission.py --concurrency 64 --seconds 30 --rounds 3

The engine is bench/fake_upstream.py with `--slots 64` (as a `command` engine's `--slots {parallel}` would
start it): 64 requests generate together, one more waits inside the engine for a slot; every `--step-ms` (10)
each generating slot gets its next token, a prompt takes one step, and every answer streams `--tokens` (128)
tokens: about 1.3 s an answer, a slot freed every 20 ms at 64 streams — a small model on a datacenter GPU. It is
reached

- **direct**: the baseline of every figure;
- **llmgw**: a real llmgw web process (uvicorn, as `llmgw up` runs it; SQLite, the embedded Valkey or REDIS_URL,
  the rows set up as bench/gateway.py sets them, the model's profile `parallel` = the engine's slots), admission
  on: at most 64 requests in the engine, the rest wait in llmgw's queue;
- **llmgw-noadm**: the same with `LLMGW_ADMISSION=0`: every request goes straight on to the engine.

Closed-loop clients (`--concurrency`, each sending its next streamed chat completion the moment its last one ends,
on a keep-alive connection) run `--seconds` per cell after a warm-up of one answer each; every target runs each
cell in turn, `--rounds` times, and the table keeps each cell's round with the most tokens a second. With two or
more CPUs the web process has the last CPU to itself and the engine, the clients and Valkey the others.

Columns: tokens/s (content tokens of the answers that ended in the cell's seconds, a second) and its ratio to direct; TTFT
(time to the first byte of the answer's body: the role chunk comes with the first token) p50 and p99, and what
llmgw adds to direct's (+p50, +p99: target minus direct, same concurrency, same run); the whole answer's p50;
the web process's CPU ms per answer; answers and errors. Below the table, issue 35's targets: at 64 streams on
64 slots, admission on adds at most 10 ms to TTFT p50 and 25 ms to p99; at 1 stream at most 5 ms to p99.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadgen import ClientConnection, answer_ok, build_request  # noqa: E402
from report import fmt  # noqa: E402
from targets import cpu_seconds, say, setup_llmgw, strays, wait_ready  # noqa: E402

from ground.ports import free_port  # noqa: E402
from llmgw.processes import Child  # noqa: E402

FAKE = ROOT / "bench" / "fake_upstream.py"
TARGETS = ("direct", "llmgw", "llmgw-noadm")
TARGET_P50_MS, TARGET_P99_MS, TARGET_ONE_P99_MS = 10.0, 25.0, 5.0  # issue 35


@dataclass
class Cell:
    target: str
    concurrency: int
    seconds: float = 0.0
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    cpu: float = 0.0

    def tokens_per_s(self, tokens: int) -> float:
        return self.ok * tokens / self.seconds if self.seconds else 0.0

    @staticmethod
    def p(samples: list[float], q: float) -> float:
        if not samples:
            return math.nan
        ordered = sorted(samples)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000


async def run_cell(cell: Cell, port: int, request: bytes, seconds: float, cpu) -> None:
    """Closed loop: `cell.concurrency` clients, each sending its next request when its last one ends; one answer
    each to warm up, then `seconds` counted (an answer counts when it ends inside them)."""
    loop = asyncio.get_running_loop()

    async def client(measure_from: list[float]) -> None:
        _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", port)
        try:
            warm = True
            while True:
                start = time.perf_counter()
                try:
                    status, first, end, body, close = await conn.request(request)
                except (OSError, ConnectionError) as exc:
                    cell.errors += 1
                    cell.first_error = cell.first_error or f"{type(exc).__name__}: {exc}"
                    conn.transport.close()
                    await asyncio.sleep(0.05)
                    _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", port)
                    continue
                if close:
                    conn.transport.close()
                    _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", port)
                if warm:  # the first answer of each client warms up
                    warm = False
                    continue
                if end < measure_from[0]:  # ended in the warm-up
                    continue
                why = answer_ok(status, body, True, "chat")
                if why:
                    cell.errors += 1
                    cell.first_error = cell.first_error or why
                    continue
                cell.ok += 1
                cell.ttft.append(first - start)
                cell.total.append(end - start)
        finally:
            conn.transport.close()

    gc.collect()
    gc.disable()
    try:
        measure_from = [math.inf]
        tasks = [loop.create_task(client(measure_from)) for _ in range(cell.concurrency)]
        # the warm-up: long enough for every client's first answer (at most 4 waves of the engine's slots)
        await asyncio.sleep(min(30.0, 2.0 + 1.5 * max(1, cell.concurrency // 64)))
        cpu0 = cpu()
        measure_from[0] = time.perf_counter()
        await asyncio.sleep(seconds)
        cell.cpu = cpu() - cpu0
        cell.seconds = seconds
        for t in tasks:  # what is under way is not counted
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gc.enable()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--slots", type=int, default=64, help="the engine's slots (the model's profile `parallel`)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the engine's milliseconds per step (a token)")
    parser.add_argument("--prefill-steps", type=int, default=1, help="steps a prompt takes")
    parser.add_argument("--seconds", type=float, default=20.0, help="counted seconds per cell")
    parser.add_argument("--rounds", type=int, default=1, help="each cell this many times; the table keeps the best")
    parser.add_argument("--headroom", type=float, default=0.0,
                        help="LLMGW_ADMISSION_HEADROOM for llmgw: this fraction more than the slots in the engine")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the web process to its own CPU")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    o = parser.parse_args(argv)
    targets = [t.strip() for t in o.targets.split(",") if t.strip()]
    if set(targets) - set(TARGETS):
        parser.error(f"--targets takes {', '.join(TARGETS)}")
    targets = [t for t in TARGETS if t in targets or t == "direct"]
    concurrencies = [int(c) for c in o.concurrency.split(",") if c.strip()]

    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = None
    if not o.no_pin and len(cpus) >= 2:
        proxy_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-admission-"))
    children: dict[str, Child] = {}
    valkey = None
    cells: dict[tuple[str, int], list[Cell]] = {}
    running: list[tuple[str, int, str]] = []
    interrupted = False
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    load_before = os.getloadavg()
    started = time.monotonic()

    def start(name, argv_, env=None, proxy=False) -> Child:
        child = Child(name, argv_, workdir / "logs" / f"{name}.log", env, cwd=ROOT,
                      cpus=proxy_cpus if proxy else None)
        children[name] = child.start()
        return child

    try:
        upstream_port = free_port()
        home = workdir / "llmgw-home"
        home.mkdir()
        env = dict(os.environ, LLMGW_HOME=str(home), DATABASE_URL=f"sqlite:///{home / 'db.sqlite3'}",
                   PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="llmgw.settings")
        env.pop("LLMGW_DEBUG", None)
        if not os.environ.get("REDIS_URL"):
            from llmgw.valkey import EmbeddedValkey

            valkey = EmbeddedValkey(workdir / "valkey")
            env["REDIS_URL"] = valkey.start()
        say(f"setting up llmgw: a model of {o.slots} slots on the fake engine")
        engine_key, client_key = setup_llmgw(home, env, upstream_port, parallel=o.slots)
        fake = start("fake-engine", [sys.executable, str(FAKE), "--port", str(upstream_port), "--key", engine_key,
                                     "--chunks", str(o.tokens), "--slots", str(o.slots), "--step-ms",
                                     str(o.step_ms), "--prefill-steps", str(o.prefill_steps)])
        wait_ready(fake, upstream_port, engine_key, 15)
        running.append(("direct", upstream_port, engine_key))
        from llmgw.web import web_argv

        for target in targets[1:]:
            port = free_port()
            own = dict(env, LLMGW_ADMISSION="0" if target == "llmgw-noadm" else "1",
                       LLMGW_ADMISSION_HEADROOM=str(o.headroom))
            child = start(target, web_argv("127.0.0.1", port, "uvicorn"), own, proxy=True)
            wait_ready(child, port, client_key, 60)
            running.append((target, port, client_key))

        for conc in concurrencies:
            for round_ in range(o.rounds):
                for target, port, key in running:
                    cell = Cell(target, conc)
                    cells.setdefault((target, conc), []).append(cell)
                    pid = children["fake-engine" if target == "direct" else target].pid
                    asyncio.run(run_cell(cell, port, build_request(port, key, True, "chat"), o.seconds,
                                         lambda pid=pid: cpu_seconds(pid)))
                    say(f"{target:12s} c={conc:<4d} round {round_ + 1}: {cell.tokens_per_s(o.tokens):8.0f} tok/s  "
                        f"TTFT p50 {fmt(cell.p(cell.ttft, 0.5))} ms p99 {fmt(cell.p(cell.ttft, 0.99))} ms  "
                        f"ok {cell.ok} err {cell.errors}")
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping what this run started")
    finally:
        for child in list(children.values())[::-1]:
            child.stop(timeout=10)
        if valkey is not None:
            valkey.stop()
        load_after = os.getloadavg()
        left = strays()
        if o.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if not cells:
        print("no cell was measured", file=sys.stderr)
        return 1
    best = {k: max(v, key=lambda c: c.tokens_per_s(o.tokens)) for k, v in cells.items()}
    print(f"\nbench/admission.py on {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.monotonic() - started:.0f} s, load average {load_before[0]:.2f} before / {load_after[0]:.2f} after")
    print(f"  engine: {o.slots} slots, {o.step_ms:g} ms a step, {o.prefill_steps} step(s) of prefill, {o.tokens} "
          f"tokens an answer; {o.seconds:g} s a cell, best of {o.rounds} round(s); headroom {o.headroom:g}; "
          f"web process pinned: "
          f"{'CPU ' + str(sorted(proxy_cpus)[0]) if proxy_cpus else 'no'}")
    header = ["conc", "target", "tokens/s", "x direct", "TTFT p50", "+p50", "TTFT p99", "+p99", "answer p50",
              "cpu ms/answer", "ok", "err"]
    rows: list[list[str] | None] = []  # None: a blank line between concurrencies
    for conc in concurrencies:
        d = best.get(("direct", conc))
        for target, _, _ in running:
            c = best.get((target, conc))
            if c is None:
                continue
            p50, p99 = c.p(c.ttft, 0.5), c.p(c.ttft, 0.99)
            rows.append([str(conc), target, fmt(c.tokens_per_s(o.tokens), 0),
                         fmt(c.tokens_per_s(o.tokens) / d.tokens_per_s(o.tokens)) if d and d.ok else "-",
                         fmt(p50, 1), fmt(p50 - d.p(d.ttft, 0.5), 1) if d and c is not d else "-",
                         fmt(p99, 1), fmt(p99 - d.p(d.ttft, 0.99), 1) if d and c is not d else "-",
                         fmt(c.p(c.total, 0.5), 0), fmt(c.cpu / c.ok * 1000 if c.ok else math.nan, 3),
                         str(c.ok), str(c.errors)])
        rows.append(None)
    widths = [max(len(h), *(len(r[i]) for r in rows if r)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows[:-1]:
        print("" if r is None else "  ".join(v.rjust(w) for v, w in zip(r, widths)))
    print("\nissue 35's targets (admission on, against direct):")
    for conc, what, q, goal in ((64, "p50", 0.5, TARGET_P50_MS), (64, "p99", 0.99, TARGET_P99_MS),
                                (1, "p99", 0.99, TARGET_ONE_P99_MS)):
        c, d = best.get(("llmgw", conc)), best.get(("direct", conc))
        if c and d and c.ok and d.ok:
            added = c.p(c.ttft, q) - d.p(d.ttft, q)
            print(f"  c={conc:<3d} TTFT {what} added {added:6.1f} ms  (at most {goal:g}): "
                  f"{'met' if added <= goal else 'NOT met'}")
    for c in (c for v in cells.values() for c in v):
        if c.errors:
            print(f"errors in {c.target} c={c.concurrency}: {c.errors}, first: {c.first_error[:300]}")
    print(f"\nchild processes left: {len(left)}" + (": " + "; ".join(left) if left else " (none)"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
