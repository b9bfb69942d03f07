"""The routing table reloads when the channel layer says something changed."""

import asyncio
import json
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import transaction

from cluster import notify
from cluster.models import ClusterSettings
from gateway.runtime import runtime
from tests.factories import make_model
from tests.gateway.views.harness import MESSAGES, Client, ready_replica

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


async def test_the_table_reloads_on_change_after_the_first_request(cluster):
    """Background work runs in a context of its own: the first request, which starts it, must not leave the
    reloads tied to that request (its context, its task)."""
    response = await Client().post(
        "/v1/chat/completions",
        data=json.dumps({"model": "qwen", "messages": MESSAGES}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {cluster.secret}"},
    )
    assert response.status_code == 200
    gw = runtime()
    loaded = gw.table
    await asyncio.wait_for(gw.listening.wait(), 10)  # its background listener has joined the group

    def change():
        with transaction.atomic():
            notify.routing_changed()

    await sync_to_async(change)()
    deadline = time.monotonic() + 3
    while gw.table is loaded and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gw.table is not loaded


async def test_a_model_added_a_moment_ago_is_served_before_the_change_reaches_this_process(cluster):
    """The operator's `ctl model add` returned; the next request names the model before this process's listener
    has heard of it: the gateway looks again (as for a key it does not know), rather than answering 404."""
    client = Client(authorization=f"Bearer {cluster.secret}")

    async def ask(model: str):
        return await client.post("/v1/chat/completions", data=json.dumps({"model": model, "messages": MESSAGES}),
                                 content_type="application/json")

    assert (await ask("qwen")).status_code == 200  # the table is loaded
    def add_unheard():  # what `ctl model add` and its replica coming ready write, without the channel layer's word
        model = make_model("added")
        ready_replica(model, cluster.node, cluster.engine.port)

    await sync_to_async(add_unheard)()
    answer = await ask("added")
    assert answer.status_code == 200, answer.content
    missing = await ask("no-such-model")
    assert missing.status_code == 404 and json.loads(missing.content)["error"]["code"] == "model_not_found"


async def test_a_key_created_a_moment_after_a_wrong_one_was_tried_is_served_before_the_change_arrives(cluster):
    """A client tries a wrong key (the gateway looks again, finds nothing); the operator creates a key; the next
    request brings it, 90 ms after the wrong one, before this process's listener has heard of it. It waits for the
    next reload rather than being refused on the table of a moment before (a CI run: 401, the one reload a second
    spent on the wrong key)."""
    assert (await Client(authorization=f"Bearer {cluster.secret}").post(
        "/v1/chat/completions", data=json.dumps({"model": "qwen", "messages": MESSAGES}),
        content_type="application/json")).status_code == 200  # the table is loaded
    wrong = await Client(authorization="Bearer sk-llmgw-wrong").post(
        "/v1/chat/completions", data=json.dumps({"model": "qwen", "messages": MESSAGES}), content_type="application/json")
    assert wrong.status_code == 401

    def create_unheard() -> str:  # what `ctl keys create` writes, without the channel layer's word
        from gateway.models import ApiKey

        secret = ApiKey.new_secret()
        ApiKey.objects.create(name="new-key", prefix=secret[:14], key_hash=ApiKey.hash(secret))
        return secret

    secret = await sync_to_async(create_unheard)()
    answer = await Client(authorization=f"Bearer {secret}").post(
        "/v1/chat/completions", data=json.dumps({"model": "qwen", "messages": MESSAGES}), content_type="application/json")
    assert answer.status_code == 200, answer.content


async def test_a_start_a_moment_ago_is_served_before_the_change_reaches_this_process(cluster):
    """`llmgw start` returned; the next request comes before this process's listener has heard of it: the gateway
    looks again before it answers 503 system_stopped."""
    client = Client(authorization=f"Bearer {cluster.secret}")

    async def ask():
        return await client.post("/v1/chat/completions", data=json.dumps({"model": "qwen", "messages": MESSAGES}),
                                 content_type="application/json")

    await sync_to_async(ClusterSettings.objects.filter(pk=1).update)(serving_stopped=True)
    stopped = await ask()  # the table loads with the system stopped
    assert stopped.status_code == 503 and json.loads(stopped.content)["error"]["code"] == "system_stopped"
    await sync_to_async(ClusterSettings.objects.filter(pk=1).update)(serving_stopped=False)  # unheard
    runtime()._looked_again["stopped"] = 0.0  # a second since the last look
    answer = await ask()
    assert answer.status_code == 200, answer.content
