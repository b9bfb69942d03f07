"""The gateway's Redis scripts, kept as files in gateway/lua/ (each names its KEYS and ARGV at the top, reads the
clock from Redis's TIME and gives every key it writes an expiry), read once (cluster.scripts) and registered per
client: redis-py sends each by its SHA1 and loads it when the server does not know it (a Redis restarted)."""

from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from cluster.scripts import Scripts

GATEWAY = Scripts(Path(__file__).with_name("lua"))


def register(redis: Redis, name: str) -> AsyncScript:
    """`name`'s script on this asyncio client, awaited as `await script(keys=[...], args=[...])`."""
    return GATEWAY.aregister(redis, name)
