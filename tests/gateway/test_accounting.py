"""The ledger (gateway/accounting.py): usage taken for the database once, traffic per minute into Redis (the real
one) across web processes."""

import socket

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from cluster.locks import redis_client
from gateway.accounting import Ledger

pytestmark = pytest.mark.asyncio

MINUTE = 1_772_000_000 // 60 * 60  # the start of a minute (in 2026), so offsets into it are exact
HOUR = 1_772_000_000 // 3600 * 3600


@pytest_asyncio.fixture
async def redis():
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def other_process():
    """A second connection, as a second web process has: the traffic is shared through Redis, not memory."""
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


async def test_the_ledger_gives_its_usage_once_and_takes_back_what_was_not_written():
    ledger = Ledger()
    ledger.add(7, "qwen", 10, 5, now=HOUR + 1)
    ledger.add(7, "qwen", 3, 2, now=HOUR + 20)
    ledger.add(8, "qwen", 4, 0, now=HOUR + 3600, resumed=9)  # the next hour; resumed: the fleet's prompt tokens
    usage, last_used = ledger.take_usage()
    assert usage == {(HOUR, 7, "qwen"): [2, 13, 7, 0], (HOUR + 3600, 8, "qwen"): [1, 4, 0, 9]}
    assert last_used == {7: HOUR + 20, 8: HOUR + 3600}
    assert ledger.take_usage() == ({}, {})  # taken: the next write starts from nothing
    ledger.add(7, "qwen", 1, 1, now=HOUR + 30)  # more arrives while the write fails
    ledger.keep_usage(usage, last_used)
    again, _ = ledger.take_usage()
    assert again[(HOUR, 7, "qwen")] == [3, 14, 8, 0] and again[(HOUR + 3600, 8, "qwen")] == [1, 4, 0, 9]


async def test_traffic_survives_a_flush_that_fails(redis):
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    away = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    ledger = Ledger()
    ledger.count(200, 30, now=MINUTE + 3600 * 48)
    with pytest.raises(RedisConnectionError):
        await ledger.flush_traffic(away)
    await away.aclose()
    assert ledger.traffic  # kept for the next flush


async def test_an_empty_ledger_does_not_touch_redis():
    await Ledger().flush_traffic(None)  # no client needed: nothing is sent


async def test_traffic_per_minute_adds_up_across_processes_and_reads_back_an_hour(redis, other_process):
    from gateway.accounting import TRAFFIC, traffic

    first, second = Ledger(), Ledger()
    first.count(200, 30, now=MINUTE + 1)
    first.count(502, 0, now=MINUTE + 59)
    second.count(200, 12, now=MINUTE + 30)
    second.count(200, 8, now=MINUTE + 61)  # the next minute
    await first.flush_traffic(redis)
    await second.flush_traffic(other_process)
    assert not first.traffic and not second.traffic
    assert 0 < redis_client().ttl(TRAFFIC + str(MINUTE // 60)) <= 2 * 3600
    rows = traffic(redis_client(), 60, now=MINUTE + 150)  # the minute after next is not over: not shown
    assert len(rows) == 60 and rows[0]["minute"] == MINUTE // 60 - 58
    assert rows[-2] == {"minute": MINUTE // 60, "requests": 3, "errors": 1, "tokens": 42}
    assert rows[-1] == {"minute": MINUTE // 60 + 1, "requests": 1, "errors": 0, "tokens": 8}
    assert all(r["requests"] == 0 for r in rows[:-2])


async def test_times_to_first_chunk_add_up_across_processes_into_percentiles(redis, other_process):
    """The overview's TTFT p50 and p95: every web process's streams, per minute in Redis, read as
    histogram_quantile reads Prometheus buckets."""
    from gateway.accounting import first_chunk_percentiles
    from gateway.metrics import BUCKETS

    base = MINUTE + 3600 * 24  # minutes no other test writes
    first, second = Ledger(), Ledger()
    for i in range(90):  # 90 streams between 0.2 and 0.3 s: bucket (0.2, 0.3]
        (first if i % 2 else second).count(200, 5, now=base + i % 50, first_chunk=0.25)
    for _ in range(10):  # 10 slow ones, in the next minute: bucket (2, 3]
        second.count(200, 5, now=base + 70, first_chunk=2.5)
    first.count(200, 5, now=base + 5)  # a request that did not stream counts in traffic only
    await first.flush_traffic(redis)
    await second.flush_traffic(other_process)
    seen = first_chunk_percentiles(redis_client(), now=base + 150)
    assert seen["count"] == 100
    assert 0.2 < seen[0.5] <= 0.3  # the 50th of 100 lies in the first 90
    assert 2 < seen[0.95] <= 3  # the 95th, among the slow ten
    assert (0.2, 0.3, 2, 3) == (BUCKETS[3], BUCKETS[4], BUCKETS[9], BUCKETS[10])
    assert first_chunk_percentiles(redis_client(), now=base + 7200)[0.5] is None  # an hour with nothing streamed
