"""Redis (Valkey) behind Sentinel: every Redis client llmgw has finds the master through the Sentinels and follows a
failover on its own — redis-py's (the locks, the control plane's, the gateway's counts and queues), the channel
layer's, Django's cache's and Celery's broker (kombu) — on real servers: a primary, a replica and three
Sentinels (tests/sentinel.py), the primary killed."""

import asyncio
import importlib.util
import uuid

import pytest
from django.core.cache.backends.redis import RedisCache
from django.core.exceptions import ImproperlyConfigured
from kombu import Connection

import llmgw.settings
from cluster import redis_options
from llmgw.channel_layer import RedisChannelLayer
from llmgw.settings import database
from tests.sentinel import MASTER, PASSWORD, SentinelSet


@pytest.fixture
def sentinels(tmp_path, settings):
    made = SentinelSet(tmp_path).start()
    settings.LLMGW_REDIS_SENTINELS = [("127.0.0.1", p) for p in made.sentinels]
    settings.LLMGW_REDIS_MASTER = MASTER
    settings.LLMGW_REDIS_SENTINEL_PASSWORD = ""
    settings.REDIS_URL = f"redis://:{PASSWORD}@127.0.0.1:1/5"  # its database and password; not its host
    yield made
    made.stop()


def settings_with(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("llmgw_settings_sentinel", llmgw.settings.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_every_client_finds_the_master_and_follows_a_failover(sentinels, settings):
    sync = redis_options.client()
    cache = RedisCache(settings.REDIS_URL, {"OPTIONS": {"pool_class": "cluster.redis_options.CachePool"}})
    layer = RedisChannelLayer(hosts=[{"address": settings.REDIS_URL, "socket_timeout": 30}])
    url = redis_options.sentinel_broker_url(settings.REDIS_URL, settings.LLMGW_REDIS_SENTINELS)
    name = f"test-{uuid.uuid4().hex[:8]}"
    broker = Connection(url, transport_options={"master_name": MASTER, "socket_timeout": 5})
    consumer = Connection(url, transport_options={"master_name": MASTER, "socket_timeout": 5})
    queues = {"in": broker.SimpleQueue(name), "out": consumer.SimpleQueue(name)}

    async def async_round(loop_client, word: str) -> None:
        await loop_client.set("llmgw:test:async", word)
        assert (await loop_client.get("llmgw:test:async")).decode() == word
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "test.message", "word": word})
        assert (await asyncio.wait_for(layer.receive(channel), 10))["word"] == word

    async def both_rounds() -> float:
        aclient = redis_options.client(asyncio=True)
        await async_round(aclient, "before")
        took = await asyncio.to_thread(sentinels.kill_primary)
        await async_round(aclient, "after")  # the same client, its pooled connection to the old master dead
        await aclient.aclose()
        return took

    def sync_round(word: str) -> None:
        sync.set("llmgw:test:sync", word)
        assert sync.get("llmgw:test:sync").decode() == word
        assert sync.connection_pool.connection_kwargs["db"] == 5  # REDIS_URL's database
        cache.set("llmgw-test", word)
        assert cache.get("llmgw-test") == word
        # a task sent: Celery's publish retries on a new connection, which asks the Sentinels (kombu's transport)
        queues["in"].put({"word": word}, retry=True, retry_policy={"max_retries": 10, "interval_step": 0.5})
        try:
            message = queues["out"].get(timeout=10)
        except consumer.connection_errors:  # a worker's consumer whose connection died connects again, as Celery's does
            queues["out"].close()
            consumer.close()
            queues["out"] = consumer.SimpleQueue(name)
            message = queues["out"].get(timeout=10)
        assert message.payload == {"word": word}
        message.ack()

    first = sentinels.primary
    sync_round("before")
    took = asyncio.run(both_rounds())
    assert sentinels.master_port() != first
    sync_round("after")  # the same clients, now on the promoted replica
    assert took < 15
    for queue in queues.values():
        queue.close()
    broker.release()
    consumer.release()


def test_the_settings_read_the_sentinels_and_keep_redis_urls_database_and_password(monkeypatch):
    module = settings_with(monkeypatch, LLMGW_REDIS_SENTINELS="10.0.0.1:26379, sentinel-b:26380,[fd00::3]:26381",
                           LLMGW_REDIS_MASTER="cache", REDIS_URL="redis://:p%40ss@ignored:6379/2",
                           LLMGW_REDIS_SENTINEL_PASSWORD="sent")
    assert module.LLMGW_REDIS_SENTINELS == [("10.0.0.1", 26379), ("sentinel-b", 26380), ("fd00::3", 26381)]
    assert module.CELERY_BROKER_URL == ("sentinel://:p%40ss@10.0.0.1:26379/2;sentinel://:p%40ss@sentinel-b:26380/2;"
                                        "sentinel://:p%40ss@[fd00::3]:26381/2")
    assert module.CELERY_BROKER_TRANSPORT_OPTIONS["master_name"] == "cache"
    assert module.CELERY_BROKER_TRANSPORT_OPTIONS["sentinel_kwargs"]["password"] == "sent"
    assert redis_options.url_auth(module.REDIS_URL) == {"db": 2, "password": "p@ss"}
    plain = settings_with(monkeypatch, LLMGW_REDIS_SENTINELS="", REDIS_URL="redis://127.0.0.1:6390/0")
    assert plain.LLMGW_REDIS_SENTINELS == [] and plain.CELERY_BROKER_URL == "redis://127.0.0.1:6390/0"


def test_tls_through_sentinel_is_refused_plainly(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="rediss://"):
        settings_with(monkeypatch, LLMGW_REDIS_SENTINELS="s1:26379", REDIS_URL="rediss://:pw@x:6379/0")


def test_a_database_url_with_a_host_list_goes_to_libpq_as_it_is():
    parsed = database("postgres://u:p%40ss,w@db1:5432,[fd00::2]:5433,db3/llmgw?target_session_attrs=read-write")
    assert (parsed["HOST"], parsed["PORT"]) == ("db1,fd00::2,db3", "5432,5433,5432")
    assert (parsed["USER"], parsed["PASSWORD"], parsed["NAME"]) == ("u", "p@ss,w", "llmgw")
    assert parsed["OPTIONS"] == {"target_session_attrs": "read-write"}
    assert database("postgres://u@db1:5432/llmgw")["HOST"] == "db1"


@pytest.mark.parametrize("value", ["host:port", "host:0", ":26379", "a:1,b:99999", "::1", "fd00::3:26379"])
def test_a_sentinel_list_it_cannot_read_is_refused_by_name(monkeypatch, value):
    with pytest.raises(ImproperlyConfigured, match="LLMGW_REDIS_SENTINELS must be host:port"):
        settings_with(monkeypatch, LLMGW_REDIS_SENTINELS=value)
