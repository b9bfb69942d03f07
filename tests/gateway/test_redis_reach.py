"""Whether a web process can reach Redis (gateway/redis_reach.py), on real Redis: one that does not answer in time
is away, and one that answered while this process was held up (not scheduled on a busy machine, or a callback
that ran long) is not: admission would fail open on it (issue 39's CI: an engine let in more than its slots while
`llmgw restart` started every process at once on two cores). On asyncio's loop and on uvloop, the web process's."""

import asyncio
import socket
import time

import pytest
import redis.asyncio as aioredis
import uvloop
from django.conf import settings

from gateway.redis_reach import Reach, RedisAway

NOTHING = ["llmgw:test:reach:nothing"]  # a list nobody pushes to: BLPOP answers None after its timeout


async def held_up_while_redis_answers() -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    await client.ping()  # connected
    reach = Reach(client)
    loop = asyncio.get_running_loop()
    # Redis answers in 20 ms; from 5 ms on, the process is held up for twice the wait
    loop.call_later(0.005, time.sleep, reach.wait * 2)
    assert await reach.call(client.blpop(NOTHING, timeout=0.02)) is None
    assert not reach.away
    # through another task, as admission's answers come (its batch's call, then the request's future)
    answered = loop.create_future()

    async def batch() -> None:
        answered.set_result(await client.blpop(NOTHING, timeout=0.02))

    task = loop.create_task(batch())
    loop.call_later(0.005, time.sleep, reach.wait * 2)
    assert await reach.call(asyncio.shield(answered)) is None
    assert not reach.away
    await task
    await reach.aclose()
    await client.aclose()


async def silent_redis() -> None:
    quiet = socket.socket()  # accepts (the kernel does) and never answers
    quiet.bind(("127.0.0.1", 0))
    quiet.listen()
    client = aioredis.Redis(host="127.0.0.1", port=quiet.getsockname()[1])
    reach = Reach(client)
    started = time.monotonic()
    with pytest.raises(RedisAway):
        await reach.call(client.ping())
    assert reach.away and time.monotonic() - started < reach.wait + 0.1
    with pytest.raises(RedisAway):  # not asked again while away
        await reach.call(client.ping())
    await reach.aclose()
    await client.aclose()
    quiet.close()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_an_answer_that_came_while_the_process_was_held_up_counts_and_redis_is_not_away(run):
    run(held_up_while_redis_answers())


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_redis_that_does_not_answer_is_away_within_the_wait(run):
    run(silent_redis())
