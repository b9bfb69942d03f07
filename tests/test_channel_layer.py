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


async def test_one_process_holds_a_message_for_each_of_a_thousand_streams_before_it_reads_any():
    # every stream (consumer) of a web process has its channel in the process's one inbox in Redis: the reconciler
    # placing a replica on each of 1,000 nodes sends each node's group a message at once (channels_redis's default
    # capacity, 100, dropped the rest)
    config = settings.CHANNEL_LAYERS["default"]["CONFIG"]
    layer = RedisChannelLayer(hosts=config["hosts"], capacity=config["capacity"], prefix="llmgw-test-capacity")
    try:
        channels = [await layer.new_channel() for _ in range(1000)]
        for i, channel in enumerate(channels):
            await layer.group_add(f"node-{i}", channel)
        for i in range(len(channels)):
            await layer.group_send(f"node-{i}", {"type": "send.desired", "i": i})
        got = [await asyncio.wait_for(layer.receive(channel), 5) for channel in channels]
        assert [m["i"] for m in got] == list(range(1000))
    finally:
        await layer.flush()
        await layer.close_pools()
