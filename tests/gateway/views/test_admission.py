"""Admission through the gateway's views (gateway/admission.py): a replica's slots bound what reaches its engine,
the rest wait in a fair order, and a request refused a slot gets its API's error shape with Retry-After before any
byte. tests/engine.py as the engine, real Redis."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async

from cluster.inflight import queued
from cluster.locks import redis_client
from cluster.models import Model, Replica
from gateway.models import ApiKey
from gateway.runtime import runtime
from tests.factories import make_model, make_profile, make_replica
from tests.gateway.views.harness import (
    MESSAGES,
    add_key,
    becomes_ready,
    chat,
    key_client,
    openai_error,
    post,
    read,
    ready_replica,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture(autouse=True)
def admission_on(settings):
    """LLMGW_ADMISSION=1, as the gateway of each test (made on its first request) reads it."""
    settings.LLMGW_ADMISSION = True


@pytest.fixture
def one_slot(cluster, slow_engine):
    """Model `narrow`: one replica of one slot on the slow engine (a stream takes about 3 s)."""
    return ready_replica(make_model("narrow", profile=make_profile(parallel=1).name), cluster.node, slow_engine.port)


async def test_one_slot_one_stream_in_the_engine_and_a_quiet_key_goes_before_a_flood(one_slot):
    flood_key, quiet_key = await sync_to_async(lambda: (add_key("flood"), add_key("quiet")))()
    flood, quiet = key_client(flood_key), key_client(quiet_key)
    gw = runtime()
    first = await chat(flood, model="narrow", stream=True)
    assert first.status_code == 200
    assert gw.local == {one_slot.name: 1}
    queued = [asyncio.create_task(chat(flood, model="narrow", stream=True)) for _ in range(2)]
    await asyncio.sleep(0.3)
    late = asyncio.create_task(chat(quiet, model="narrow", stream=True))
    await asyncio.sleep(0.3)
    assert gw.local == {one_slot.name: 1}  # the engine has one request; three wait in the gateway
    assert not any(t.done() for t in [*queued, late])
    await read(first)
    done, _ = await asyncio.wait([*queued, late], return_when=asyncio.FIRST_COMPLETED)
    assert done == {late}  # the key with no service yet, though it came last
    await read(late.result())
    for t in queued:
        await read(await t)
    assert not gw.local


async def test_a_full_queue_is_a_429_and_a_long_wait_a_503_each_in_its_apis_shape(one_slot):
    await sync_to_async(lambda: Model.objects.filter(name="narrow").update(queue_limit=1, max_wait_seconds=1))()
    secret = await sync_to_async(add_key)("k")
    client = key_client(secret)
    await runtime().refresh()
    holding = await chat(client, model="narrow", stream=True)
    waiting = asyncio.create_task(chat(client, model="narrow"))
    await asyncio.sleep(0.3)
    full = await chat(client, model="narrow")
    error = openai_error(full, 429, "queue_full")
    assert "model narrow has 1 requests waiting already" in error["message"] and full["Retry-After"] == "2"
    anthropic = await post(client, "messages", {"model": "narrow", "max_tokens": 8, "messages": MESSAGES})
    assert anthropic.status_code == 429 and json.loads(anthropic.content)["error"]["type"] == "rate_limit_error"
    late = await waiting  # waited its second for the slot the stream still holds
    error = openai_error(late, 503, "queue_timeout")
    assert "had no free slot for 1s" in error["message"] and late["Retry-After"] == "5"
    await read(holding)


async def test_a_request_may_lower_its_class_with_a_header_and_a_bad_one_is_a_400(cluster, client):
    answered = await post(client, "chat/completions", {"model": "qwen", "messages": MESSAGES},
                          **{"X-Llmgw-Priority": "batch"})
    assert answered.status_code == 200
    refused = await post(client, "chat/completions", {"model": "qwen", "messages": MESSAGES},
                         **{"X-Llmgw-Priority": "urgent"})
    error = openai_error(refused, 400, "invalid_request")
    assert error["message"].startswith("X-Llmgw-Priority must be one of interactive, standard, batch")


async def test_an_interactive_key_finds_a_slot_held_back_from_batch(cluster, slow_engine):
    await sync_to_async(lambda: ready_replica(make_model("pair", profile=make_profile(parallel=2).name), cluster.node,
                                              slow_engine.port))()
    vip, bulk = await sync_to_async(lambda: (add_key("vip"), add_key("bulk")))()
    await sync_to_async(lambda: ApiKey.objects.filter(name="vip").update(priority="interactive"))()
    await sync_to_async(lambda: ApiKey.objects.filter(name="bulk").update(priority="batch"))()
    vip, bulk = key_client(vip), key_client(bulk)
    await runtime().refresh()
    assert (await read(await chat(vip, model="pair", stream=True)))  # the interactive class was just active
    flood = [asyncio.create_task(chat(bulk, model="pair", stream=True)) for _ in range(3)]
    await asyncio.sleep(0.5)
    assert sum(t.done() for t in flood) == 1  # one slot of two held back
    quick = await asyncio.wait_for(chat(vip, model="pair", stream=True), 1.0)
    assert quick.status_code == 200
    await read(quick)
    for t in flood:
        await read(await t)


async def test_with_redis_out_of_reach_requests_go_straight_to_an_engine(cluster, client, caplog):
    """Admission fails open: no order for a while, but no request lost to a Redis restart or failover."""
    import redis.asyncio as aioredis

    from gateway.admission import Admission
    from ground.ports import free_port

    gw = runtime()
    await gw.current()
    gone = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    working, gw.admission = gw.admission, Admission(gone)
    try:
        for _ in range(3):
            answered = await chat(client)
            assert answered.status_code == 200
        said = [r.message for r in caplog.records if "Redis did not answer" in r.message]
        assert len(said) == 1 and "requests go on without it" in said[0]  # said once, not per request
    finally:
        await gw.admission.aclose()
        await gone.aclose()
        gw.admission = working


async def test_requests_for_a_model_on_its_way_wait_in_its_queue_and_go_in_its_order(cluster, slow_engine):
    def starting():
        model = make_model("loading", profile=make_profile(parallel=1).name, wait_seconds=20)
        return make_replica(model, cluster.node, state=Replica.State.STARTING, port=slow_engine.port)

    replica = await sync_to_async(starting)()
    flood_key, quiet_key = await sync_to_async(lambda: (add_key("flood"), add_key("quiet")))()
    flood, quiet = key_client(flood_key), key_client(quiet_key)
    floods = [asyncio.create_task(chat(flood, model="loading", stream=True)) for _ in range(3)]
    await asyncio.sleep(0.4)
    late = asyncio.create_task(chat(quiet, model="loading", stream=True))
    await asyncio.sleep(0.4)
    # waiting for the load in the model's queue: seen (ctl models, the autoscaler), and kept in its order
    assert (await sync_to_async(queued)(redis_client(), ["loading"]))["loading"][0] == 4

    await sync_to_async(becomes_ready)(replica)
    done, _ = await asyncio.wait([*floods, late], timeout=15, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and late not in done  # one of the first come, as no key has had any service yet
    first = done.pop()
    assert first.result().status_code == 200
    await read(first.result())
    floods.remove(first)
    done, _ = await asyncio.wait([*floods, late], timeout=15, return_when=asyncio.FIRST_COMPLETED)
    assert done == {late}  # then the key with no service, though it came last
    assert late.result().status_code == 200
    await read(late.result())
    for t in asyncio.as_completed(floods):  # each read as it is answered: an unread stream holds its slot
        answer = await t
        assert answer.status_code == 200, answer.content
        await read(answer)
