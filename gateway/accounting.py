"""Rate limits, usage and last use: counted in Redis, never a database write per request.

- Requests per minute: one INCR per request on a per-key, per-minute counter (keys with a limit only).
- Tokens per minute: the same counter for tokens. A request is refused while the key's tokens this minute are at
  or over its limit; one admitted reserves at once what it may use (its prompt as estimated and its max tokens),
  and the engine's count replaces the reservation when it ends (reserve, then settle), so concurrent requests
  cannot all slip under a limit none had reached yet.
- Usage per key, model and hour, and each key's last use, gather in this process and go to Redis every second;
  a Celery beat task moves them into the database.
- Traffic per minute, all keys and web processes together (requests, 5xx answers, tokens, and streamed
  requests' times to first chunk as counts per histogram bucket), for the dashboard's charts and its TTFT
  percentiles: gathered the same way into one Redis hash per minute (`llmgw:traffic:MINUTE`), kept for two
  hours.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

from gateway.errors import GatewayError
from gateway.metrics import BUCKETS

USAGE_HASH = "llmgw:usage"
LAST_USED_HASH = "llmgw:keys:last_used"
TRAFFIC = "llmgw:traffic:"  # + the minute (Unix time // 60): a hash of requests, errors, tokens
TRAFFIC_KEEP = 2 * 3600
FIRST_CHUNK_FIELD = "ttft:"  # + the bucket's index in BUCKETS (len(BUCKETS): above the last), in a traffic hash


def _minute(now: float) -> int:
    return int(now // 60)


# one request against a key's limits, atomically, whatever other requests and web processes do at the same time:
# count it against the requests this minute; then, when the key's tokens this minute (used and reserved) are still
# under its limit, reserve what the request may use. Returns {0, 0} (admitted), {1, requests} or {2, tokens}.
ADMIT = """
if tonumber(ARGV[1]) > 0 then
  local n = redis.call('INCR', KEYS[1])
  redis.call('EXPIRE', KEYS[1], 120)
  if n > tonumber(ARGV[1]) then return {1, n} end
end
if tonumber(ARGV[2]) > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= tonumber(ARGV[2]) then return {2, used} end
  if tonumber(ARGV[3]) > 0 then
    redis.call('INCRBY', KEYS[2], ARGV[3])
    redis.call('EXPIRE', KEYS[2], 120)
  end
end
return {0, 0}
"""


def _tokens_key(key_id: int, minute: int) -> str:
    return f"llmgw:rl:t:{key_id}:{minute}"


async def check_limits(redis, key, reserve: int = 0, now: float | None = None) -> int | None:
    """Admit a request under its key's rpm and tpm limits, or refuse it (429 with the seconds to the next minute).
    With a tpm limit, `reserve` tokens (what the request may use at most, as far as the gateway can tell) are
    counted at once, so that requests arriving together cannot all pass a limit none of them has reached yet;
    `settle_tokens` puts the difference right once the engine said what it used. Returns the minute the tokens
    were reserved in (None: no tpm limit)."""
    if not key.rpm and not key.tpm:
        return None
    now = now or time.time()
    minute = _minute(now)
    retry = 60 - int(now % 60)
    admit = redis.register_script(ADMIT)
    refused, _ = await admit(keys=[f"llmgw:rl:r:{key.id}:{minute}", _tokens_key(key.id, minute)],
                             args=[key.rpm or 0, key.tpm or 0, max(0, int(reserve))])
    if int(refused) == 1:
        raise GatewayError(429, "rate_limited", f"key {key.name} is limited to {key.rpm} requests per minute", retry)
    if int(refused) == 2:
        raise GatewayError(429, "rate_limited", f"key {key.name} is limited to {key.tpm} tokens per minute", retry)
    return minute if key.tpm else None


async def settle_tokens(redis, key, used: int, reserved: int = 0, minute: int | None = None) -> None:
    """Count the tokens a request used against its key's tpm limit, in place of what it reserved, in the minute it
    was admitted in (a reservation is never left standing: a request that failed used what it used, maybe 0)."""
    change = int(used) - int(reserved)
    if key.tpm and change:
        name = _tokens_key(key.id, minute if minute is not None else _minute(time.time()))
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incrby(name, change)
            pipe.expire(name, 120)
            await pipe.execute()


async def count_tokens(redis, key, tokens: int, now: float | None = None) -> None:
    """Tokens used with no reservation before them."""
    await settle_tokens(redis, key, tokens, 0, _minute(now or time.time()))


class Ledger:
    """This process's usage and last-use since the last flush."""

    def __init__(self):
        self.usage: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
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

    def add(self, key_id: int, model: str, prompt: int, completion: int, now: float | None = None) -> None:
        now = now or time.time()
        row = self.usage[(int(now // 3600) * 3600, key_id, model)]
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        self.last_used[key_id] = now

    async def flush(self, redis) -> None:
        if not self.usage and not self.last_used and not self.traffic:
            return
        usage, self.usage = self.usage, defaultdict(lambda: [0, 0, 0])
        last_used, self.last_used = self.last_used, {}
        traffic, self.traffic = self.traffic, defaultdict(lambda: [0, 0, 0])
        first_chunks, self.first_chunks = self.first_chunks, defaultdict(lambda: defaultdict(int))
        try:
            # MULTI/EXEC: all of it arrives or none, so what a failed flush keeps for the next is not counted twice
            async with redis.pipeline(transaction=True) as pipe:
                for (hour, key_id, model), (requests, prompt, completion) in usage.items():
                    base = f"{hour}|{key_id}|{model}"
                    pipe.hincrby(USAGE_HASH, base + "|requests", requests)
                    pipe.hincrby(USAGE_HASH, base + "|prompt", prompt)
                    pipe.hincrby(USAGE_HASH, base + "|completion", completion)
                if last_used:
                    pipe.hset(LAST_USED_HASH, mapping={str(k): v for k, v in last_used.items()})
                for minute, (requests, errors, tokens) in traffic.items():
                    pipe.hincrby(TRAFFIC + str(minute), "requests", requests)
                    pipe.hincrby(TRAFFIC + str(minute), "errors", errors)
                    pipe.hincrby(TRAFFIC + str(minute), "tokens", tokens)
                    pipe.expire(TRAFFIC + str(minute), TRAFFIC_KEEP)
                for minute, buckets in first_chunks.items():
                    for bucket, n in buckets.items():
                        pipe.hincrby(TRAFFIC + str(minute), f"{FIRST_CHUNK_FIELD}{bucket}", n)
                await pipe.execute()
        except BaseException:  # Redis away: keep the counts for the next flush instead of losing them
            self._keep(usage, last_used, traffic, first_chunks)
            raise

    def _keep(self, usage, last_used, traffic=None, first_chunks=None) -> None:
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


def traffic(redis, minutes: int = 60, now: float | None = None) -> list[dict]:
    """The last `minutes` whole minutes of traffic, oldest first, from a synchronous Redis client:
    [{"minute": Unix minute, "requests": n, "errors": n, "tokens": n}, ...] (zeros where nothing came)."""
    last = _minute(now or time.time()) - 1  # the current minute is not over yet
    wanted = list(range(last - minutes + 1, last + 1))
    with redis.pipeline(transaction=False) as pipe:
        for minute in wanted:
            pipe.hgetall(TRAFFIC + str(minute))
        rows = pipe.execute()
    out = []
    for minute, row in zip(wanted, rows):
        values = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in (row or {}).items()}
        out.append({"minute": minute, "requests": values.get("requests", 0), "errors": values.get("errors", 0),
                    "tokens": values.get("tokens", 0)})
    return out


def first_chunk_percentiles(redis, quantiles=(0.5, 0.95), minutes: int = 60, now: float | None = None) -> dict:
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
    out: dict = {"count": total}
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


# A key's token budget (gateway/budgets.py): a running count per key and period in Redis, used and reserved,
# seeded from the database's usage when Redis lacks it. A request is refused unless what it may use fits in what is
# left, and reserves that at once; it settles to what it used when it ends. Returns {-1} (no count: seed it),
# {0, count} (reserved) or {1, count} (refused).
BUDGET = """
local count = redis.call('GET', KEYS[1])
if not count then return {-1, 0} end
count = tonumber(count)
if count + tonumber(ARGV[2]) > tonumber(ARGV[1]) then return {1, count} end
redis.call('INCRBY', KEYS[1], ARGV[2])
return {0, count}
"""


def budget_key(key_id: int, period: str, start: int) -> str:
    return f"llmgw:budget:{key_id}:{period}:{start}"


async def reserve_budget(redis, key, reserve: int, seed, now=None) -> str | None:
    """Reserve `reserve` tokens of the key's budget for a request, or refuse it: 429 `budget_exceeded` naming the
    budget and when it resets. `seed(key_id, period, now)` is what the key spent this period as the database has
    it (awaitable), asked only when Redis has no count. Returns the count's name, to settle against (None: no
    budget)."""
    import datetime as dt

    from gateway import budgets

    if not key.budget_tokens or key.budget_period not in budgets.PERIODS:
        return None
    now = now or dt.datetime.now(dt.timezone.utc)
    start, end = budgets.period_start(key.budget_period, now), budgets.period_end(key.budget_period, now)
    name = budget_key(key.id, key.budget_period, int(start.timestamp()))
    script = redis.register_script(BUDGET)
    reserve = max(0, int(reserve))
    refused, count = await script(keys=[name], args=[key.budget_tokens, reserve])
    if int(refused) == -1:
        spent = await seed(key.id, key.budget_period, now)
        await redis.set(name, int(spent), nx=True, exat=int(end.timestamp()) + 86400)
        refused, count = await script(keys=[name], args=[key.budget_tokens, reserve])
    if int(refused) == 1:
        budget = f"{budgets.shown(key.budget_tokens)} tokens per {key.budget_period}"
        left = max(0, key.budget_tokens - int(count))
        retry = max(1, int((end - now).total_seconds()))
        why = (f"key {key.name} has used its budget of {budget}" if left <= 0 else
               f"key {key.name} has {left} tokens left of its budget of {budget}, and this request may use up to "
               f"{reserve} (ask for fewer max tokens)")
        refusal = GatewayError(429, "budget_exceeded", f"{why}; it resets at {end:%Y-%m-%d %H:%M} UTC", retry)
        refusal.exhausted_until = int(end.timestamp()) if left <= 0 else None  # for the Event, once a period
        raise refusal
    return name


async def settle_budget(redis, name: str, used: int, reserved: int) -> None:
    """The budget's count with what a request used in place of what it reserved."""
    change = int(used) - int(reserved)
    if change:
        await redis.incrby(name, change)
