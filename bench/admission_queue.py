#!/usr/bin/env python
"""Admission's cost per call against the length of its queue: nothing grantable, a queue of 0 to 10,000 waiting.

    . .venv/bin/activate
    python bench/admission_queue.py                       # queues of 0, 1000, 10000 (about a minute)
    python bench/admission_queue.py --queues 0,100000 --keys 50

One embedded Valkey (or REDIS_URL), one model of one replica whose `--slots` slots are all held, and a queue of
N tickets from `--keys` keys (one flooding key holding most, as a flood looks) made through admission's own script
(gateway/lua/admission.lua). Then, `--calls` times each, against that queue:

- **wait**: a new request finds no free slot and takes its ticket (then gives it up, in the next call);
- **look**: a waiter looks again (a dispatch with nothing free);
- **hand-off**: a slot given back and granted to the queue's next (the key with the least service, then first
  come) in the same call (with fewer than `--calls` waiting, that many are added for it).

Each cell is Valkey's own time per script call (`INFO commandstats`, the script's share of Redis) and the time a
caller waits for it (the round trip from Python), median and p99, and the ratio of each median to the empty
queue's, side by side in the same run. The issue 35 target: no call costs more as the queue grows, while nothing
can be granted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings_test")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * 0.99 + 0.5) - 1)]


async def measure(url: str, queue: int, keys: int, slots: int, calls: int) -> dict[str, tuple[list[float], float]]:
    import redis.asyncio as aioredis

    from gateway import admission, scripts
    from gateway.admission import RS, US, Admission

    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    a = Admission(client)
    model = "bench"
    replicas = [("bench-r0", slots)]
    a._replicas[model] = lambda: replicas
    a._limits[model] = queue + calls + 10
    held = [await a.admit(model, lambda: replicas, key="holder", rank=1, cost=10, prefs=[], queue_limit=10**7,
                          max_wait=5) for _ in range(slots)]
    script = scripts.register(client, "admission")
    prefix = admission.model_prefix(model)

    async def run(news: str = "", releases: str = "", cancels: str = "", look: str = "") -> None:
        await script(keys=[admission.SERVICE], args=[
            prefix, a._settings_for(model), a.process, RS.join(f"{n}{US}{c}" for n, c in replicas), releases, "",
            "", cancels, "", news, look, ""])

    # the queue: N tickets (one key most of them), sent a thousand a call
    made = 0
    while made < queue:
        batch = []
        for i in range(made, min(queue, made + 1000)):
            key = "flood" if i % 10 else f"key-{i % keys}"
            batch.append(f"{a.process}:q{i}{US}1|{key}|10||0|")
        await run(news=RS.join(batch))
        made += len(batch)
    assert int(sum([await client.zcard(prefix + f"c{r}") for r in range(3)])) == queue

    out: dict[str, tuple[list[float], float]] = {}

    async def timed(name: str, one) -> None:
        await client.config_resetstat()
        waits = []
        for i in range(calls):
            began = time.perf_counter()
            await one(i)
            waits.append((time.perf_counter() - began) * 1e6)
        stats = await client.info("commandstats")
        script_stats = stats.get("cmdstat_evalsha", {})
        out[name] = (waits, float(script_stats.get("usec_per_call", 0.0)))

    async def wait_one(i: int) -> None:
        await run(news=f"{a.process}:w{i}{US}1|quiet-{i}|10||0|")

    async def look_one(i: int) -> None:
        await run(look="1")

    grants = f"llmgw:adm:grants:{a.process}"
    last = [f"{held[0].replica}{US}{held[0].member}"]

    async def hand_off(i: int) -> None:  # the slot last granted given back: granted to the queue's next at once
        await run(releases=f"{last[0]}{US}0")
        (ticket, value), = (await client.hgetall(grants)).items()
        await client.hdel(grants, ticket)
        assert isinstance(value, bytes)  # the client does not decode: its answers are bytes
        last[0] = value.decode()

    await client.delete(grants)
    await timed("wait", wait_one)
    await timed("look", look_one)
    await run(cancels=RS.join(f"{a.process}:w{i}" for i in range(calls)))  # the waits' tickets given up
    if queue < calls:  # the hand-offs need as many waiting
        await run(news=RS.join(f"{a.process}:h{i}{US}1|flood|10||0|" for i in range(calls)))
    await timed("hand-off", hand_off)
    await client.aclose()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", default="0,1000,10000")
    parser.add_argument("--keys", type=int, default=20, help="keys waiting besides the flood")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--calls", type=int, default=300)
    o = parser.parse_args(argv)
    import django

    django.setup()
    valkey = None
    url = os.environ.get("REDIS_URL")
    if not url:
        from llmgw.valkey import EmbeddedValkey

        valkey = EmbeddedValkey(Path(tempfile.mkdtemp(prefix="llmgw-bench-queue-")) / "valkey")
        url = valkey.start()
    try:
        queues = [int(q) for q in o.queues.split(",")]
        results = {q: asyncio.run(measure(url, q, o.keys, o.slots, o.calls)) for q in queues}
    finally:
        if valkey is not None:
            valkey.stop()
    base = results[queues[0]]
    print(f"\nbench/admission_queue.py: {o.slots} slots all held, {o.keys} keys and a flood waiting, {o.calls} calls "
          f"a cell; Redis: {'embedded Valkey' if valkey else url}")
    header = ["call", "waiting", "Redis us/call", "x empty", "wait p50 us", "x empty", "wait p99 us"]
    rows = []
    for name in ("wait", "look", "hand-off"):
        for q in queues:
            waits, redis_us = results[q][name]
            b_waits, b_redis = base[name]
            rows.append([name, f"{q:,}", f"{redis_us:.1f}", f"{redis_us / b_redis:.2f}" if b_redis else "-",
                         f"{statistics.median(waits):.0f}", f"{statistics.median(waits) / statistics.median(b_waits):.2f}",
                         f"{p99(waits):.0f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
