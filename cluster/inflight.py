"""Requests in flight per replica, as the web processes' gateways count them in Redis; read by the reconciler,
whose drains wait for a replica to go idle.

Each web process keeps its own counts in one hash, `PREFIX + <host>:<pid>:<random>` ({replica name: n}), which
expires TTL seconds after the process last refreshed it: a process that dies takes its counts with it. The
gateway (gateway.runtime) writes them; this module names the keys and adds them up.
"""

from __future__ import annotations

import time
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


# Admission's queues (gateway.admission writes them): per model a sorted set of waiting tickets and a hash of their
# fields (`rank|key|cost|expires ms|enqueued ms|process|prefs`), and per replica a sorted set of the slots held.
ADMISSION_PREFIX = "llmgw:adm:"


def queue_keys(model: str) -> tuple[str, str]:
    """A model's queue (ticket -> arrival) and its tickets (ticket -> fields)."""
    return f"{ADMISSION_PREFIX}{model}:queue", f"{ADMISSION_PREFIX}{model}:tickets"


def queued(client, models) -> dict[str, tuple[int, float | None]]:
    """Requests waiting for a slot of each model, and since when (epoch seconds) the oldest has waited; a ticket
    that lapsed (its process gone) is not counted."""
    now_ms = time.time() * 1000
    pipe = client.pipeline(transaction=False)
    names = list(models)
    for name in names:
        pipe.hvals(queue_keys(name)[1])
    found = {}
    for name, values in zip(names, pipe.execute()):
        n, oldest = 0, None
        for value in values:
            fields = value.decode().split("|")
            try:
                expires, enqueued = float(fields[3]), float(fields[4]) / 1000
            except (IndexError, ValueError):
                continue
            if expires < now_ms:
                continue
            n += 1
            oldest = enqueued if oldest is None else min(oldest, enqueued)
        found[name] = (n, oldest)
    return found
