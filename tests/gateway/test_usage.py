"""gateway.usage.flush: what the web processes counted in Redis (the real one) into Usage rows and last use."""

import asyncio
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
import redis.asyncio as aioredis
from django.conf import settings
from django.db import connection

from gateway import operations
from cluster.locks import redis_client
from gateway import usage
from gateway.accounting import LAST_USED_HASH, USAGE_HASH, Ledger
from gateway.models import ApiKey, Usage
from gateway.tasks import flush_usage

HOUR = 1_772_000_000 // 3600 * 3600  # the start of an hour in 2026


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=dt_timezone.utc)


def counted(*requests) -> None:
    """What a web process puts in Redis: (key, model, prompt tokens, completion tokens, when) through a Ledger."""
    ledger = Ledger()
    for key, model, prompt, completion, when in requests:
        ledger.add(key.pk, model, prompt, completion, now=when)

    async def send():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            await ledger.flush(client)
        finally:
            await client.aclose()

    asyncio.run(send())


def rows() -> dict[tuple, tuple]:
    return {
        (u.key.name, u.model, u.hour): (u.requests, u.prompt_tokens, u.completion_tokens)
        for u in Usage.objects.select_related("key")
    }


def left_in_redis() -> list[str]:
    r = redis_client()
    return sorted(k.decode() for k in (*r.keys(f"{USAGE_HASH}*"), *r.keys(f"{LAST_USED_HASH}*")))


@pytest.fixture
def keys(db):
    return operations.create_key("alice", "test")[0], operations.create_key("bob", "test")[0]


def test_flush_aggregates_per_key_model_and_hour(keys):
    alice, bob = keys
    counted(
        (alice, "qwen", 10, 5, HOUR + 1),
        (alice, "qwen", 20, 7, HOUR + 1800),
        (alice, "smol", 3, 3, HOUR + 3599),
        (alice, "qwen", 1, 1, HOUR + 3600),  # the next hour
    )
    counted((bob, "qwen", 4, 2, HOUR + 60))  # another web process
    assert usage.flush() == 4
    assert rows() == {
        ("alice", "qwen", at(HOUR)): (2, 30, 12),
        ("alice", "smol", at(HOUR)): (1, 3, 3),
        ("alice", "qwen", at(HOUR + 3600)): (1, 1, 1),
        ("bob", "qwen", at(HOUR)): (1, 4, 2),
    }
    assert left_in_redis() == []  # moved, not copied
    assert usage.flush() == 0  # and not counted twice
    assert rows()[("alice", "qwen", at(HOUR))] == (2, 30, 12)


def test_flush_adds_to_existing_rows(keys):
    alice, _ = keys
    Usage.objects.create(key=alice, model="qwen", hour=at(HOUR), requests=10, prompt_tokens=100, completion_tokens=50)
    counted((alice, "qwen", 5, 1, HOUR + 10))
    usage.flush()
    counted((alice, "qwen", 2, 2, HOUR + 20), (alice, "qwen", 3, 3, HOUR + 30))
    usage.flush()
    assert rows() == {("alice", "qwen", at(HOUR)): (13, 110, 56)}


def test_flush_updates_last_used_and_never_moves_it_back(keys):
    alice, bob = keys
    now = datetime.now(dt_timezone.utc).timestamp()
    counted((alice, "qwen", 1, 1, now - 30), (alice, "qwen", 1, 1, now - 5))
    ApiKey.objects.filter(pk=bob.pk).update(last_used_at=at(now))
    counted((bob, "qwen", 1, 1, now - 100))  # older than what the database already has
    usage.flush()
    alice.refresh_from_db()
    bob.refresh_from_db()
    assert abs((alice.last_used_at - at(now - 5)).total_seconds()) < 0.001
    assert bob.last_used_at == at(now)


def test_flush_ignores_deleted_keys(keys):
    alice, bob = keys
    counted((alice, "qwen", 1, 1, HOUR), (bob, "qwen", 9, 9, HOUR))
    bob_pk = bob.pk
    bob.delete()
    assert usage.flush() == 1
    assert rows() == {("alice", "qwen", at(HOUR)): (1, 1, 1)}
    assert not Usage.objects.filter(key_id=bob_pk).exists()
    assert left_in_redis() == []  # dropped, not retried forever


def test_counts_arriving_during_a_flush_wait_for_the_next(keys):
    alice, _ = keys
    counted((alice, "qwen", 10, 10, HOUR + 1))
    arrived = []

    def a_web_process_counts_meanwhile(execute, sql, params, many, context):
        if not arrived:  # at the flush's first database query: Redis has been read already
            arrived.append(sql)
            counted((alice, "qwen", 5, 5, HOUR + 2))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(a_web_process_counts_meanwhile):
        usage.flush()
    assert arrived
    assert rows() == {("alice", "qwen", at(HOUR)): (1, 10, 10)}
    assert redis_client().exists(USAGE_HASH)  # waiting in the live hash
    usage.flush()
    assert rows() == {("alice", "qwen", at(HOUR)): (2, 15, 15)}
    assert left_in_redis() == []


def test_a_flush_the_database_refused_is_taken_again(keys):
    alice, _ = keys
    counted((alice, "qwen", 10, 10, HOUR + 1))

    def database_fails(execute, sql, params, many, context):
        if "usage" in sql.lower() and sql.lstrip().upper().startswith(("INSERT", "UPDATE")):
            raise RuntimeError("the database went away")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(database_fails), pytest.raises(RuntimeError):
        usage.flush()
    assert not Usage.objects.exists()
    assert [k for k in left_in_redis() if usage.BATCH in k]  # the batch waits in Redis
    counted((alice, "qwen", 1, 1, HOUR + 2))  # and new counts arrive meanwhile
    assert usage.flush() == 1
    assert rows() == {("alice", "qwen", at(HOUR)): (2, 11, 11)}
    assert left_in_redis() == []


def test_one_flush_at_a_time(keys):
    alice, _ = keys
    counted((alice, "qwen", 1, 1, HOUR))
    other = redis_client().lock(usage.LOCK_KEY, timeout=30)
    assert other.acquire(blocking=False)
    assert usage.flush() == 0  # another flush is at work: leave everything to it
    assert not Usage.objects.exists() and redis_client().exists(USAGE_HASH)
    other.release()
    assert flush_usage() == 1  # the beat task
    assert rows() == {("alice", "qwen", at(HOUR)): (1, 1, 1)}


def test_a_malformed_field_does_not_block_the_flush(keys):
    alice, _ = keys
    counted((alice, "qwen", 1, 1, HOUR))
    redis_client().hset(USAGE_HASH, mapping={"garbage": 1, f"{HOUR}|x|qwen|requests": 1})
    redis_client().hset(LAST_USED_HASH, "not-a-key", "soon")
    assert usage.flush() == 1
    assert rows() == {("alice", "qwen", at(HOUR)): (1, 1, 1)}
    assert left_in_redis() == []


def test_flushed_usage_is_what_the_report_shows(keys):
    alice, bob = keys
    counted((alice, "qwen", 10, 5, HOUR), (bob, "smol", 1, 1, HOUR + 3600))
    usage.flush()
    report = operations.usage_report(key="alice")
    assert report == [
        {"key": "alice", "model": "qwen", "hour": at(HOUR), "requests": 1, "prompt_tokens": 10, "completion_tokens": 5}
    ]
    assert [r["key"] for r in operations.usage_report(since=at(HOUR) + timedelta(minutes=90))] == ["bob"]
