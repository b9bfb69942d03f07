"""A key's rate limits: requests and tokens per minute, across every web process (gateway/lua/limits.lua).

- Requests per minute: one count per request in the minute's counter (keys with a limit only).
- Tokens per minute: the same for tokens. A request is refused while the key's tokens this minute are at or over
  its limit; one admitted reserves at once what it may use (its prompt as estimated and its max tokens), and the
  engine's count replaces the reservation when it ends (reserve, then settle), so concurrent requests cannot all
  slip under a limit none had reached yet.

The minute is Redis's (its TIME): web processes whose clocks disagree count in the same minute. With Redis away
(gateway/redis_reach.py), each web process counts the key's requests and tokens on its own, by its own clock, and
holds each key to its whole limit: a key can then be served up to its limit once per web process. A count Redis
lost (a restart) is not made good: the minute starts again.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from gateway import scripts
from gateway.errors import GatewayError
from gateway.redis_reach import Reach, RedisAway

if TYPE_CHECKING:
    from gateway.table import KeyInfo


def prefix(key_id: int) -> str:
    return f"llmgw:rl:{key_id}:"


class Limits:
    """One web process's side of the keys' rate limits."""

    def __init__(self, redis: Redis, reach: Reach):
        self.reach = reach
        self._script = scripts.register(redis, "limits")
        self.here: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])  # (key, minute) -> counts

    async def check(self, key: KeyInfo, reserve: int = 0) -> int | None:
        """Admit a request under its key's rpm and tpm limits, or refuse it (429 with the seconds to the next
        minute). With a tpm limit, `reserve` tokens (what the request may use at most, as far as the gateway can
        tell) are counted at once, so that requests arriving together cannot all pass a limit none of them has
        reached yet; `settle` puts the difference right once the engine said what it used. Returns the minute the
        tokens were reserved in (None: no tpm limit)."""
        if not key.rpm and not key.tpm:
            return None
        reserve = max(0, int(reserve))
        try:
            refused, count, left = await self.reach.call(self._script(
                keys=[], args=["check", prefix(key.id), key.rpm or 0, key.tpm or 0, reserve]))
        except RedisAway:
            self.reach.went_without()
            return self._check_here(key, reserve)
        self._refuse(key, int(refused), int(left))
        return int(count) if key.tpm else None

    @staticmethod
    def _refuse(key: KeyInfo, refused: int, retry: int) -> None:
        if refused == 1:
            raise GatewayError(429, "rate_limited", f"key {key.name} is limited to {key.rpm} requests per minute", retry)
        if refused == 2:
            raise GatewayError(429, "rate_limited", f"key {key.name} is limited to {key.tpm} tokens per minute", retry)

    def _check_here(self, key: KeyInfo, reserve: int) -> int | None:
        """The same in this process alone, by its clock (Redis away): the minute is returned negated, to settle
        here too."""
        now = time.time()
        minute = int(now // 60)
        for old in [k for k in self.here if k[1] < minute - 1]:
            del self.here[old]
        counts = self.here[(key.id, minute)]
        counts[0] += 1
        if key.rpm and counts[0] > key.rpm:
            self._refuse(key, 1, 60 - int(now % 60))
        if key.tpm:
            if counts[1] >= key.tpm:
                self._refuse(key, 2, 60 - int(now % 60))
            counts[1] += reserve
            return -minute
        return None

    async def settle(self, key: KeyInfo, used: int, reserved: int, minute: int | None) -> None:
        """Count the tokens a request used against its key's tpm limit, in place of what it reserved, in the minute
        it was admitted in (a reservation is never left standing: a request that failed used what it used, maybe
        0). Never raises: a settle Redis did not take leaves the minute's count as reserved."""
        change = int(used) - int(reserved)
        if not key.tpm or not change or minute is None:
            return
        if minute < 0:  # counted here while Redis was away
            counts = self.here.get((key.id, -minute))
            if counts is not None:
                counts[1] += change
            return
        try:
            await self.reach.call(self._script(keys=[], args=["settle", prefix(key.id), 0, 0, change, minute]))
        except RedisAway:
            pass
