"""A key's rate limits (gateway/limits.py) on real Redis: per-minute windows on Redis's clock, shared by every web
process, reserve then settle for tokens, Retry-After; and counted in the process alone while Redis is away."""

import asyncio
import json
import time

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from django.conf import settings

from cluster.locks import redis_client
from gateway.errors import GatewayError
from gateway.limits import Limits, prefix
from gateway.redis_reach import Reach
from gateway.table import KeyInfo

pytestmark = pytest.mark.asyncio


ID = 970_000  # far from the keys other tests make (their gateways' settles may still land a moment after them)


def key(id: int = ID, rpm: int | None = None, tpm: int | None = None) -> KeyInfo:
    return KeyInfo(id=id, name=f"key-{id}", prefix="sk-llmgw-abcde", models=frozenset(), rpm=rpm, tpm=tpm,
                   expires_at=None, revoked=False)


def redis_minute() -> tuple[int, float]:
    """Redis's minute, and the seconds left in it."""
    seconds, micro = redis_client().time()
    now = seconds + micro / 1e6
    return int(now // 60), 60 - now % 60


@pytest.fixture(autouse=True)
def inside_one_minute():
    """A test here runs inside one of Redis's minutes: started within its last 3 s, it waits for the next."""
    _, left = redis_minute()
    if left < 3:
        time.sleep(left + 0.05)
    r = redis_client()
    for name in r.keys(f"llmgw:rl:{ID // 10}*"):
        r.delete(name)


@pytest_asyncio.fixture
async def processes():
    """Two web processes' limits on one Redis: shared through Redis, not memory."""
    clients = [aioredis.Redis.from_url(settings.REDIS_URL) for _ in range(2)]
    yield [Limits(c, Reach(c)) for c in clients]
    for c in clients:
        await c.aclose()


def limit_keys() -> list[str]:
    return sorted(k.decode() if isinstance(k, bytes) else k for k in redis_client().keys(f"llmgw:rl:{ID}*"))


async def refusal(limits, k, reserve: int = 0) -> GatewayError:
    with pytest.raises(GatewayError) as refused:
        await limits.check(k, reserve)
    return refused.value


async def test_requests_per_minute_across_processes(processes):
    one, two = processes
    k = key(rpm=3)
    for limits in (one, two, one):
        await limits.check(k)
    refused = await refusal(two, k)
    minute, left = redis_minute()
    assert (refused.status, refused.code) == (429, "rate_limited") and "3 requests per minute" in refused.message
    assert abs(refused.retry_after - left) <= 1  # until Redis's minute is over
    assert limit_keys() == [f"{prefix(ID)}r:{minute}"]
    assert 0 < redis_client().ttl(f"{prefix(ID)}r:{minute}") <= 120  # counters expire: no key lives on


async def test_a_past_minutes_count_is_not_this_ones_and_windows_are_per_key(processes):
    one, _ = processes
    minute, _ = redis_minute()
    redis_client().set(f"{prefix(ID + 1)}r:{minute - 1}", 99, ex=60)  # the last minute was busy
    await one.check(key(id=ID + 1, rpm=1))
    await refusal(one, key(id=ID + 1, rpm=1))
    await one.check(key(id=ID + 2, rpm=1))  # another key's window is its own


async def test_a_key_without_limits_writes_nothing(processes):
    one, _ = processes
    for _ in range(5):
        assert await one.check(key()) is None
    await one.settle(key(rpm=10), 500, 0, None)  # tokens are counted only for a tpm limit
    assert limit_keys() == []


async def test_tokens_are_reserved_when_admitted_and_settled_when_used(processes):
    """16 requests at once on a tpm key, each of which may use 40 tokens: only as many as the limit holds are let
    in (reserve, then settle), whichever web process they come through."""
    one, two = processes
    k = key(tpm=100)
    tried = await asyncio.gather(*((one if i % 2 else two).check(k, 40) for i in range(16)), return_exceptions=True)
    admitted = [m for m in tried if not isinstance(m, Exception)]
    assert len(admitted) == 3  # 0, 40, 80 used and reserved: under 100; the fourth finds 120
    assert all(isinstance(e, GatewayError) and e.status == 429 for e in tried if isinstance(e, Exception))
    minute, _ = redis_minute()
    assert admitted == [minute] * 3
    name = f"{prefix(ID)}t:{minute}"
    assert int(redis_client().get(name)) == 120
    for m in admitted:  # each used 10, not 40: the reservations go, what they used stays
        await one.settle(k, 10, 40, m)
    assert int(redis_client().get(name)) == 30
    await one.check(k, 40)  # room again
    refused = await refusal(two, key(tpm=70), 0)  # 70 of 70: at the limit is over it
    assert "70 tokens per minute" in refused.message


async def test_a_settle_for_a_count_redis_lost_makes_none(processes):
    """A restarted Redis lost the minute's count: the request that reserved in it settles to nothing (not a count
    below zero that would let the key past its limit)."""
    one, _ = processes
    k = key(tpm=100)
    minute = await one.check(k, 90)
    redis_client().delete(f"{prefix(ID)}t:{minute}")
    await one.settle(k, 5, 90, minute)
    assert redis_client().get(f"{prefix(ID)}t:{minute}") is None


async def test_retry_after_is_the_rest_of_redis_minute_in_the_apis_shape(processes):
    one, _ = processes
    k = key(rpm=1)
    await one.check(k)
    refused = await refusal(one, k)
    response = refused.response()
    assert response.status == 429 and response["Retry-After"] == str(refused.retry_after)
    assert json.loads(response.body) == {
        "error": {"message": refused.message, "type": "rate_limit_error", "code": "rate_limited"}}


async def test_with_redis_away_each_process_counts_alone_and_waits_on_it_no_more_than_a_quarter_second():
    from ground.ports import free_port

    gone = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    reach = Reach(gone)
    limits = Limits(gone, reach)
    k = key(rpm=2, tpm=100)
    started = time.monotonic()
    minute = await limits.check(k, 60)
    assert time.monotonic() - started < 0.6 and reach.away and minute is not None and minute < 0
    await limits.settle(k, 10, 60, minute)  # counted here: 10 of 100
    started = time.monotonic()
    await limits.check(k, 60)  # the second request: Redis is not asked again
    assert time.monotonic() - started < 0.05
    assert "2 requests per minute" in (await refusal(limits, k)).message
    await reach.aclose()
    await gone.aclose()
