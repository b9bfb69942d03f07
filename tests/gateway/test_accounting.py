"""Rate limits and usage counting in Redis (the real one): per-minute windows, Retry-After, the ledger's hash."""

import asyncio
import json
import socket

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from cluster.locks import redis_client
from gateway.accounting import LAST_USED_HASH, USAGE_HASH, Ledger, check_limits, count_tokens, settle_tokens
from gateway.errors import GatewayError
from gateway.table import KeyInfo

pytestmark = pytest.mark.asyncio

MINUTE = 1_772_000_000 // 60 * 60  # the start of a minute (in 2026), so offsets into it are exact
HOUR = 1_772_000_000 // 3600 * 3600


def key(id: int = 7, rpm: int | None = None, tpm: int | None = None) -> KeyInfo:
    return KeyInfo(
        id=id, name=f"key-{id}", prefix="sk-llmgw-abcde", models=frozenset(), rpm=rpm, tpm=tpm, expires_at=None,
        revoked=False,
    )


@pytest_asyncio.fixture
async def redis():
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def other_process():
    """A second connection, as a second web process has: the limits are shared through Redis, not memory."""
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


def limit_keys() -> list[str]:
    return sorted(k.decode() for k in redis_client().keys("llmgw:rl:*"))


async def refusal(redis, k, now) -> GatewayError:
    with pytest.raises(GatewayError) as refused:
        await check_limits(redis, k, now=now)
    return refused.value


# Requests per minute


async def test_requests_per_minute_across_processes(redis, other_process):
    k = key(rpm=3)
    await check_limits(redis, k, now=MINUTE + 1)
    await check_limits(other_process, k, now=MINUTE + 2)
    await check_limits(redis, k, now=MINUTE + 3)
    refused = await refusal(other_process, k, MINUTE + 20.5)
    assert (refused.status, refused.code) == (429, "rate_limited")
    assert "3 requests per minute" in refused.message
    assert refused.retry_after == 40  # until the window's minute is over
    await refusal(redis, k, MINUTE + 59.9)

    await check_limits(redis, k, now=MINUTE + 60)  # a new minute, a new window
    assert limit_keys() == [f"llmgw:rl:r:7:{MINUTE // 60}", f"llmgw:rl:r:7:{MINUTE // 60 + 1}"]


async def test_request_windows_are_per_key_and_expire(redis):
    await check_limits(redis, key(id=1, rpm=1), now=MINUTE + 1)
    await refusal(redis, key(id=1, rpm=1), MINUTE + 2)
    await check_limits(redis, key(id=2, rpm=1), now=MINUTE + 3)  # another key's window is its own
    for name in limit_keys():
        assert 0 < redis_client().ttl(name) <= 120  # counters expire: no key lives on in Redis


async def test_a_key_without_limits_writes_nothing(redis):
    for _ in range(5):
        await check_limits(redis, key(), now=MINUTE + 1)
    await count_tokens(redis, key(), 500, now=MINUTE + 1)
    await count_tokens(redis, key(rpm=10), 500, now=MINUTE + 1)  # tokens are counted only for a tpm limit
    assert limit_keys() == []


# Tokens per minute


async def test_tokens_per_minute(redis, other_process):
    k = key(tpm=100)
    await check_limits(redis, k, now=MINUTE + 1)
    await count_tokens(redis, k, 60, now=MINUTE + 2)
    await check_limits(other_process, k, now=MINUTE + 3)  # 60 of 100
    await count_tokens(other_process, k, 40, now=MINUTE + 4)
    refused = await refusal(redis, k, MINUTE + 5)  # 100 of 100: at the limit is over it
    assert (refused.status, refused.code, refused.retry_after) == (429, "rate_limited", 55)
    assert "100 tokens per minute" in refused.message
    await check_limits(redis, k, now=MINUTE + 61)
    assert limit_keys() == [f"llmgw:rl:t:7:{MINUTE // 60}"]  # no request counter for a tokens-only key
    assert int(redis_client().get(f"llmgw:rl:t:7:{MINUTE // 60}")) == 100
    assert 0 < redis_client().ttl(f"llmgw:rl:t:7:{MINUTE // 60}") <= 120


async def test_tokens_are_reserved_when_admitted_and_settled_when_used(redis, other_process):
    """16 requests at once on a tpm key, each of which may use 40 tokens: only as many as the limit holds are let
    in (reserve, then settle), whichever web process they come through."""
    k = key(tpm=100)
    tried = await asyncio.gather(*(check_limits(redis if i % 2 else other_process, k, 40, now=MINUTE + 1)
                                   for i in range(16)), return_exceptions=True)
    admitted = [m for m in tried if not isinstance(m, Exception)]
    assert len(admitted) == 3  # 0, 40, 80 used and reserved: under 100; the fourth finds 120
    assert all(isinstance(e, GatewayError) and e.status == 429 for e in tried if isinstance(e, Exception))
    assert admitted == [MINUTE // 60] * 3
    name = f"llmgw:rl:t:7:{MINUTE // 60}"
    assert int(redis_client().get(name)) == 120
    # each used 10, not 40: the reservations go, what they used stays
    for minute in admitted:
        await settle_tokens(redis, k, 10, 40, minute)
    assert int(redis_client().get(name)) == 30
    await check_limits(redis, k, 40, now=MINUTE + 2)  # room again
    # settled in the minute it was admitted in, even after that minute
    await settle_tokens(redis, k, 0, 40, MINUTE // 60)
    assert int(redis_client().get(name)) == 30


async def test_both_limits(redis):
    k = key(rpm=2, tpm=50)
    await check_limits(redis, k, now=MINUTE + 1)
    await count_tokens(redis, k, 50, now=MINUTE + 1)
    assert "50 tokens per minute" in (await refusal(redis, k, MINUTE + 2)).message
    k = key(id=8, rpm=1, tpm=50)
    await check_limits(redis, k, now=MINUTE + 1)
    assert "1 requests per minute" in (await refusal(redis, k, MINUTE + 2)).message


# Retry-After


@pytest.mark.parametrize("offset, retry_after", [(0.0, 60), (0.4, 60), (30.0, 30), (45.7, 15), (59.9, 1)])
async def test_retry_after_is_the_rest_of_the_minute(redis, offset, retry_after):
    k = key(rpm=1)
    await check_limits(redis, k, now=MINUTE + offset)
    refused = await refusal(redis, k, MINUTE + offset)
    assert refused.retry_after == retry_after
    response = refused.response()
    assert response.status == 429 and response["Retry-After"] == str(retry_after)
    assert json.loads(response.body) == {
        "error": {"message": refused.message, "type": "rate_limit_error", "code": "rate_limited"}
    }


# The ledger: usage and last use, from this process to Redis


def usage_hash() -> dict[str, int]:
    return {k.decode(): int(v) for k, v in redis_client().hgetall(USAGE_HASH).items()}


def last_used_hash() -> dict[str, float]:
    return {k.decode(): float(v) for k, v in redis_client().hgetall(LAST_USED_HASH).items()}


async def test_ledger_flush_writes_per_hour_key_and_model(redis):
    ledger = Ledger()
    ledger.add(7, "qwen2.5-7b", 10, 5, now=HOUR + 10)
    ledger.add(7, "qwen2.5-7b", 3, 2, now=HOUR + 20)
    ledger.add(7, "smollm2", 1, 1, now=HOUR + 3599)
    ledger.add(8, "qwen2.5-7b", 4, 0, now=HOUR + 3600)  # the next hour
    await ledger.flush(redis)
    assert usage_hash() == {
        f"{HOUR}|7|qwen2.5-7b|requests": 2,
        f"{HOUR}|7|qwen2.5-7b|prompt": 13,
        f"{HOUR}|7|qwen2.5-7b|completion": 7,
        f"{HOUR}|7|smollm2|requests": 1,
        f"{HOUR}|7|smollm2|prompt": 1,
        f"{HOUR}|7|smollm2|completion": 1,
        f"{HOUR + 3600}|8|qwen2.5-7b|requests": 1,
        f"{HOUR + 3600}|8|qwen2.5-7b|prompt": 4,
        f"{HOUR + 3600}|8|qwen2.5-7b|completion": 0,
    }
    assert last_used_hash() == {"7": HOUR + 3599, "8": HOUR + 3600}
    assert not ledger.usage and not ledger.last_used  # flushed: the next flush starts from nothing


async def test_flushes_add_up_across_flushes_and_processes(redis, other_process):
    first, second = Ledger(), Ledger()
    first.add(7, "qwen", 10, 5, now=HOUR + 1)
    await first.flush(redis)
    second.add(7, "qwen", 1, 1, now=HOUR + 2)
    await second.flush(other_process)
    first.add(7, "qwen", 2, 2, now=HOUR + 3)
    await first.flush(redis)
    assert usage_hash() == {f"{HOUR}|7|qwen|requests": 3, f"{HOUR}|7|qwen|prompt": 13, f"{HOUR}|7|qwen|completion": 8}
    assert last_used_hash() == {"7": HOUR + 3}


async def test_last_use_alone_is_flushed(redis):
    ledger = Ledger()
    ledger.last_used[7] = HOUR + 5.5  # what authenticating a request records, even one that is then refused
    await ledger.flush(redis)
    assert usage_hash() == {} and last_used_hash() == {"7": HOUR + 5.5}


async def test_an_empty_ledger_does_not_touch_redis():
    await Ledger().flush(None)  # no client needed: nothing is sent


async def test_counts_survive_a_flush_that_fails(redis):
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    away = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    ledger = Ledger()
    ledger.add(7, "qwen", 10, 5, now=HOUR + 1)
    with pytest.raises(RedisConnectionError):
        await ledger.flush(away)
    await away.aclose()
    ledger.add(7, "qwen", 1, 1, now=HOUR + 2)  # more arrives before the next flush
    await ledger.flush(redis)
    assert usage_hash() == {f"{HOUR}|7|qwen|requests": 2, f"{HOUR}|7|qwen|prompt": 11, f"{HOUR}|7|qwen|completion": 6}
    assert last_used_hash() == {"7": HOUR + 2}


async def test_traffic_per_minute_adds_up_across_processes_and_reads_back_an_hour(redis, other_process):
    from gateway.accounting import TRAFFIC, traffic

    first, second = Ledger(), Ledger()
    first.count(200, 30, now=MINUTE + 1)
    first.count(502, 0, now=MINUTE + 59)
    second.count(200, 12, now=MINUTE + 30)
    second.count(200, 8, now=MINUTE + 61)  # the next minute
    await first.flush(redis)
    await second.flush(other_process)
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
    await first.flush(redis)
    await second.flush(other_process)
    seen = first_chunk_percentiles(redis_client(), now=base + 150)
    assert seen["count"] == 100
    assert 0.2 < seen[0.5] <= 0.3  # the 50th of 100 lies in the first 90
    assert 2 < seen[0.95] <= 3  # the 95th, among the slow ten
    assert (0.2, 0.3, 2, 3) == (BUCKETS[3], BUCKETS[4], BUCKETS[9], BUCKETS[10])
    assert first_chunk_percentiles(redis_client(), now=base + 7200)[0.5] is None  # an hour with nothing streamed
