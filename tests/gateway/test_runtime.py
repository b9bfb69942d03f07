"""A web process's gateway as it stops (gateway/runtime.py: `Gateway.aclose`, the ASGI `lifespan`): its books
finished first, the last usage in Redis and every reservation settled, however recently the requests ended.
Real Redis."""

import asyncio
import secrets
import time

import pytest

from cluster.locks import redis_client
from gateway import runtime as gateway_runtime
from gateway.accounting import USAGE_HASH, settle_budget
from gateway.runtime import Gateway
from llmgw.web import said_stopping

pytestmark = pytest.mark.asyncio


def usage_of(key_id: int, model: str) -> dict[str, int]:
    hour = int(time.time() // 3600) * 3600
    found = redis_client().hgetall(USAGE_HASH)
    prefix = f"{hour}|{key_id}|{model}|"
    return {k.decode()[len(prefix):]: int(v) for k, v in found.items() if k.decode().startswith(prefix)}


async def test_closing_waits_for_the_ended_requests_settles_then_sends_the_last_usage():
    gw = Gateway()
    key_id, budget = secrets.randbelow(10**9) + 10**9, f"llmgw:budget:test-{secrets.token_hex(4)}"
    r = redis_client()
    r.set(budget, 100, ex=60)  # a request reserved 100 tokens of its key's budget, and used 8

    async def settles_a_moment_later():
        await asyncio.sleep(0.3)
        await settle_budget(gw.redis, budget, used=8, reserved=100)

    gw.ledger.add(key_id, "m", 3, 5)  # counted a moment ago: the next flush was a second away
    gw.spawn(settles_a_moment_later())
    await gw.aclose()
    assert int(r.get(budget)) == 8, "the reservation was left standing"
    assert usage_of(key_id, "m") == {"requests": 1, "prompt": 3, "completion": 5}
    r.delete(budget)


async def test_closing_is_bounded_when_what_a_request_left_never_ends():
    gw = Gateway()
    gw.spawn(asyncio.sleep(3600))
    started = time.monotonic()
    await gw.aclose(wait=0.2)
    assert time.monotonic() - started < 2


async def test_the_lifespans_shutdown_closes_this_loops_gateway_with_its_books():
    """What uvicorn says at its shutdown, and llmgw.web says for daphne at its (`said_stopping`)."""
    gw = gateway_runtime.runtime()
    key_id = secrets.randbelow(10**9) + 10**9
    gw.ledger.add(key_id, "m", 2, 4)
    await said_stopping(gateway_runtime.lifespan)
    assert usage_of(key_id, "m") == {"requests": 1, "prompt": 2, "completion": 4}
    assert gateway_runtime._runtimes.get(asyncio.get_running_loop()) is None  # a next request would start anew


async def test_a_gateway_that_served_closes_at_once_when_nothing_is_left_to_do():
    gw = Gateway()
    gw._start_background()  # as its first request does: the change feed heard, the counts shared
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await gw.aclose()
    assert time.monotonic() - started < 0.5
