"""The gateway's Redis scripts, kept as files in gateway/lua/ (each names its KEYS and ARGV at the top, reads the
clock from Redis's TIME and gives every key it writes an expiry), read once and registered per client: redis-py
sends each by its SHA1 and loads it when the server does not know it (a Redis restarted)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

HERE = Path(__file__).with_name("lua")


@cache
def source(name: str) -> str:
    return (HERE / f"{name}.lua").read_text()


def register(redis: Redis, name: str) -> AsyncScript:
    """`name`'s script on this client: awaitable (or callable) as `script(keys=[...], args=[...])`."""
    return redis.register_script(source(name))
