"""A rollout's share of the traffic: new conversations go to its canary at the rollout's share, every turn of one
conversation to the same side (prefix routing or not), a canary that fails is failed over to the current side
without the client seeing it, a rollout no longer watching takes nothing, and a shadow copies requests to the
canary that no client waits for."""

import asyncio
import datetime as dt
import time

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from cluster import notify
from cluster.models import Model, Rollout
from gateway import rollout_figures
from gateway.models import RequestRecord
from gateway.runtime import runtime
from ground.ports import free_port
from tests.factories import make_model
from tests.gateway.views.harness import Engine, post, read, ready_replica

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


def with_canary(cluster, routing: str, share: float, canary_port: int | None = None) -> tuple[list[str], str]:
    """Model `duo`: two current replicas and one canary of a rollout watching at `share`."""
    model = make_model("duo", profile="embeds", routing=routing)
    current = [ready_replica(model, cluster.node, cluster.engine.port).name for _ in range(2)]
    rollout = Rollout.objects.create(model=model, actor="test", traffic=share, change={"profile": ["a", "b"]})
    canary = ready_replica(model, cluster.node, canary_port or cluster.engine.port)
    canary.rollout = rollout
    canary.save()
    notify.routing_changed()
    return current, canary.name


def conversation(n: int, turn: int) -> list[dict]:
    messages = [{"role": "user", "content": f"conversation {n}: tell me about item {n * 7919}"}]
    for i in range(turn):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"and {i}?"}]
    return messages


async def sides(client, conversations: int, turns: int) -> dict[int, set[str]]:
    went: dict[int, set[str]] = {}
    for n in range(conversations):
        for turn in range(turns):
            response = await post(client, "chat/completions", {"model": "duo", "messages": conversation(n, turn)})
            assert response.status_code == 200, response.content
            went.setdefault(n, set()).add(response["X-Llmgw-Replica"])
    return went


@pytest.mark.parametrize("routing", [Model.Routing.PREFIX, Model.Routing.LEAST_INFLIGHT])
async def test_new_conversations_go_to_the_canary_at_its_share_and_stay_on_their_side(cluster, client, routing):
    current, canary = await sync_to_async(with_canary)(cluster, routing, 0.3)
    went = await sides(client, 40, 3)
    on_canary = [n for n, replicas in went.items() if canary in replicas]
    assert all(replicas == {canary} for n, replicas in went.items() if n in on_canary), went  # never mixed
    assert all(replicas <= set(current) for n, replicas in went.items() if n not in on_canary), went
    assert 4 <= len(on_canary) <= 22, f"{len(on_canary)} of 40 conversations on a canary at 30%"
    # their records say so: a canary chosen is one, and the other side is passed over as that
    await runtime().books()  # what the process writes every second anyway
    records = await sync_to_async(lambda: list(RequestRecord.objects.filter(model="duo")))()
    on = [r for r in records if r.replica == canary]
    assert on and all(r.route["chosen"].endswith(", a rollout's canary") for r in on)
    off = [r for r in records if r.replica != canary]
    assert all([canary, "a rollout's canary: not this conversation's side"] in r.route["passed"] for r in off
               if routing == Model.Routing.LEAST_INFLIGHT or canary in [p[0] for p in r.route["passed"]])


async def test_a_canary_that_fails_is_failed_over_to_the_current_side_unseen(cluster, client):
    current, canary = await sync_to_async(with_canary)(cluster, Model.Routing.PREFIX, 1.0, canary_port=free_port())
    went = await sides(client, 6, 2)  # every conversation is the canary's; none reaches it
    assert set().union(*went.values()) <= set(current)


async def test_a_rollout_that_no_longer_watches_takes_no_traffic(cluster, client):
    current, canary = await sync_to_async(with_canary)(cluster, Model.Routing.LEAST_INFLIGHT, 1.0)
    assert {canary} == set().union(*(await sides(client, 3, 1)).values())

    def aborted():
        Rollout.objects.update(state=Rollout.State.ABORTED)
        notify.routing_changed()

    gw = runtime()
    await asyncio.wait_for(gw.listening.wait(), 10)  # its listener hears the change
    await sync_to_async(aborted)()
    deadline = time.monotonic() + 5
    while gw.table is not None and gw.table.models["duo"].canary and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert set().union(*(await sides(client, 10, 1)).values()) <= set(current)


async def test_a_shadow_copies_requests_to_the_canary_and_no_client_waits_for_it(cluster, client, tmp_path):
    """--traffic 0% --shadow 100%: every answer from the current side, a copy of each at the canary (a slow one,
    that nothing waits for), its record the canary's figures."""
    slow = Engine(tmp_path, "--answer", "A copied answer of six words.", "--first-token-ms", "300")
    try:
        def setup():
            current, canary = with_canary(cluster, Model.Routing.PREFIX, 0.0, canary_port=slow.port)
            Rollout.objects.update(shadow=1.0)
            notify.routing_changed()
            return current, canary

        current, canary = await sync_to_async(setup)()
        began = time.monotonic()
        for n in range(3):
            response = await post(client, "chat/completions", {"model": "duo", "messages": conversation(n, 0)})
            assert response.status_code == 200 and response["X-Llmgw-Replica"] in current
            streamed = await post(client, "chat/completions", {"model": "duo", "stream": True,
                                                               "messages": conversation(n + 10, 0)})
            assert streamed["X-Llmgw-Replica"] in current and b"[DONE]" in await read(streamed)
        assert time.monotonic() - began < 1.5  # six answers, none of them waiting 300 ms for its copy

        def copies():
            return list(RequestRecord.objects.filter(model="duo", shadow=True))

        deadline = time.monotonic() + 10
        while len(await sync_to_async(copies)()) < 6 and time.monotonic() < deadline:
            await runtime().books()
            await asyncio.sleep(0.1)
        shadows = await sync_to_async(copies)()
        assert len(shadows) == 6 and {r.replica for r in shadows} == {canary}
        assert all(r.request_id.endswith(".shadow") and r.status == 200 and r.key_id is None for r in shadows)
        assert all(r.ttft_ms >= 300 for r in shadows if r.streamed) and sum(r.streamed for r in shadows) == 3
        assert all(r.completion_tokens > 0 for r in shadows)
        since = timezone.now() - dt.timedelta(minutes=1)
        on_canary, on_current = await sync_to_async(rollout_figures.sides)("duo", frozenset({canary}), since)
        assert (on_canary.requests, on_canary.errors, on_canary.timed) == (6, 0, 3)
        assert (on_current.requests, on_current.timed) == (6, 3) and on_canary.ttft_p50 > on_current.ttft_p50 + 250
    finally:
        slow.stop()
