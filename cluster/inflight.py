"""Requests in flight per replica, as the web processes' gateways count them in Redis; read by the reconciler,
whose drains wait for a replica to go idle.

Each web process keeps its own counts in one hash, `PREFIX + <host>:<pid>:<random>` ({replica name: n}), which
expires TTL seconds after the process last refreshed it: a process that dies takes its counts with it. The
gateway (gateway.runtime) writes them; this module names the keys and adds them up.
"""

from __future__ import annotations

from collections import Counter

PREFIX = "llmgw:inflight:"
TTL = 15  # seconds a dead process's counts outlive it


def totals(client, exclude: str | None = None) -> dict[str, int]:
    """Requests in flight per replica across every live web process (the hash named `exclude` left out)."""
    counts: Counter[str] = Counter()
    for key in client.scan_iter(match=PREFIX + "*", count=100):
        if exclude is not None and key.decode() == exclude:
            continue
        for replica, n in client.hgetall(key).items():
            counts[replica.decode()] += int(n)
    return dict(counts)


# Requests waiting for a replica, and each model's last request: what the autoscaler scales by.
# Each web process keeps the requests waiting in it in its own hash, `WAITING_PREFIX + <its id>`
# ({model: "<n> <epoch of the oldest>"}), which expires as its in-flight hash does; every process sets the time of
# the last request it saw for a model in one hash, LAST_REQUEST ({model: epoch}).
WAITING_PREFIX = "llmgw:waiting:"
LAST_REQUEST = "llmgw:models:last_request"


def waiting(client) -> dict[str, tuple[int, float]]:
    """Requests waiting for a replica per model across every live web process: (how many, since when the oldest)."""
    found: dict[str, tuple[int, float]] = {}
    for key in client.scan_iter(match=WAITING_PREFIX + "*", count=100):
        for model, value in client.hgetall(key).items():
            try:
                n, since = value.decode().split()
                n, since = int(n), float(since)
            except ValueError:
                continue
            if n <= 0:
                continue
            name = model.decode()
            had = found.get(name)
            found[name] = (n, since) if had is None else (had[0] + n, min(had[1], since))
    return found


def last_requests(client) -> dict[str, float]:
    """When each model was last asked for, by any web process."""
    out = {}
    for model, value in client.hgetall(LAST_REQUEST).items():
        try:
            out[model.decode()] = float(value)
        except ValueError:
            continue
    return out


# Admission's queues (gateway/admission.py and gateway/lua/admission.lua write them): per model, under
# `ADMISSION_PREFIX + <model>:`, its waiting tickets by class (`c0`, `c1`, `c2`: ticket -> when enqueued, ms on
# Redis's clock) and when each lapses unless its web process keeps it alive (`exp`: ticket -> ms).
ADMISSION_PREFIX = "llmgw:adm:"


def queue_keys(model: str) -> tuple[list[str], str]:
    """A model's tickets by class (ticket -> when enqueued), and when each lapses (ticket -> when)."""
    prefix = f"{ADMISSION_PREFIX}{model}:"
    return [f"{prefix}c{rank}" for rank in range(3)], f"{prefix}exp"


def queued(client, models) -> dict[str, tuple[int, float | None]]:
    """Requests waiting for a slot of each model, and since when (epoch seconds) the oldest has waited; a ticket
    that lapsed (its process gone, not yet cleared by the next admission call) is not counted. On Redis's clock,
    as admission keeps its tickets."""
    names = list(models)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for name in names:
        for key in queue_keys(name)[0]:
            pipe.zrange(key, 0, OLDEST_LOOKED_AT - 1, withscores=True)
    replies = pipe.execute()
    seconds, micro = replies[0]
    now_ms = seconds * 1000 + micro // 1000
    firsts = [sorted((enqueued, ticket) for reply in replies[1 + i * 3: 4 + i * 3] for ticket, enqueued in reply)
              for i in range(len(names))]
    pipe = client.pipeline(transaction=False)
    for name, first in zip(names, firsts):
        pipe.zcount(queue_keys(name)[1], now_ms, "+inf")
        pipe.zmscore(queue_keys(name)[1], [ticket for _, ticket in first] or ["-"])
    replies = pipe.execute()
    found = {}
    for i, name in enumerate(names):
        n, lapses = int(replies[2 * i]), replies[2 * i + 1]
        oldest = next((enqueued for (enqueued, _), lapse in zip(firsts[i], lapses) if lapse and lapse > now_ms),
                      None)
        found[name] = (n, oldest / 1000 if n and oldest is not None else None)
    return found


OLDEST_LOOKED_AT = 16  # of each class's first tickets, for the oldest still alive
