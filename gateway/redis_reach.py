"""Whether this web process can reach Redis, and how long a request waits on it: at most WAIT seconds.

Redis that does not answer within WAIT (hung, stopped, partitioned, restarting) is *away*: the process says so once
in its log, stops asking it on the request path at once (no request waits on it again), and a probe asks it every
PROBE_EVERY seconds until it answers; then the process says so once more, with how many requests went on without
it. Only Redis's own slowness counts: an answer that came while this process was held up (not scheduled on a busy
machine, a callback that ran long) is read before the wait is judged over, so a starved process does not take
Redis for away and let requests past admission. What a request does without Redis is its caller's choice
(gateway/admission.py, gateway/limits.py, gateway/budgets.py: docs/fair-sharing.md says what each does).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger("llmgw.gateway")

WAIT = 0.25  # seconds a request waits on Redis at most
CATCH_UP = 0.005  # seconds more, once the wait is over, for what came meanwhile (Reach.call)
PROBE_EVERY = 0.5  # seconds between two asks of a Redis that is away

T = TypeVar("T")


class RedisAway(Exception):
    """Redis did not answer in time, or cannot be reached: the request goes on without it."""


class Reach:
    def __init__(self, redis: Redis, wait: float = WAIT):
        self.redis = redis
        self.wait = wait
        self.away_since: float | None = None  # monotonic; None: reachable
        self.without = 0  # requests that went on without Redis in this spell
        self._probe: asyncio.Task[None] | None = None
        # called once Redis answers again: what it may have lost, said again
        self.on_back: list[Callable[[], None]] = []

    @property
    def away(self) -> bool:
        return self.away_since is not None

    async def call(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, waited for at most `wait` seconds; RedisAway when Redis is away already (at once),
        does not answer in time, or fails."""
        if self.away_since is not None:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise RedisAway("Redis is away")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as timeout:
                # the wait over, a moment more from when this process gets to it: an answer that came while the
                # process was held up (not scheduled on a busy machine, a callback that ran long) is read first
                over = loop.call_at(loop.time() + self.wait, lambda: timeout.reschedule(loop.time() + CATCH_UP))
                try:
                    return await awaitable
                finally:
                    over.cancel()
        except (RedisError, OSError, TimeoutError) as exc:
            self.lost(exc)
            raise RedisAway(str(exc) or type(exc).__name__) from None

    def went_without(self) -> None:
        """A request went on without Redis: counted for the word said when it is back."""
        self.without += 1

    def lost(self, exc: BaseException) -> None:
        """Redis failed to answer: away from now on, said once, asked again by a probe until it answers."""
        if self.away_since is not None:
            return
        self.away_since = time.monotonic()
        log.warning("Redis did not answer within %.2f s (%s): requests go on without it (admission and the keys' "
                    "limits counted in this web process alone) until it answers again", self.wait,
                    str(exc) or type(exc).__name__)
        self._probe = asyncio.get_running_loop().create_task(self._until_back(), context=contextvars.Context())

    async def _until_back(self) -> None:
        while True:
            await asyncio.sleep(PROBE_EVERY)
            try:
                async with asyncio.timeout(self.wait):
                    await self.redis.ping()
            except (RedisError, OSError, TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            away = time.monotonic() - (self.away_since or time.monotonic())
            log.warning("Redis answers again after %.1f s away; %d request(s) went on without it meanwhile", away,
                        self.without)
            self.away_since, self.without = None, 0
            for back in self.on_back:
                back()
            return

    async def aclose(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
