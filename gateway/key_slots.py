"""A key's requests at once (its `max_concurrency`), counted across every web process: a member of a sorted set
per key in Redis (gateway/lua/key_slot.lua), member -> when it lapses on Redis's clock, so a process that dies
leaks none (its members lapse a lease's time after it last kept them alive, as a model's slots do). Redis away
(gateway/redis_reach.py): each process counts its own until Redis is back."""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable

from redis.asyncio import Redis

from cluster.inflight import ADMISSION_PREFIX
from gateway import scripts
from gateway.errors import GatewayError
from gateway.redis_reach import Reach, RedisAway

log = logging.getLogger("llmgw.gateway")


def key_slots_key(key_id: int) -> str:
    return f"{ADMISSION_PREFIX}key:{key_id}"


class KeySlots:
    """One web process's side: the members it holds, kept alive by `keep_alive`, which admission's renewal calls
    every few seconds once `start` has started it (gateway/admission.py)."""

    def __init__(self, redis: Redis, reach: Reach, process: str, ttl: float, start: Callable[[], None]):
        self.redis, self.reach, self.process, self.ttl, self._start = redis, reach, process, ttl, start
        self._script = scripts.register(redis, "key_slot")
        self.held: dict[str, int] = {}  # member -> key id: the key slots this process holds
        self._here: Counter[int] = Counter()  # key id -> its requests counted here while Redis was away

    async def hold(self, key_id: int, name: str, limit: int) -> str:
        """One of the key's `limit` requests at once (waiting or in flight), or a 429 `concurrency_limit`."""
        self._start()
        member = f"{self.process}:{secrets.token_hex(6)}"
        try:
            held = int(await self.reach.call(self._script(keys=[key_slots_key(key_id)],
                                                          args=["hold", int(self.ttl * 1000), limit, member])))
        except RedisAway:  # counted in this process alone until Redis is back
            self.reach.went_without()
            held = int(self._here[key_id] < limit)
            member = "here:" + member
        if not held:
            raise GatewayError(429, "concurrency_limit",
                               f"key {name} has {limit} requests in flight already (its max concurrency)", 1)
        if member.startswith("here:"):
            self._here[key_id] += 1
        self.held[member] = key_id
        return member

    async def let_go(self, member: str) -> None:
        key_id = self.held.pop(member, None)
        if key_id is not None and member.startswith("here:"):
            self._here[key_id] -= 1
        elif key_id is not None:
            try:
                await self.redis.zrem(key_slots_key(key_id), member)
            except Exception as exc:  # it lapses in its ttl
                log.warning("could not let a key's request go (%s)", exc)

    async def keep_alive(self) -> None:
        """Every member this process holds in Redis kept alive (one given back meanwhile is not brought back)."""
        by_key: dict[int, list[str]] = {}
        for member, key_id in list(self.held.items()):
            if not member.startswith("here:"):
                by_key.setdefault(key_id, []).append(member)
        if not by_key:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, members in by_key.items():
                pipe.evalsha(self._script.sha, 1, key_slots_key(key_id), "keep", int(self.ttl * 1000), 0, *members)
            await pipe.execute()
