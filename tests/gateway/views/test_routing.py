"""Routing among a model's ready replicas: `prefix` keeps a conversation on one replica and falls back when that
one fails; `least-inflight` spreads; every answer names its replica in X-Llmgw-Replica."""

import pytest
from asgiref.sync import sync_to_async
from prometheus_client import REGISTRY

from cluster import notify
from cluster.models import Model
from gateway.affinity import Ring, choose, session_key
from gateway.models import RequestRecord
from gateway.runtime import runtime
from gateway.surfaces import SURFACES
from ground.ports import free_port
from tests.factories import make_model
from tests.gateway.views.harness import openai_error, post, ready_replica

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

METRICS = ("llmgw_upstream_attempts_count", "llmgw_upstream_attempts_sum", "llmgw_replica_wait_seconds_count")
SYSTEM = {"role": "system", "content": "You answer questions about the document you are given."}


def turns(document: str, n: int) -> list[list[dict]]:
    """The messages of each turn of one conversation: each repeats the ones before."""
    messages = [SYSTEM, {"role": "user", "content": f"The document: {document}. What is it about?"}]
    out = [list(messages)]
    for i in range(n - 1):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"and then {i}?"}]
        out.append(list(messages))
    return out


def three_replicas(cluster, routing: str, ports=None) -> list[str]:
    """Model `trio` with three ready replicas, on the test engine unless `ports` says otherwise."""
    model = make_model("trio", profile="embeds", routing=routing)
    names = [ready_replica(model, cluster.node, port).name for port in (ports or [cluster.engine.port] * 3)]
    notify.routing_changed()
    return names


async def ask(client, messages, model="trio"):
    return await post(client, "chat/completions", {"model": model, "messages": messages})


async def test_every_turn_of_a_conversation_goes_to_one_replica_and_conversations_spread(cluster, client) -> None:
    names = await sync_to_async(three_replicas)(cluster, Model.Routing.PREFIX)
    went: dict[int, set[str]] = {}
    for conversation in range(12):
        for messages in turns(f"report {conversation}", 4):
            response = await ask(client, messages)
            assert response.status_code == 200, response.content
            went.setdefault(conversation, set()).add(response["X-Llmgw-Replica"])
    assert all(len(replicas) == 1 for replicas in went.values()), went
    used = {next(iter(r)) for r in went.values()}
    assert used <= set(names) and len(used) >= 2, went  # twelve openings do not all hash to one of three
    # the replica each went to is the one the ring gives its opening, in any process that builds the ring
    ring = Ring(names)
    for conversation, replicas in went.items():
        key = SURFACES["chat/completions"].prefix_key({"messages": turns(f"report {conversation}", 1)[0]})
        assert replicas == {choose(ring, key, lambda name: 0)}
    assert not runtime().local
    # and each record says so: its prefix's replica took it, none passed over
    await runtime().books()
    routes = await sync_to_async(lambda: [r.route for r in RequestRecord.objects.filter(model="trio")])()
    assert len(routes) == 48 and all(r["policy"] == "prefix" and r["hit"] == "prefix" and not r["passed"]
                                     for r in routes), routes[:3]


async def test_a_conversations_replica_that_refuses_connections_passes_it_to_the_next(cluster, client):
    dead = free_port()  # nothing listens there
    names = await sync_to_async(three_replicas)(cluster, Model.Routing.PREFIX, [dead, cluster.engine.port, cluster.engine.port])
    ring = Ring(names)
    # a conversation whose first choice is the dead replica
    for i in range(200):
        messages = turns(f"doc {i}", 1)[0]
        order = list(ring.walk(SURFACES["chat/completions"].prefix_key({"messages": messages})))
        if order[0] == names[0]:
            break
    else:
        pytest.fail("no opening of 200 hashed to the first replica")
    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": "trio"}) or 0.0

    before = {name: sample(name) for name in METRICS}
    for messages in turns(f"doc {i}", 3):
        response = await ask(client, messages)
        assert response.status_code == 200, response.content
        assert response["X-Llmgw-Replica"] == order[1]  # the next on the ring, every turn
    # each request's record says why it went where it went: the first tried its key's replica, which failed; the
    # next ones passed over it, unreachable lately
    await runtime().books()
    kept = await sync_to_async(lambda: list(RequestRecord.objects.order_by("at", "id").values("route", "tries")))()
    first, second = kept[-3], kept[-2]
    assert [(t[0], t[3]) for t in first["tries"]] == [(names[0], first["tries"][0][3]), (order[1], "answered 200")]
    assert first["tries"][0][3].startswith("failed: ") and first["tries"][0][1] <= first["tries"][0][2]
    assert first["route"] == {"policy": "prefix", "hit": "", "chosen": f"{order[1]} (0 in flight)",
                              "passed": [[names[0], f"tried: {first['tries'][0][3]}"]]}
    assert second["route"]["passed"] == [[names[0], "unreachable lately"]] and len(second["tries"]) == 1
    grew = {name: sample(name) - before[name] for name in METRICS}
    # the first was sent twice (the dead replica, then the next); the dead one was passed over after that, for a
    # while: each found a ready replica at once
    assert grew == {"llmgw_upstream_attempts_count": 3, "llmgw_upstream_attempts_sum": 4,
                    "llmgw_replica_wait_seconds_count": 3}

    # once the while is over, one request tries it again
    gw = runtime()
    gw.unreachable[names[0]] = 0.0
    before = sample("llmgw_upstream_attempts_sum")
    response = await ask(client, turns(f"doc {i}", 1)[0])
    assert response["X-Llmgw-Replica"] == order[1] and sample("llmgw_upstream_attempts_sum") - before == 2
    assert names[0] in gw.unreachable


async def test_a_replica_passed_over_is_still_tried_when_it_is_the_only_one(cluster, client):
    dead = free_port()
    model = await sync_to_async(make_model)("solo", profile="embeds", routing=Model.Routing.PREFIX)
    name = (await sync_to_async(ready_replica)(model, cluster.node, dead)).name
    await sync_to_async(notify.routing_changed)()
    for _ in range(2):
        response = await ask(client, turns("x", 1)[0], model="solo")
        assert name in openai_error(response, 502, "upstream_error")["message"]
    assert name in runtime().unreachable


async def test_least_inflight_spreads_a_conversation_and_names_the_replica_too(cluster, client):
    names = await sync_to_async(three_replicas)(cluster, Model.Routing.LEAST_INFLIGHT)
    seen = set()
    for messages in turns("one document", 1) * 30:
        response = await ask(client, messages)
        assert response.status_code == 200
        seen.add(response["X-Llmgw-Replica"])
    assert seen == set(names)  # one after another, each idle: a random pick among all three
    await runtime().books()
    route = await sync_to_async(lambda: RequestRecord.objects.filter(model="trio").first().route)()
    assert route["policy"] == "least in flight" and route["hit"] == "" and len(route["passed"]) == 2
    assert {name for name, _ in route["passed"]} | {route["chosen"].split()[0]} == set(names)
    assert all(why.startswith("0 in flight") for _, why in route["passed"])  # as idle: admission's pick, or chance


async def test_an_answer_from_no_replica_says_so(cluster, client):
    response = await ask(client, turns("x", 1)[0], model="nope")
    openai_error(response, 404, "model_not_found")
    assert response["X-Llmgw-Replica"] == "-"
    response = await ask(client, turns("x", 1)[0], model="empty")  # nothing ready, none coming
    openai_error(response, 503, "no_replica_ready")
    assert response["X-Llmgw-Replica"] == "-"


async def test_an_agents_session_stays_on_one_replica_whatever_its_requests_open_with(cluster, client):
    """Claude Code's side requests and a compacted history open differently from the conversation: its session
    header keeps every request of the session on one replica, whichever header names it."""
    names = await sync_to_async(three_replicas)(cluster, Model.Routing.PREFIX)
    ring = Ring(names)
    for header in ("x-claude-code-session-id", "session_id", "X-Llmgw-Session"):
        for session in range(4):
            went = set()
            for opening in range(6):
                response = await post(client, "chat/completions", {"model": "trio", "messages": turns(
                    f"side request {opening}", 1)[0]}, **{header: f"session-{session}"})
                assert response.status_code == 200, response.content
                went.add(response["X-Llmgw-Replica"])
            assert went == {choose(ring, session_key(f"session-{session}"), lambda name: 0)}, (header, went)
    await runtime().books()
    hits = await sync_to_async(lambda: {r.route["hit"] for r in RequestRecord.objects.filter(model="trio")})()
    assert hits == {"session"}  # the session's replica took each, whatever it opened with
