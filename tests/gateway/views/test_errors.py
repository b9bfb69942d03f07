"""/v1/ errors, OpenAI-shaped: keys, models, bad bodies, limits, stopped, no replica ready, a replica refusing."""

import asyncio
import logging
import re
import secrets
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone
from prometheus_client import generate_latest

from cluster import operations, reconciler, reports
from cluster.models import Event, Node, Replica
from gateway import operations as gateway_operations
from gateway.models import ApiKey
from gateway.runtime import runtime
from ground.ports import free_port
from tests.factories import make_model, make_replica, node_facts
from tests.gateway.views.harness import (
    MESSAGES,
    Client,
    add_key,
    becomes_ready,
    chat,
    key_client,
    openai_error,
    post,
    ready_replica,
)

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


# Errors


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer sk-llmgw-not-a-key", "Bearer revoked", "Bearer expired"],
)
async def test_401_invalid_api_key(cluster, authorization):
    secrets_by_name = {
        "revoked": await sync_to_async(add_key)("revoked"),
        "expired": await sync_to_async(add_key)("expired", expires_at=timezone.now() + timedelta(days=1)),
    }
    await sync_to_async(gateway_operations.revoke_key)("revoked", "test")
    await sync_to_async(ApiKey.objects.filter(name="expired").update)(expires_at=timezone.now() - timedelta(seconds=1))
    headers = {}
    if authorization is not None:
        word = authorization.split(" ", 1)[-1]
        headers["Authorization"] = f"Bearer {secrets_by_name[word]}" if word in secrets_by_name else authorization
    client = Client(**headers)
    openai_error(await chat(client), 401, "invalid_api_key")
    openai_error(await client.get("/v1/models"), 401, "invalid_api_key")


async def test_403_model_not_allowed(cluster):
    secret = await sync_to_async(add_key)("only-empty", models=["empty"])
    client = key_client(secret)
    openai_error(await chat(client), 403, "model_not_allowed")


async def test_404s(client):
    openai_error(await chat(client, model="nope"), 404, "model_not_found")
    openai_error(await client.get("/v1/nope"), 404, "not_found")
    for path in ("/v1x", "/metrics/", "/metricsX", "/v1x/models"):
        openai_error(await client.get(path), 404, "not_found")
    openai_error(await client.post("/v1/audio/speech", data="{}", content_type="application/json"), 404, "not_found")


async def test_unknown_model_names_do_not_grow_the_metrics(client, caplog):
    # any key holder could otherwise add a Prometheus series per name, and the web process's memory with it
    caplog.set_level(logging.INFO, logger="llmgw.access")  # a CLI command run in this process may have raised it
    before = generate_latest().decode()
    for start in range(0, 300, 50):  # fifty at once: they share the reload an unknown name waits for
        answers = await asyncio.gather(*(chat(client, model=f"no-such-model-{i}\n{secrets.token_hex(8)}")
                                         for i in range(start, start + 50)))
        for answer in answers:
            openai_error(answer, 404, "model_not_found")
    exposed = generate_latest().decode()
    assert "no-such-model" not in exposed
    assert 'llmgw_requests_total{model="unknown",status="404"}' in exposed
    labels = set(re.findall(r'model="([^"]*)"', exposed)) - set(re.findall(r'model="([^"]*)"', before))
    assert labels <= {"unknown"}, labels
    assert len(exposed) - len(before) < 10_000  # one label value's series (a histogram's buckets), not 300
    logged = [r.getMessage() for r in caplog.records if r.name == "llmgw.access" and "no-such-model-299" in r.getMessage()]
    assert logged and "\n" not in logged[0]  # the name as asked, quoted: one line per request


@pytest.mark.parametrize(
    "endpoint, body, words",
    [
        ("chat/completions", "{not json", "not valid JSON"),
        ("chat/completions", b"\xff\xfe", "not valid JSON"),
        ("chat/completions", "", "not valid JSON"),
        ("chat/completions", "[1, 2]", "JSON object"),
        ("chat/completions", {"messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": 5, "messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": "", "messages": MESSAGES}, "`model` is required"),
        ("chat/completions", {"model": "qwen"}, "`messages` is required"),
        ("chat/completions", {"model": "qwen", "messages": "hi"}, "`messages` must be a list"),
        ("chat/completions", {"model": "qwen", "messages": MESSAGES, "stream": "yes"}, "`stream`"),
        ("chat/completions", {"model": "qwen", "messages": MESSAGES, "stream_options": 1}, "`stream_options`"),
        ("completions", {"model": "qwen"}, "`prompt` is required"),
        ("embeddings", {"model": "qwen"}, "`input` is required"),
    ],
)
async def test_400_invalid_request(client, endpoint, body, words):
    error = openai_error(await post(client, endpoint, body), 400, "invalid_request")
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_json_nested_too_deep_is_a_400_and_no_traceback(client, caplog):
    deep = '{"model": "qwen", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for endpoint in ("chat/completions", "completions", "embeddings"):
        error = openai_error(await post(client, endpoint, deep), 400, "invalid_request")
        assert "nested too deeply" in error["message"]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_413_over_the_gateways_limit(client, settings):
    settings.LLMGW_MAX_BODY_BYTES = 2000
    response = await chat(client, messages=[{"role": "user", "content": "x" * 3000}])
    assert "2000 bytes" in openai_error(response, 413, "request_too_large")["message"]
    assert (await chat(client, messages=[{"role": "user", "content": "x" * 1000}])).status_code == 200


async def test_405_for_a_get_on_a_post_endpoint(client):
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_429_requests_per_minute(cluster):
    secret = await sync_to_async(add_key)("limited", rpm=2)
    client = key_client(secret)
    assert (await chat(client)).status_code == 200
    assert (await chat(client)).status_code == 200
    response = await chat(client)
    if response.status_code == 200:  # the minute turned between the requests: a new window
        response = await chat(client)
    assert "2 requests per minute" in openai_error(response, 429, "rate_limited")["message"]
    assert 1 <= int(response["Retry-After"]) <= 60


async def test_429_tokens_per_minute(cluster):
    secret = await sync_to_async(add_key)("tokens", tpm=8)
    client = key_client(secret)
    assert (await chat(client)).status_code == 200  # 3 + 5 tokens: the limit, reached
    response = await chat(client)
    if response.status_code == 200:  # the minute turned
        response = await chat(client)
    assert "8 tokens per minute" in openai_error(response, 429, "rate_limited")["message"]
    assert 1 <= int(response["Retry-After"]) <= 60


async def test_503_system_stopped_before_anything_else(cluster, client):
    await sync_to_async(operations.stop_serving)("test")
    error = openai_error(await chat(client), 503, "system_stopped")
    assert "stopped" in error["message"]
    response = await post(Client(), "embeddings", "{not json")  # no key, no JSON: stopped is said first
    openai_error(response, 503, "system_stopped")
    assert int(response["Retry-After"]) > 0
    assert (await client.get("/v1/models")).status_code == 200  # looking is not serving

    await sync_to_async(operations.start_serving)("test")
    await runtime().refresh()  # what the change event does in a running process
    assert (await chat(client)).status_code == 200


async def test_503_no_replica_ready_when_none_is_on_its_way(client):
    response = await chat(client, model="empty")
    assert "none is on its way" in openai_error(response, 503, "no_replica_ready")["message"]
    assert int(response["Retry-After"]) > 0


async def test_503_no_replica_ready_after_waiting_for_one(cluster, client):
    def starting_model():
        model = make_model("starting", wait_seconds=1)
        make_replica(model, cluster.node, state=Replica.State.STARTING, port=free_port())

    await sync_to_async(starting_model)()
    response = await chat(client, model="starting")
    assert "waited 1s" in openai_error(response, 503, "no_replica_ready")["message"]
    assert response["Retry-After"]


async def test_a_request_waits_for_a_replica_that_becomes_ready(cluster, client):
    def starting_model():
        model = make_model("restarting", wait_seconds=20)
        return make_replica(model, cluster.node, state=Replica.State.STARTING, port=cluster.engine.port)

    replica = await sync_to_async(starting_model)()
    waiting = asyncio.create_task(chat(client, model="restarting"))
    done, _ = await asyncio.wait({waiting}, timeout=0.3)
    assert not done, "it waits for the replica on its way, not answering 503 at once"

    await sync_to_async(becomes_ready)(replica)
    response = await asyncio.wait_for(waiting, 15)
    assert response.status_code == 200, response.content


async def test_a_request_waits_for_a_replica_whose_node_is_on_its_way_back(cluster, client):
    """`llmgw up` started again: its model wants a replica that only its node can take, and the node's agent
    reconnects a few seconds after the reconciler's first pass. The request waits for that replica, as for one
    starting, instead of 503 "no node is connected" at once."""
    def restarted():
        Node.objects.filter(pk=cluster.node.pk).update(connected=False, last_seen=timezone.now() - timedelta(seconds=3),
                                                       facts=node_facts())
        model = make_model("back", replicas=1, memory_bytes=1024**3, wait_seconds=20)
        reconciler.reconcile_once()
        return model

    model = await sync_to_async(restarted)()
    waiting = asyncio.create_task(chat(client, model="back"))
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done, "it waits for the replica its node will take, not answering 503 at once"

    def agent_back():
        reports.connected(Node.objects.get(pk=cluster.node.pk), "127.0.0.1")
        reconciler.reconcile_once()
        replica = Replica.objects.get(model=model, node=cluster.node)  # placed on it
        Replica.objects.filter(pk=replica.pk).update(port=cluster.engine.port)
        becomes_ready(replica)

    await sync_to_async(agent_back)()
    response = await asyncio.wait_for(waiting, 15)
    assert response.status_code == 200, response.content


async def test_a_replica_that_refuses_connections_is_skipped(cluster, client):
    await sync_to_async(ready_replica)(cluster.model, cluster.node, free_port())  # nothing listens there
    for _ in range(12):
        assert (await chat(client)).status_code == 200
    assert not runtime().local


async def test_unknown_keys_from_one_address_wait_longer_each_time(cluster, settings):
    settings.LLMGW_AUTH_FREE_FAILURES = 3

    async def ask(address: str, secret: str):
        return await chat(Client(address, Authorization=f"Bearer {secret}"))

    for _ in range(4):
        openai_error(await ask("203.0.113.5", "sk-llmgw-guess"), 401, "invalid_api_key")
    refused = await ask("203.0.113.5", cluster.secret)  # a good key from there waits too
    said = openai_error(refused, 429, "rate_limited")
    assert said["message"] == "too many unknown API keys from your address; try again in 1 s"
    assert refused["Retry-After"] == "1"
    assert (await ask("198.51.100.7", cluster.secret)).status_code == 200  # another address does not
    thrown = await sync_to_async(lambda: list(Event.objects.filter(kind="auth.throttled").values_list("subject", "data")))()
    assert thrown == [("203.0.113.5", {"door": "gateway", "who": "address", "failures": 4})]
    # a key that exists but is revoked or expired is no guess, and not counted
    secret = await sync_to_async(add_key)("soon-revoked")
    await sync_to_async(gateway_operations.revoke_key)("soon-revoked", "test")
    await runtime().refresh()  # what the change event does in a running process (a reload may still be on its way)
    for _ in range(5):
        openai_error(await ask("192.0.2.1", secret), 401, "invalid_api_key")
    assert (await ask("192.0.2.1", cluster.secret)).status_code == 200


def anthropic_error(response, status: int, kind: str) -> str:
    import json

    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    body = json.loads(response.content)
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


async def test_messages_errors_are_anthropics_and_keys_come_by_x_api_key_too(cluster, client, settings):
    """Each in Anthropic's shape, so its SDK raises its own exception; the key by `x-api-key` as Claude Code
    sends it. (Served answers: tests/integration/test_agent_apis.py, against llama.cpp's server.)"""
    body = {"model": "qwen", "max_tokens": 4, "messages": MESSAGES}
    anthropic_error(await Client().post("/v1/messages", data=__import__("json").dumps(body)), 401, "authentication_error")
    by_header = Client(**{"x-api-key": cluster.secret})
    anthropic_error(await post(by_header, "messages", {**body, "model": "nope"}), 404, "not_found_error")
    anthropic_error(await post(by_header, "messages", {**body, "messages": "x"}), 400, "invalid_request_error")
    anthropic_error(await post(by_header, "messages/count_tokens", {"model": "qwen"}), 400, "invalid_request_error")
    said = anthropic_error(await post(by_header, "messages", {**body, "model": "empty"}), 503, "overloaded_error")
    assert "no replica of empty is ready" in said
    anthropic_error(await by_header.post("/v1/messages/nothing", data="{}"), 404, "not_found_error")
    settings.LLMGW_MAX_BODY_BYTES = 100
    anthropic_error(await post(by_header, "messages", {**body, "system": "x" * 200}), 413, "request_too_large")
    # the Responses API's stay OpenAI's
    openai_error(await post(by_header, "responses", {"model": "qwen", "input": "hi", "previous_response_id": "r"}), 400,
                 "invalid_request")
