"""A key's token budget and its maximum of requests at once, through the gateway's views: reserved before the
engine sees a request (concurrent requests cannot overspend), settled to what it used, seeded from the database's
usage (a restart, a period changed), refused with a 429 that names the budget and its reset, an Event per key
and reason a minute. tests/engine.py as the engine, real Redis."""

import asyncio
import datetime as dt

import pytest
from asgiref.sync import sync_to_async

from cluster.locks import redis_client
from cluster.models import Event
from gateway import budgets, operations
from gateway.models import ApiKey, Usage
from gateway.runtime import runtime
from gateway.spend import Bucket
from tests.gateway.views.harness import add_key, chat, key_client, openai_error, read

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


def count_of(name: str, period: str) -> str:
    key = ApiKey.objects.get(name=name)
    now = dt.datetime.now(dt.UTC)
    return Bucket(key.id, period, budgets.period_start(period, now), budgets.period_end(period, now)).name


def held(name: str) -> int:
    """What Redis counts against the budget: the database's spend and every web process's part."""
    found = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in redis_client().hgetall(name).items()}
    return found.get("db", 0) + sum(v for k, v in found.items() if k.startswith("p:"))


async def events(kind: str, subject: str) -> list:
    return await sync_to_async(lambda: list(Event.objects.filter(kind=kind, subject=subject)))()


async def settled() -> None:
    await asyncio.sleep(0.3)  # the settle runs as the answer goes out


async def test_a_budget_is_reserved_settled_and_refused_once_spent(cluster):
    secret = await sync_to_async(add_key)("capped", budget_tokens=60, budget_period="day")
    client = key_client(secret)
    answered = await chat(client, max_tokens=10)
    assert answered.status_code == 200
    await settled()
    name = await sync_to_async(count_of)("capped", "day")
    used = held(name)
    assert 0 < used < 40  # what it used (prompt and five words), not the 10 + prompt it reserved
    # a request that may use more than is left is refused before the engine sees it
    refused = await chat(client, max_tokens=50)
    error = openai_error(refused, 429, "budget_exceeded")
    assert "key capped has" in error["message"] and "tokens left of its budget of 60 tokens per day" in error["message"]
    assert "ask for fewer max tokens" in error["message"] and "it resets at" in error["message"]
    assert 0 < int(refused["Retry-After"]) <= 86400
    redis_client().hset(name, "db", 60)
    for _ in range(3):
        spent = await chat(client, max_tokens=1)
        assert openai_error(spent, 429, "budget_exceeded")["message"].startswith("key capped has used its budget")
    await settled()
    assert len(await events("key.budget_reached", "capped")) == 1
    assert len(await events("key.refused", "capped")) == 1  # one a minute, not one per request


async def test_concurrent_requests_cannot_overspend(cluster, slow_engine):
    from tests.factories import make_model, make_profile
    from tests.gateway.views.harness import ready_replica

    await sync_to_async(lambda: ready_replica(make_model("slow", profile=make_profile(parallel=8).name), cluster.node,
                                              slow_engine.port))()
    secret = await sync_to_async(add_key)("tight", budget_tokens=100, budget_period="day")
    client = key_client(secret)
    await runtime().refresh()
    # streams still running hold their reservations (~40 of 100 each, more than they will use): the third of
    # three at once is refused before the engine sees it, whatever the first two will use
    running = [await chat(client, model="slow", stream=True, max_tokens=30) for _ in range(2)]
    assert [r.status_code for r in running] == [200, 200]
    refused = await chat(client, model="slow", stream=True, max_tokens=30)
    assert "tokens left of its budget of 100 tokens per day" in openai_error(refused, 429, "budget_exceeded")["message"]
    for answer in running:
        await read(answer)
    await settled()
    # settled to what they used, which never passes the budget
    assert 0 < held(await sync_to_async(count_of)("tight", "day")) <= 100


async def test_the_count_comes_from_the_database_when_redis_has_none_and_a_new_period_counts_afresh(cluster):
    secret = await sync_to_async(add_key)("seeded", budget_tokens=1000, budget_period="day")
    client = key_client(secret)

    def usage():
        key = ApiKey.objects.get(name="seeded")
        now = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
        Usage.objects.create(key=key, model="qwen", hour=now, requests=1, prompt_tokens=600, completion_tokens=400)
        start = budgets.period_start("month", now)
        if start < budgets.period_start("day", now):  # an earlier day of this month (none on the 1st)
            Usage.objects.create(key=key, model="qwen", hour=start, requests=1, prompt_tokens=5000, completion_tokens=0)
        return start < budgets.period_start("day", now)

    earlier = await sync_to_async(usage)()
    redis_client().delete(await sync_to_async(count_of)("seeded", "day"))
    refused = await chat(client, max_tokens=1)  # a restarted Redis: the database says 1000 of 1000 used
    assert openai_error(refused, 429, "budget_exceeded")["message"].startswith("key seeded has used its budget")
    await sync_to_async(operations.set_key)("seeded", "test", budget_tokens=100_000, budget_period="month")
    await runtime().refresh()
    answered = await chat(client, max_tokens=1)
    assert answered.status_code == 200
    await settled()
    month = held(await sync_to_async(count_of)("seeded", "month"))
    assert month >= (6000 if earlier else 1000)  # the month's usage, not the day's count carried over


async def test_a_keys_requests_at_once_are_bounded(cluster, slow_engine):
    from tests.factories import make_model, make_profile
    from tests.gateway.views.harness import ready_replica

    await sync_to_async(lambda: ready_replica(make_model("slow", profile=make_profile(parallel=4).name), cluster.node,
                                              slow_engine.port))()
    secret = await sync_to_async(add_key)("single", max_concurrency=1)
    client = key_client(secret)
    await runtime().refresh()
    first = await chat(client, model="slow", stream=True)
    assert first.status_code == 200
    second = await chat(client, model="slow")
    error = openai_error(second, 429, "concurrency_limit")
    assert error["message"] == "key single has 1 requests in flight already (its max concurrency)"
    assert second["Retry-After"] == "1"
    await read(first)
    await settled()
    assert (await chat(client, model="slow", max_tokens=2)).status_code == 200
