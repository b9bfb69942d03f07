"""A web process's gateway as it stops (gateway/runtime.py: `Gateway.aclose`, the ASGI `lifespan`): its books
finished first, the last usage in the database and every reservation settled, however recently the requests
ended. Real Redis and the test database."""

import asyncio
import secrets
import time

import pytest
from asgiref.sync import sync_to_async

from cluster.locks import redis_client
from gateway import operations
from gateway import runtime as gateway_runtime
from gateway.models import Usage
from gateway.runtime import Gateway
from gateway.table import KeyInfo
from llmgw.web import said_stopping

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def a_key(**budget) -> int:
    return (await sync_to_async(operations.create_key)(f"k-{secrets.token_hex(3)}", "test", **budget))[0].pk


async def usage_of(key_id: int, model: str) -> dict[str, int]:
    rows = await sync_to_async(lambda: list(Usage.objects.filter(key_id=key_id, model=model).values()))()
    return {"requests": sum(r["requests"] for r in rows), "prompt": sum(r["prompt_tokens"] for r in rows),
            "completion": sum(r["completion_tokens"] for r in rows)}


async def test_closing_waits_for_the_ended_requests_settles_then_writes_the_last_usage():
    gw = Gateway()
    key_id = await a_key(budget_tokens=1000, budget_period="day")
    key = KeyInfo(id=key_id, name="k", prefix="sk-llmgw-x", models=frozenset(), rpm=None, tpm=None, expires_at=None,
                  revoked=False, budget_tokens=1000, budget_period="day")
    hold = await gw.budgets.reserve(key, 100, gw.now())  # a request reserved 100 tokens of its budget, used 8

    async def ends_a_moment_later():
        await asyncio.sleep(0.3)
        gw.ledger.add(key_id, "m", 3, 5)
        gw.budgets.settle(hold, 8)

    gw.spawn(ends_a_moment_later())
    await gw.aclose()
    assert await usage_of(key_id, "m") == {"requests": 1, "prompt": 3, "completion": 5}
    found = {k.decode(): int(v) for k, v in redis_client().hgetall(hold.bucket.name).items()}
    assert found == {"db": 8}, "the reservation was left standing, or the spend not read back"


async def test_closing_is_bounded_when_what_a_request_left_never_ends():
    gw = Gateway()
    gw.spawn(asyncio.sleep(3600))
    started = time.monotonic()
    await gw.aclose(wait=0.2)
    assert time.monotonic() - started < 2


async def test_the_lifespans_shutdown_closes_this_loops_gateway_with_its_books():
    """What uvicorn says at its shutdown, and llmgw.web says for daphne at its (`said_stopping`)."""
    gw = gateway_runtime.runtime()
    key_id = await a_key()
    gw.ledger.add(key_id, "m", 2, 4)
    await said_stopping(gateway_runtime.lifespan)
    assert await usage_of(key_id, "m") == {"requests": 1, "prompt": 2, "completion": 4}
    assert gateway_runtime._runtimes.get(asyncio.get_running_loop()) is None  # a next request would start anew


async def test_a_gateway_that_served_closes_at_once_when_nothing_is_left_to_do():
    gw = Gateway()
    gw._start_background()  # as its first request does: the change feed heard, the counts shared
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await gw.aclose()
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("on", [True, False])
async def test_a_finished_request_is_recorded_with_the_books_unless_the_records_are_off(settings, on):
    from gateway.call import Call
    from gateway.models import RequestRecord

    settings.LLMGW_REQUEST_LOG = on
    gw = Gateway()
    Call(request_id="r-1", surface="embeddings", gw=gw).finish(200)
    await gw.books()
    assert await sync_to_async(RequestRecord.objects.filter(request_id="r-1", status=200).count)() == int(on)
    await gw.aclose()
