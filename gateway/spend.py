"""A key's token budget, held across every web process: what the database says it spent, and what each process
holds besides (gateway/lua/budget.lua).

The database has what a key spent (gateway.models.Usage, which every web process writes once a second:
gateway/runtime.py). Redis has, per key and period, that spend as last read back, and each web process's part: the
tokens its requests under way reserved, and those its ended requests used and it has not written yet. A request
is refused unless what it may use fits in what is left, and reserves that at once (so requests sent together
cannot overspend); when it ends, its reservation becomes what it used; once that is written, the process's part
shrinks by it and the spend, read back from the database, grows by it. Each process says its part whole (never a
difference), at once when it changes and again every second while it has one, so what Redis loses (a restart, a
failover) is whole again within a second; a spend Redis does not have is read from the database. A process that
stops saying its part (it died) stops counting after STALE seconds.

With Redis away (gateway/redis_reach.py), a web process holds each key to its budget with what Redis last said the
others held (or, never told, what the database has) and its own part: the other processes' requests meanwhile
are not seen, so a key may overspend by what they serve until Redis is back.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from channels.db import database_sync_to_async
from redis.asyncio import Redis

from gateway import budgets, scripts
from gateway.errors import GatewayError
from gateway.redis_reach import Reach, RedisAway

if TYPE_CHECKING:
    from gateway.table import KeyInfo

log = logging.getLogger("llmgw.gateway")

STALE = 30.0  # seconds a process's part counts after it last said it


@dataclass(frozen=True)
class Bucket:
    """A key's budget in one period."""

    key_id: int
    period: str
    start: dt.datetime
    end: dt.datetime

    @property
    def name(self) -> str:
        return f"llmgw:budget:{self.key_id}:{self.period}:{int(self.start.timestamp())}"


@dataclass
class Hold:
    """What a request reserved of its key's budget."""

    bucket: Bucket
    reserved: int


class Budgets:
    """One web process's side of the keys' budgets: its part of each, said to Redis."""

    def __init__(self, redis: Redis, reach: Reach, process: str):
        self.reach = reach
        self.process = process
        self._script = scripts.register(redis, "budget")
        self.reserved: dict[Bucket, int] = defaultdict(int)  # by requests under way
        self.unwritten: dict[Bucket, int] = defaultdict(int)  # used by ended requests, not yet written
        self.writing: dict[Bucket, int] = defaultdict(int)  # on its way to the database
        self.others: dict[Bucket, int] = {}  # what Redis last said the database and the other processes hold
        self._changed: set[Bucket] = set()  # to say, in the task saying them
        self._saying: asyncio.Task[None] | None = None
        reach.on_back.append(self.say_everything)

    def part(self, bucket: Bucket) -> int:
        return self.reserved.get(bucket, 0) + self.unwritten.get(bucket, 0) + self.writing.get(bucket, 0)

    async def _call(self, bucket: Bucket, op: str, budget: int = 0, reserve: int = 0, db: int = 0) -> tuple[int, int]:
        status, held = await self.reach.call(self._script(
            keys=[bucket.name], args=[op, self.process, self.part(bucket), budget, reserve, db,
                                      int(bucket.end.timestamp()) + 86400, int(STALE * 1000)]))
        if int(status) != -1:
            self.others[bucket] = int(held)
        return int(status), int(held)

    async def reserve(self, key: KeyInfo, reserve: int, now: dt.datetime) -> Hold | None:
        """Reserve `reserve` tokens of the key's budget for a request, or refuse it: 429 `budget_exceeded` naming
        the budget and when it resets. None: the key has no budget."""
        if not key.budget_tokens or key.budget_period not in budgets.PERIODS:
            return None
        start, end = budgets.period_start(key.budget_period, now), budgets.period_end(key.budget_period, now)
        bucket = Bucket(key.id, key.budget_period, start, end)
        reserve = max(0, int(reserve))
        try:
            status, held = await self._call(bucket, "reserve", key.budget_tokens, reserve)
            if status == -1:  # a new period, or a Redis that lost it: the database's spend first
                before = self.others.get(bucket, 0)
                await self._call(bucket, "written", db=await self._spent(bucket))
                status, held = await self._call(bucket, "reserve", key.budget_tokens, reserve)
                # a Redis that lost it: the other processes say their parts again within a second; until then
                # what they held before counts
                if before > held:
                    held = self.others[bucket] = before
                    if status == 0 and held + self.part(bucket) + reserve > key.budget_tokens:
                        status = 1
                        await self._call(bucket, "part")  # the reservation just made, taken back
                        self.others[bucket] = held
        except RedisAway:
            self.reach.went_without()
            if bucket not in self.others:
                self.others[bucket] = await self._spent(bucket)
            held = self.others[bucket]
            status = 1 if held + self.part(bucket) + reserve > key.budget_tokens else 0
        if status == 1:
            raise self._refusal(key, key.budget_tokens, bucket, held + self.part(bucket), reserve, now)
        self.reserved[bucket] += reserve
        return Hold(bucket, reserve)

    @staticmethod
    async def _spent(bucket: Bucket) -> int:
        spent: int = await database_sync_to_async(budgets.spent)(bucket.key_id, bucket.period, bucket.start)
        return spent

    @staticmethod
    def _refusal(key: KeyInfo, tokens: int, bucket: Bucket, used: int, reserve: int, now: dt.datetime) -> GatewayError:
        budget = f"{budgets.shown(tokens)} tokens per {key.budget_period}"
        left = max(0, tokens - used)
        retry = max(1, int((bucket.end - now).total_seconds()))
        why = (f"key {key.name} has used its budget of {budget}" if left <= 0 else
               f"key {key.name} has {left} tokens left of its budget of {budget}, and this request may use up to "
               f"{reserve} (ask for fewer max tokens)")
        refusal = GatewayError(429, "budget_exceeded", f"{why}; it resets at {bucket.end:%Y-%m-%d %H:%M} UTC", retry)
        refusal.exhausted_until = int(bucket.end.timestamp()) if left <= 0 else None  # for the Event, once a period
        return refusal

    def settle(self, hold: Hold, used: int) -> None:
        """The request ended having used `used` tokens: its reservation becomes that, until it is written; said
        to Redis in the background."""
        bucket = hold.bucket
        self.reserved[bucket] -= hold.reserved
        self.unwritten[bucket] += max(0, int(used))
        self._say_soon(bucket)

    def take_unwritten(self) -> dict[Bucket, int]:
        """What the ended requests used, on its way to the database with the usage (still counted meanwhile)."""
        taken = {b: n for b, n in self.unwritten.items() if n}
        for bucket, n in taken.items():
            self.unwritten[bucket] -= n
            self.writing[bucket] += n
        return taken

    def not_written(self, taken: dict[Bucket, int]) -> None:
        """The write failed: what was taken waits for the next one."""
        for bucket, n in taken.items():
            self.writing[bucket] -= n
            self.unwritten[bucket] += n

    async def written(self, taken: dict[Bucket, int], spent: dict[Bucket, int]) -> None:
        """The write committed: the process's part shrinks by it and the spend is the database's now."""
        for bucket, n in taken.items():
            self.writing[bucket] -= n
        for bucket in taken:
            try:
                await self._call(bucket, "written", db=spent.get(bucket, 0))
            except RedisAway:
                self._changed.add(bucket)  # said again once Redis is back
        self._forget_idle()

    def _say_soon(self, bucket: Bucket) -> None:
        self._changed.add(bucket)
        if self._saying is None or self._saying.done():
            self._saying = asyncio.get_running_loop().create_task(self._say(), context=contextvars.Context())

    async def _say(self) -> None:
        while self._changed:
            bucket = self._changed.pop()
            try:
                await self._call(bucket, "part")
            except RedisAway:
                self._changed.add(bucket)  # said again by `say_all` once Redis is back
                return
            except Exception as exc:
                log.warning("could not say a budget's part (%s)", exc)

    def say_everything(self) -> None:
        """Every part this process has, said again now (Redis is back, perhaps without them)."""
        for bucket in (*self.reserved, *self.unwritten, *self.writing):
            if self.part(bucket):
                self._say_soon(bucket)

    async def say_all(self) -> None:
        """Every part this process has, said again (every second: what Redis lost is whole again)."""
        for bucket in {b for b in (*self.reserved, *self.unwritten, *self.writing) if self.part(b)} | self._changed:
            self._changed.discard(bucket)
            await self._call(bucket, "part")
        self._forget_idle()

    def _forget_idle(self) -> None:
        for bucket in [b for b in self.reserved if not self.part(b) and b not in self._changed]:
            for counts in (self.reserved, self.unwritten, self.writing):
                counts.pop(bucket, None)

    async def aclose(self) -> None:
        if self._saying is not None and not self._saying.done():
            await asyncio.wait([self._saying], timeout=1)
            self._saying.cancel()
