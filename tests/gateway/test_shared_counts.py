"""`prefix` routing weighs the in-flight counts of every web process (gateway/runtime.py): before it moves a request
off its key's replica because that one looks busy, it reads the other processes' counts again, so a request that
ended in another process a moment ago does not move a conversation (a cold prefill on another engine). Real Redis."""

import secrets
import time

import pytest
import pytest_asyncio

from cluster import inflight
from cluster.models import Model
from gateway.affinity import Ring
from gateway.runtime import Gateway
from gateway.surfaces import SURFACES
from gateway.table import ModelRoute, Upstream

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def gw():
    gateway = Gateway()
    yield gateway
    await gateway.aclose()


@pytest.fixture
def route():
    names = [f"m-{secrets.token_hex(4)}" for _ in range(3)]  # no other test's counts name them
    ready = tuple(Upstream(name, f"http://127.0.0.1:{9000 + i}", "k") for i, name in enumerate(names))
    return ModelRoute("m", 30, ready=ready, routing=Model.Routing.PREFIX, ring=Ring(names))


KEY = SURFACES["chat/completions"].prefix_key({"messages": [{"role": "user", "content": "the annual report"}]})


async def test_a_replica_that_looked_busy_is_read_again_before_a_request_moves_off_it(gw, route):
    home = next(route.ring.walk(KEY))
    other = inflight.PREFIX + f"test-{secrets.token_hex(4)}"
    try:
        # read when another process had 3 in flight there, which have ended since
        gw.shared, gw._shared_at = {home: 3}, time.monotonic() - 1
        assert (await gw.choose(route, (), KEY)).replica == home
        assert gw.shared.get(home, 0) == 0

        # still busy in Redis: past the bound (ceil(2 × 4 / 3) = 3), the request moves to the ring's next
        await gw.redis.hset(other, mapping={home: 3})
        gw.shared, gw._shared_at = {home: 3}, 0.0
        moved = await gw.choose(route, (), KEY)
        assert moved.replica != home and gw.shared[home] == 3

        # read a moment ago: trusted without another read
        await gw.redis.delete(other)
        gw._shared_at = time.monotonic()
        assert (await gw.choose(route, (), KEY)).replica == moved.replica
    finally:
        await gw.redis.delete(other)


async def test_a_request_on_its_replica_or_routed_by_load_reads_nothing(gw, route):
    home = next(route.ring.walk(KEY))
    gw._shared_at = 0.0
    assert (await gw.choose(route, (), KEY)).replica == home
    assert gw._shared_at == 0.0  # no read: nothing moved
    by_load = ModelRoute("m", 30, ready=route.ready)
    gw.shared = {u.replica: 5 for u in route.ready if u.replica != home}
    assert (await gw.choose(by_load, (), None)).replica == home
    assert gw._shared_at == 0.0
