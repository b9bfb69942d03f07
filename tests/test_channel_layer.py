"""The channel layer's pool of Redis connections: a burst larger than the pool waits its turn, none fails."""

import asyncio

import pytest
import redis.exceptions
from channels_redis.core import RedisChannelLayer as PlainLayer
from django.conf import settings

from llmgw.channel_layer import RedisChannelLayer

pytestmark = pytest.mark.asyncio

BURST = 60  # calls under way at once
POOL = 4


async def burst(layer) -> list:
    async def one(i: int):
        await layer.group_add(f"burst-{i % 3}", f"burst.{i}")
        await layer.group_send(f"burst-{i % 3}", {"type": "x"})
        await layer.group_discard(f"burst-{i % 3}", f"burst.{i}")

    try:
        return await asyncio.gather(*(one(i) for i in range(BURST)), return_exceptions=True)
    finally:
        await layer.flush()
        await layer.close_pools()


async def test_a_burst_larger_than_the_pool_waits_for_connections():
    layer = RedisChannelLayer(hosts=[{"address": settings.REDIS_URL, "max_connections": POOL}], prefix="llmgw-test-pool")
    results = await burst(layer)
    assert [r for r in results if r is not None] == []


async def test_the_plain_layer_fails_such_a_burst():
    # what the project's layer is for: channels_redis's own pool raises at its limit (100 by default in redis-py 8)
    layer = PlainLayer(hosts=[{"address": settings.REDIS_URL, "max_connections": POOL}], prefix="llmgw-test-pool")
    results = await burst(layer)
    assert any(isinstance(r, redis.exceptions.MaxConnectionsError) for r in results)


def test_the_project_uses_it():
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == "llmgw.channel_layer.RedisChannelLayer"
