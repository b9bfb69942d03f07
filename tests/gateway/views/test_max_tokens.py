"""/v1/ holds a completion to the model's and the key's cap on tokens: set when the client asks for none,
lowered when it asks for more, by whichever name it asks (max_tokens, max_completion_tokens, llama.cpp's
n_predict, whose -1 is "no limit")."""

import json

import pytest
from asgiref.sync import sync_to_async

from cluster.models import Model
from gateway.runtime import runtime
from tests.gateway.views.harness import MESSAGES, add_key, chat, events, key_client, openai_error, post, read

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


async def cap(model: str, tokens: int | None) -> None:
    await sync_to_async(Model.objects.filter(name=model).update)(max_tokens=tokens)
    await runtime().refresh()


async def sent(client, **fields) -> dict:
    """What reached the engine."""
    response = await chat(client, **fields)
    assert response.status_code == 200, response.content
    return json.loads(response.content)["echo"]["body"]


async def test_the_models_cap_is_set_when_none_is_asked_and_lowers_what_is_more(client):
    await cap("qwen", 3)
    assert (await sent(client))["max_tokens"] == 3
    answer = json.loads((await chat(client)).content)
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
    assert (await sent(client, max_tokens=100))["max_tokens"] == 3
    assert (await sent(client, max_tokens=2))["max_tokens"] == 2  # less than the cap: as asked
    assert (await sent(client, max_tokens=None))["max_tokens"] == 3
    assert await sent(client, max_completion_tokens=50) == {"model": "qwen", "messages": MESSAGES,
                                                             "max_completion_tokens": 3}
    assert (await sent(client, n_predict=-1))["n_predict"] == 3
    both = await sent(client, n_predict=10_000, max_tokens=1)
    assert both == {"model": "qwen", "messages": MESSAGES, "n_predict": 3, "max_tokens": 1}
    # streamed, and text completions
    streamed = events(await read(await chat(client, stream=True)))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1]) == "one two three"
    done = json.loads((await post(client, "completions", {"model": "qwen", "prompt": "x", "max_tokens": 9})).content)
    assert done["usage"]["completion_tokens"] == 3
    # embeddings generate nothing: no cap is added
    embedded = await post(client, "embeddings", {"model": "qwen", "input": "x"})
    assert embedded.status_code == 200


async def test_a_keys_cap_is_below_the_models(cluster):
    small = key_client(await sync_to_async(add_key)("small", max_tokens=2))
    large = key_client(await sync_to_async(add_key)("large", max_tokens=50))
    plain = key_client(await sync_to_async(add_key)("plain"))
    await cap("qwen", 4)  # and the gateway reloads, keys and all
    assert (await sent(small))["max_tokens"] == 2
    assert (await sent(small, max_tokens=3))["max_tokens"] == 2
    assert (await sent(large))["max_tokens"] == 4  # the model's is the smaller
    # a model without a cap of llmgw's: the key's alone, and with neither the body goes as it came
    await cap("qwen", None)
    assert (await sent(large))["max_tokens"] == 50
    assert await sent(plain, temperature=0.5) == {"model": "qwen", "messages": MESSAGES, "temperature": 0.5}


@pytest.mark.parametrize("value", ["lots", 2.5, True, [1]])
async def test_a_max_tokens_that_is_no_whole_number_is_a_400(client, value):
    refused = openai_error(await chat(client, max_tokens=value), 400, "invalid_request")
    assert refused["message"] == "`max_tokens` must be a whole number"
