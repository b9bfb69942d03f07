"""A model's aliases on /v1/: a request naming one is served by the model (its key allow-list, log and metrics
naming the model), /v1/models lists each for a key that may use the model, and an alias no model has is a 404."""

import json
import logging

import pytest
from asgiref.sync import sync_to_async
from prometheus_client import generate_latest

from cluster import operations
from gateway.runtime import runtime
from tests.factories import make_model
from tests.gateway.views.harness import add_key, chat, key_client, openai_error, post

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

ALIASES = ["claude-sonnet-4-5", "gpt-5-codex"]


async def alias(model: str, aliases: list[str]) -> None:
    await sync_to_async(operations.set_model)(model, "test", aliases=aliases)
    await runtime().refresh()


async def test_a_request_for_an_alias_is_served_by_its_model(cluster, client, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.access")
    await alias("qwen", ALIASES)
    for name in ALIASES:
        answered = await chat(client, model=name)
        assert answered.status_code == 200, answered.content
        assert answered["X-Llmgw-Replica"] == cluster.replica.name
        # the engine gets the client's body as it came, the alias in it (an engine serves its one model)
        assert json.loads(answered.content)["echo"]["body"]["model"] == name
    embedded = await post(client, "embeddings", {"model": "gpt-5-codex", "input": "hello"})
    assert embedded.status_code == 200, embedded.content
    logged = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    assert len(logged) == 3 and all(f"model=qwen replica={cluster.replica.name} status=200" in line
                                    for line in logged), logged
    exposed = generate_latest().decode()
    assert "claude-sonnet-4-5" not in exposed and "gpt-5-codex" not in exposed  # the metrics name the model


async def test_an_alias_no_model_has_is_a_404(cluster, client):
    await alias("qwen", ALIASES)
    openai_error(await chat(client, model="claude-opus-4-1"), 404, "model_not_found")
    openai_error(await client.get("/v1/models/claude-opus-4-1"), 404, "model_not_found")
    # in each API's own shape: Claude Code asking for a name no model has gets Anthropic's not_found_error
    body = {"model": "claude-opus-4-1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    refused = json.loads((await post(client, "messages", body)).content)
    assert refused["error"] == {"type": "not_found_error", "message": "no model named 'claude-opus-4-1'"}
    await alias("qwen", [])  # cleared: no longer an alias of anything
    refused = openai_error(await chat(client, model="gpt-5-codex"), 404, "model_not_found")
    assert refused["message"] == "no model named 'gpt-5-codex'"


async def test_a_key_allowed_a_model_may_use_its_aliases_and_sees_them_listed(cluster):
    await sync_to_async(make_model)("other")
    await alias("qwen", ["anthropic/claude-x", *ALIASES])
    await alias("other", ["gpt-4o-mini"])
    everyone = key_client(cluster.secret)
    listed = json.loads((await everyone.get("/v1/models")).content)["data"]
    assert [(m["id"], m.get("alias_of")) for m in listed] == [
        ("empty", None), ("other", None), ("gpt-4o-mini", "other"), ("qwen", None),
        ("anthropic/claude-x", "qwen"), ("claude-sonnet-4-5", "qwen"), ("gpt-5-codex", "qwen")]
    only = key_client(await sync_to_async(add_key)("only-qwen", models=["qwen"]))
    listed = json.loads((await only.get("/v1/models")).content)["data"]
    assert [m["id"] for m in listed] == ["qwen", "anthropic/claude-x", "claude-sonnet-4-5", "gpt-5-codex"]
    assert listed[2] == {"id": "claude-sonnet-4-5", "object": "model", "created": 0, "owned_by": "llmgw",
                         "ready": True, "replicas_ready": 1, "routing": "prefix", "alias_of": "qwen"}
    shown = json.loads((await only.get("/v1/models/anthropic/claude-x")).content)
    assert (shown["id"], shown["alias_of"]) == ("anthropic/claude-x", "qwen")
    assert "alias_of" not in json.loads((await only.get("/v1/models/qwen")).content)
    assert (await chat(only, model="claude-sonnet-4-5")).status_code == 200
    # another model's alias is that model's: refused as it is, and not told of
    refused = openai_error(await chat(only, model="gpt-4o-mini"), 403, "model_not_allowed")
    assert refused["message"] == "this key may not use model 'other'"
    openai_error(await only.get("/v1/models/gpt-4o-mini"), 404, "model_not_found")


async def test_an_alias_added_a_moment_ago_is_found(cluster, client):
    """As a model added a moment ago: a request for a name the table does not know yet loads it again."""
    await runtime().current()
    await sync_to_async(operations.set_model)("qwen", "test", aliases=["gpt-5-codex"])
    assert (await chat(client, model="gpt-5-codex")).status_code == 200
