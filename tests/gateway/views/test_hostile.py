"""/v1/ against careless and hostile clients, before any engine spends anything: a body is read only once the key
is known, a prompt that cannot fit the model's context is refused, content nested without end is a 400, answers
that would multiply in size are held to the model's caps, and a key sees only the models it may use."""

import asyncio
import json
import logging

import pytest
from asgiref.sync import sync_to_async

from cluster.models import Profile
from gateway.runtime import runtime
from gateway.urls import application
from tests.factories import make_model
from tests.gateway.views.harness import add_key, chat, key_client, openai_error, post, ready_replica

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


def sent_to_no_engine(caplog, model: str, status: int = 400) -> None:
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access" and f"model={model} " in r.getMessage()]
    assert lines and all(f"replica=- status={status}" in line for line in lines), lines


async def ask(headers: dict, body_parts: list[bytes]) -> tuple[dict, list[bytes]]:
    """One request to the gateway's ASGI application whose body comes in parts, as a slow client sends it; the
    answer's start, and the parts the application asked for before answering."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000), "server": ("testserver", 80),
    }
    taken: list[bytes] = []
    parts = list(body_parts)

    async def receive():
        if parts:
            part = parts.pop(0)
            taken.append(part)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await asyncio.Event().wait()  # a client that stays

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await application()(scope, receive, send)
    return sent[0], taken


async def test_a_client_without_a_key_is_answered_from_its_headers_before_its_body(cluster):
    """Twenty 7 MB bodies without a key held 122 MiB of the web processes: now not a byte of one is read, and the
    connection is closed after the 401 (what is left of the body on it is not the next request)."""
    parts = [b"x" * (1 << 20)] * 7
    headers = {"content-type": "application/json", "content-length": str(7 << 20)}
    for who in ({}, {"authorization": "Bearer sk-llmgw-nobody"}):
        start, taken = await ask({**headers, **who}, parts)
        assert start["status"] == 401 and taken == []
        assert (b"connection", b"close") in start["headers"]
    # with the key, the body is read (and this one, not JSON, refused for what it is)
    start, taken = await ask({**headers, "authorization": f"Bearer {cluster.secret}"}, parts)
    assert start["status"] == 400 and len(taken) == 7
    assert (b"connection", b"close") not in start["headers"]


async def test_a_prompt_that_cannot_fit_the_context_never_reaches_an_engine(cluster, client, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.access")
    await sync_to_async(Profile.objects.create)(name="small", context_size=1024, extra_args=["--embeddings"])
    model = await sync_to_async(make_model)("tiny", profile="small")
    await sync_to_async(ready_replica)(model, cluster.node, cluster.engine.port)
    await runtime().refresh()
    # 100,000 one-word messages kept an engine templating for minutes: a token each at least, and their text
    many = [{"role": "user", "content": "word"}] * 100_000
    refused = openai_error(await chat(client, "tiny", messages=many), 400, "context_length_exceeded")
    assert refused["message"] == ("the request (at least 106250 tokens) is longer than model tiny's context "
                                  "(1024 tokens)")
    refused = openai_error(await post(client, "completions", {"model": "tiny", "prompt": list(range(2000))}), 400,
                           "context_length_exceeded")
    assert "at least 2000 tokens" in refused["message"]
    text = "word " * 20_000  # 100,000 bytes: at least 1,562 tokens however long a vocabulary's tokens are
    openai_error(await post(client, "embeddings", {"model": "tiny", "input": text}), 400, "context_length_exceeded")
    sent_to_no_engine(caplog, "tiny")
    # what may fit goes through: a long text, an image whose tokens the gateway cannot know
    assert (await chat(client, "tiny", messages=[{"role": "user", "content": "word " * 1000}])).status_code == 200
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 200_000}}
    seen = await chat(client, "qwen", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    assert seen.status_code != 400 or b"context" not in seen.content


async def test_content_nested_without_end_is_a_400_not_a_traceback(client, caplog):
    caplog.set_level(logging.INFO)
    deep = "x"
    for _ in range(900):
        deep = [deep]
    for endpoint, body in (("chat/completions", {"messages": [{"role": "user", "content": deep}]}),
                           ("completions", {"prompt": deep}), ("embeddings", {"input": deep})):
        refused = openai_error(await post(client, endpoint, {"model": "qwen", **body}), 400, "invalid_request")
        assert refused["message"] == "the prompt is nested too deeply"
    assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"


async def test_what_multiplies_an_answer_is_held_to_the_models_caps(cluster, client):
    for field, value in (("n_probs", 21), ("top_logprobs", 21), ("n", 9), ("best_of", 9)):
        refused = openai_error(await chat(client, **{field: value}), 400, "invalid_request")
        setting = "max-choices" if field in ("n", "best_of") else "max-logprobs"
        most = 20 if setting == "max-logprobs" else 8
        assert refused["message"] == f"`{field}` may be at most {most} for model qwen (its {setting})"
    openai_error(await post(client, "completions", {"model": "qwen", "prompt": "x", "logprobs": 50}), 400,
                 "invalid_request")
    openai_error(await chat(client, n_probs="many"), 400, "invalid_request")
    for fields in ({"n_probs": 20}, {"logprobs": True, "top_logprobs": 20}, {"n": 1}):
        assert (await chat(client, **fields)).status_code == 200
    # a model's settings change them, none lifts them
    await sync_to_async(type(cluster.model).objects.filter(pk=cluster.model.pk).update)(max_logprobs=None, max_choices=2)
    await runtime().refresh()
    assert (await chat(client, n_probs=1000)).status_code == 200
    openai_error(await chat(client, n=3), 400, "invalid_request")


async def test_a_key_lists_only_the_models_it_may_use(cluster):
    await sync_to_async(make_model)("other")
    await runtime().refresh()
    everyone = key_client(cluster.secret)
    listed = json.loads((await everyone.get("/v1/models")).content)
    assert {m["id"] for m in listed["data"]} >= {"qwen", "other"}
    only = key_client(await sync_to_async(add_key)("only-qwen", models=["qwen"]))
    listed = json.loads((await only.get("/v1/models")).content)
    assert [m["id"] for m in listed["data"]] == ["qwen"]
    assert (await only.get("/v1/models/qwen")).status_code == 200
    openai_error(await only.get("/v1/models/other"), 404, "model_not_found")
