"""/v1/ passing requests through to a real engine: the engine key swapped in, streams as they come, usage.

The engine answers only with the engine key, so every 200 here also proves the gateway swapped the client's key
for it. With --echo-body it sends back the body and headers it received."""

import json
import time

import pytest
from asgiref.sync import sync_to_async

from cluster.locks import redis_client
from gateway.models import Usage
from gateway.runtime import runtime
from tests.gateway.views.harness import (
    ANSWER,
    ENGINE_KEY,
    MESSAGES,
    Client,
    chat,
    events,
    openai_error,
    post,
    read,
)

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


# Passing through


async def test_chat_passes_through_with_the_engine_key_only(cluster):
    client = Client(
        **{
            "Authorization": f"Bearer {cluster.secret}",
            "User-Agent": "my-client/1.0",
            "X-Forwarded-For": "203.0.113.9",
            "OpenAI-Organization": "org-client",
            "X-Client-Secret": "client-only",
        }
    )
    client.cookies["session"] = "client-cookie"
    body = {
        "model": "qwen",
        "messages": MESSAGES,
        "temperature": 0.2,
        "a_field_no_one_knows": {"nested": [1, "two", None, {"x": 1.5}]},
        "engine_specific": "kept",
    }
    response = await post(client, "chat/completions", body)
    assert response.status_code == 200, response.content
    answer = json.loads(response.content)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == ANSWER
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    received = answer["echo"]
    assert received["body"] == {**body, "max_tokens": 4096}  # unknown fields arrive untouched; the model's cap added
    assert received["headers"]["authorization"] == f"Bearer {ENGINE_KEY}"
    seen = json.dumps(received["headers"])
    for client_value in (cluster.secret, "my-client", "client-cookie", "203.0.113.9", "org-client", "client-only"):
        assert client_value not in seen
    assert not {"cookie", "x-forwarded-for", "openai-organization", "x-client-secret"} & set(received["headers"])

    assert await usage_counted("ci", "qwen") == [1, 3, 5]
    # and the minute's traffic, for the dashboard's charts (read once the minute is over)
    from gateway.accounting import traffic

    minutes = traffic(redis_client(), 2, now=time.time() + 60)  # this minute and the one before (a boundary)
    assert [sum(m[k] for m in minutes) for k in ("requests", "errors", "tokens")] == [1, 0, 8]


async def usage_counted(key: str, model: str) -> list[int]:
    """Requests, prompt and completion tokens counted for the key and model, in the database."""
    await runtime().books()  # what is left of it: the gateway writes it every second

    def rows():
        return list(Usage.objects.filter(key__name=key, model=model).values_list(
            "requests", "prompt_tokens", "completion_tokens"))

    return [sum(column) for column in zip(*await sync_to_async(rows)())] or [0, 0, 0]


async def test_stream_passes_through_and_hides_the_usage_chunk_it_asked_for(client, cluster):
    response = await chat(client, stream=True)
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    got = events(await read(response))
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"] for c in chunks) and not any("usage" in c for c in chunks)

    assert await usage_counted("ci", "qwen") == [1, 3, 5]  # the gateway asked for usage upstream all the same


async def test_stream_with_usage_asked_for_keeps_the_usage_chunk(client):
    got = events(await read(await chat(client, stream=True, stream_options={"include_usage": True})))
    assert got[-1] == "[DONE]"
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 5


async def test_completions_embeddings_and_models(client, cluster):
    response = await post(client, "completions", {"model": "qwen", "prompt": "count", "max_tokens": 2})
    assert response.status_code == 200
    assert json.loads(response.content)["choices"][0] == {
        "index": 0,
        "text": "one two",
        "logprobs": None,
        "finish_reason": "length",
    }
    streamed = events(await read(await post(client, "completions", {"model": "qwen", "prompt": "x", "stream": True})))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == ANSWER

    response = await post(client, "embeddings", {"model": "qwen", "input": ["a", "b"]})
    assert response.status_code == 200
    assert [len(d["embedding"]) for d in json.loads(response.content)["data"]] == [8, 8]

    listed = json.loads((await client.get("/v1/models")).content)
    assert listed["object"] == "list"
    assert [(m["id"], m["ready"]) for m in listed["data"]] == [("empty", False), ("qwen", True)]
    detail = await client.get("/v1/models/qwen")
    assert json.loads(detail.content)["id"] == "qwen"
    openai_error(await client.get("/v1/models/nope"), 404, "model_not_found")
