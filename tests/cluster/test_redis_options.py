"""Every Redis client of llmgw's after Redis restarted under it (a Valkey of the test's own, killed and started
again on its port, as `llmgw up`'s supervisor does): a connection left dead in a pool costs no command, and a
command sent while Redis is on its way back waits for it. The channel layer's wait for messages still ends, so a
stream joins its groups again on the Redis that forgot them."""

import asyncio
import signal
import threading
import time

import pytest
import redis
from django.conf import settings as django_settings

from gateway.table import KeyInfo

pytestmark = pytest.mark.integration  # a Valkey of its own, killed and started again

CONCURRENT = 16  # requests under way at once: as many pooled connections


@pytest.fixture
def valkey(tmp_path):
    from llmgw.valkey import EmbeddedValkey

    server = EmbeddedValkey(tmp_path / "valkey")
    server.start()
    yield server
    server.stop()


def kill(server) -> None:
    """Redis dies at once (SIGKILL): every connection to it is dead, the clients not told until they use one."""
    server.child.send(signal.SIGKILL)
    server.child.popen.wait(10)


def restart(server, down: float = 0.0) -> threading.Thread | None:
    """Kill it and start it again on its port, empty; with `down`, in a thread that seconds later."""
    kill(server)
    if not down:
        server.start()
        return None
    def later() -> None:
        time.sleep(down)
        server.start()

    thread = threading.Thread(target=later)
    thread.start()
    return thread


@pytest.fixture
def limited_key():
    return KeyInfo(id=7, name="limited", prefix="sk-llmgw-abc", models=frozenset(), rpm=1000, tpm=None,
                   expires_at=None, revoked=False)


@pytest.mark.asyncio
async def test_the_gateways_client_counts_every_limited_request_after_a_restart(valkey, settings, limited_key):
    # the probe's finding: after a restart, stale pooled connections failed 2 of 16 limited requests (a 503)
    from gateway.runtime import Gateway

    settings.REDIS_URL = valkey.url
    gw = Gateway()
    try:
        await asyncio.gather(*(gw.limits.check(limited_key) for _ in range(CONCURRENT)))  # 16 connections
        await asyncio.to_thread(restart, valkey)
        results = await asyncio.gather(*(gw.limits.check(limited_key) for _ in range(CONCURRENT)),
                                       return_exceptions=True)
        assert [r for r in results if r is not None] == [] and not gw.reach.away
        # each counted once on the Redis that came back: a retried INCR is not counted twice
        seconds, _ = await gw.redis.time()
        minute = seconds // 60
        counted = [int(await gw.redis.get(f"llmgw:rl:{limited_key.id}:r:{m}") or 0) for m in (minute - 1, minute)]
        assert sum(counted) == CONCURRENT, counted

        # and while Redis is still on its way back (the supervisor's half second), a request waits for it a
        # quarter of a second at most, and goes on, counted in this process (gateway/limits.py)
        restarting = await asyncio.to_thread(restart, valkey, 0.6)
        started = time.monotonic()
        await gw.limits.check(limited_key)
        assert time.monotonic() - started < 0.5 and gw.reach.away
        await asyncio.to_thread(restarting.join)
        for _ in range(40):  # Redis back: asked again once the probe finds it
            if not gw.reach.away:
                break
            await asyncio.sleep(0.1)
        assert not gw.reach.away
    finally:
        await gw.aclose()


def test_the_shared_client_and_the_control_client_after_a_restart(valkey, settings):
    from cluster import control
    from cluster.locks import redis_client

    settings.REDIS_URL = valkey.url
    redis_client.cache_clear()
    try:
        for client in (redis_client(), control._client()):
            client.set("before", 1)
            restarting = restart(valkey, down=0.3)  # the first try finds nothing listening
            assert client.incr("counted") == 1  # sent again once Redis is back, counted once
            restarting.join()
            restart(valkey)  # a pooled connection left dead
            assert client.get("before") is None and client.incr("counted") == 1
            lock = client.lock("llmgw:test-lock", timeout=5, blocking=False)
            assert lock.acquire() and lock.release() is None
    finally:
        redis_client.cache_clear()


def test_djangos_cache_after_a_restart(valkey):
    from django.core.cache.backends.redis import RedisCache

    cache = RedisCache(valkey.url, {"OPTIONS": django_settings.CACHES["default"].get("OPTIONS", {})})
    cache.set("a", 1)
    restarting = restart(valkey, down=0.3)
    cache.set("b", 2)
    restarting.join()
    assert cache.get("a") is None and cache.get("b") == 2


@pytest.mark.asyncio
async def test_the_channel_layer_sends_on_a_new_connection_but_a_wait_for_messages_ends(valkey):
    from llmgw.channel_layer import RedisChannelLayer

    host = dict(django_settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0], address=valkey.url)
    layer = RedisChannelLayer(hosts=[host], prefix="llmgw-test-restart")
    try:
        channels = [await layer.new_channel() for _ in range(CONCURRENT)]
        await asyncio.gather(*(layer.group_add("g", c) for c in channels))
        await asyncio.to_thread(restart, valkey)
        # pooled connections left dead: each call goes on a new one
        results = await asyncio.gather(*(layer.group_add("g", c) for c in channels), return_exceptions=True)
        assert [r for r in results if r is not None] == []
        await layer.group_send("g", {"type": "hello"})
        assert (await layer.receive(channels[0]))["type"] == "hello"

        # a stream's wait for messages when Redis restarts under it: it fails, and the stream (its consumer) ends,
        # for its client to dial again and join its groups on the Redis that forgot them
        waiting = asyncio.ensure_future(layer.receive(await layer.new_channel()))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(restart, valkey)
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(waiting, 10)
    finally:
        await layer.flush()
        await layer.close_pools()
