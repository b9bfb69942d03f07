"""What the gateway counts as it serves, never with a database write per request: usage and last use, and the
traffic per minute.

- Usage per key, model and hour, and each key's last use, gather in this process and go to the database once a
  second (gateway/runtime.py, gateway/usage.py): a Redis restart loses none of it.
- Traffic per minute, all keys and web processes together (requests, 5xx answers, tokens, and streamed
  requests' times to first chunk as counts per histogram bucket), for the dashboard's charts and its TTFT
  percentiles: gathered the same way into one Redis hash per minute (`llmgw:traffic:MINUTE`), kept for two
  hours.

The keys' rate limits are gateway/limits.py, their budgets gateway/spend.py.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import TypedDict

from redis import Redis as SyncRedis
from redis.asyncio import Redis

from gateway.metrics import BUCKETS

TRAFFIC = "llmgw:traffic:"  # + the minute (Unix time // 60): a hash of requests, errors, tokens
TRAFFIC_KEEP = 2 * 3600
FIRST_CHUNK_FIELD = "ttft:"  # + the bucket's index in BUCKETS (len(BUCKETS): above the last), in a traffic hash


# (hour, key id, model) -> [requests, prompt, completion tokens, resumed prompt tokens (the fleet's, not the key's)]
UsageRows = dict[tuple[int, int, str], list[int]]


class TrafficMinute(TypedDict):
    minute: int  # Unix time // 60
    requests: int
    errors: int  # 5xx answers
    tokens: int


def _minute(now: float) -> int:
    return int(now // 60)


class Ledger:
    """This process's usage and last-use since the last flush."""

    def __init__(self) -> None:
        self.usage: UsageRows = defaultdict(lambda: [0, 0, 0, 0])
        self.last_used: dict[int, float] = {}
        self.traffic: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.first_chunks: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # minute -> bucket -> n

    def count(self, status: int, tokens: int, now: float | None = None, first_chunk: float | None = None) -> None:
        """One answered request in this minute's traffic; a 5xx answer counts as an error, and a stream's time
        to its first chunk goes into its bucket."""
        minute = _minute(now or time.time())
        row = self.traffic[minute]
        row[0] += 1
        row[1] += status >= 500
        row[2] += tokens
        if first_chunk is not None:
            self.first_chunks[minute][bisect.bisect_left(BUCKETS, first_chunk)] += 1

    def add(self, key_id: int, model: str, prompt: int, completion: int, now: float | None = None,
            resumed: int = 0) -> None:
        """One request's usage: its prompt and completion tokens (the key's), and `resumed`, the prompt tokens
        its resumes on other replicas cost the fleet (not the key's: no budget or limit counts them)."""
        now = now or time.time()
        row = self.usage[(int(now // 3600) * 3600, key_id, model)]
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        row[3] += resumed
        self.last_used[key_id] = now

    def take_usage(self) -> tuple[UsageRows, dict[int, float]]:
        """The usage and last use counted since the last take, for the database (gateway/usage.py)."""
        usage, self.usage = dict(self.usage), defaultdict(lambda: [0, 0, 0, 0])
        last_used, self.last_used = self.last_used, {}
        return usage, last_used

    def keep_usage(self, usage: UsageRows, last_used: dict[int, float]) -> None:
        """A write that failed: what it took waits for the next one, with what came since."""
        self._keep(usage, last_used)

    async def flush_traffic(self, redis: Redis) -> None:
        if not self.traffic and not self.first_chunks:
            return
        traffic, self.traffic = self.traffic, defaultdict(lambda: [0, 0, 0])
        first_chunks, self.first_chunks = self.first_chunks, defaultdict(lambda: defaultdict(int))
        try:
            # MULTI/EXEC: all of it arrives or none, so what a failed flush keeps for the next is not counted twice
            async with redis.pipeline(transaction=True) as pipe:
                for minute, (requests, errors, tokens) in traffic.items():
                    pipe.hincrby(TRAFFIC + str(minute), "requests", requests)
                    pipe.hincrby(TRAFFIC + str(minute), "errors", errors)
                    pipe.hincrby(TRAFFIC + str(minute), "tokens", tokens)
                    pipe.expire(TRAFFIC + str(minute), TRAFFIC_KEEP)
                for minute, buckets in first_chunks.items():
                    for bucket, n in buckets.items():
                        pipe.hincrby(TRAFFIC + str(minute), f"{FIRST_CHUNK_FIELD}{bucket}", n)
                await pipe.execute()
        except BaseException:  # Redis away: kept for the next flush instead of lost
            self._keep({}, {}, traffic, first_chunks)
            raise

    def _keep(self, usage: UsageRows, last_used: dict[int, float], traffic: dict[int, list[int]] | None = None,
              first_chunks: dict[int, dict[int, int]] | None = None) -> None:
        for minute, buckets in (first_chunks or {}).items():
            for bucket, n in buckets.items():
                self.first_chunks[minute][bucket] += n
        for minute, counts in (traffic or {}).items():
            row = self.traffic[minute]
            for i, n in enumerate(counts):
                row[i] += n
        for where, counts in usage.items():
            row = self.usage[where]
            for i, n in enumerate(counts):
                row[i] += n
        for key_id, when in last_used.items():
            self.last_used[key_id] = max(when, self.last_used.get(key_id, 0.0))


def traffic(redis: SyncRedis, minutes: int = 60, now: float | None = None) -> list[TrafficMinute]:
    """The last `minutes` whole minutes of traffic, oldest first, from a synchronous Redis client:
    [{"minute": Unix minute, "requests": n, "errors": n, "tokens": n}, ...] (zeros where nothing came)."""
    last = _minute(now or time.time()) - 1  # the current minute is not over yet
    wanted = list(range(last - minutes + 1, last + 1))
    with redis.pipeline(transaction=False) as pipe:
        for minute in wanted:
            pipe.hgetall(TRAFFIC + str(minute))
        rows = pipe.execute()
    out: list[TrafficMinute] = []
    for minute, row in zip(wanted, rows):
        values = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in (row or {}).items()}
        out.append({"minute": minute, "requests": values.get("requests", 0), "errors": values.get("errors", 0),
                    "tokens": values.get("tokens", 0)})
    return out


def first_chunk_percentiles(redis: SyncRedis, quantiles: tuple[float, ...] = (0.5, 0.95), minutes: int = 60,
                            now: float | None = None) -> dict[str | float, float | None]:
    """Streamed requests' time to first chunk over the last `minutes` whole minutes, every web process together:
    {"count": n, 0.5: seconds, 0.95: seconds} (None where nothing streamed), each quantile read off the buckets as
    Prometheus' histogram_quantile does: linear within the bucket it falls in."""
    last = _minute(now or time.time()) - 1
    with redis.pipeline(transaction=False) as pipe:
        for minute in range(last - minutes + 1, last + 1):
            pipe.hgetall(TRAFFIC + str(minute))
        rows = pipe.execute()
    counts = [0] * (len(BUCKETS) + 1)
    for row in rows:
        for field, n in (row or {}).items():
            field = field.decode() if isinstance(field, bytes) else field
            if field.startswith(FIRST_CHUNK_FIELD):
                index = int(field[len(FIRST_CHUNK_FIELD):])
                if 0 <= index < len(counts):
                    counts[index] += int(n)
    total = sum(counts)
    out: dict[str | float, float | None] = {"count": total}
    for q in quantiles:
        out[q] = _quantile(counts, total, q) if total else None
    return out


def _quantile(counts: list[int], total: int, q: float) -> float:
    rank, seen = q * total, 0
    for index, n in enumerate(counts):
        if n and seen + n >= rank:
            if index == len(BUCKETS):  # above the last bound: that bound is all that can be said
                return BUCKETS[-1]
            low = BUCKETS[index - 1] if index else 0.0
            return low + (BUCKETS[index] - low) * (rank - seen) / n
        seen += n
    return BUCKETS[-1]
