"""/v1/ refusing what a model cannot serve, and an engine's own errors in the gateway's words: its 4xx as the
client's 4xx, its 5xx as a 502, OpenAI-shaped, naming no engine host or port."""

import json
import logging

import pytest
from asgiref.sync import sync_to_async

from cluster.models import ClusterSettings, EngineVersion, Profile
from gateway.runtime import runtime
from ground.ports import free_port
from tests.factories import make_model
from tests.gateway.views.harness import ENGINE_KEY, add_key, chat, key_client, openai_error, post, ready_replica

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


def looks(content: list) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *content]}]


@pytest.fixture
def models(cluster):
    """On the same engine: `texty` (llama.cpp, the default profile: chat and completions only), `seeing`
    (llama.cpp with a projector: images and audio too), `pooled` (vLLM with --task embed: embeddings only) and
    `declared` (a command engine declaring embeddings and messages)."""
    Profile.objects.create(name="projector", extra_args=["--mmproj", "/models/mmproj.gguf"])
    Profile.objects.create(name="pooling", extra_args=["--task", "embed"])
    EngineVersion.objects.create(name="mine", kind="command", command="{python} e.py --port {port}",
                                 serves=["embeddings", "messages"])
    for name, engine, profile in (("texty", "llama.cpp", "default"), ("seeing", "llama.cpp", "projector"),
                                  ("pooled", "vllm", "pooling"), ("declared", "mine", "default")):
        ready_replica(make_model(name, engine=engine, profile=profile), cluster.node, cluster.engine.port)


def not_sent(caplog, model: str) -> None:
    """The access-log line of a request no replica saw."""
    (line,) = [r.getMessage() for r in caplog.records if r.name == "llmgw.access" and f"model={model}" in r.getMessage()]
    assert "replica=- status=400" in line, line


async def test_what_a_model_cannot_serve_is_refused_before_any_engine_sees_it(models, client, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.access")
    refused = openai_error(await post(client, "embeddings", {"model": "texty", "input": "hi"}), 400, "not_supported")
    assert refused["message"] == ("model texty does not serve embeddings (it serves chat completions, text"
                                  " completions, Anthropic Messages, Responses)")
    not_sent(caplog, "texty")
    caplog.clear()
    refused = openai_error(await chat(client, "texty", messages=looks([IMAGE])), 400, "not_supported")
    assert refused["message"] == "model texty does not take images"
    refused = openai_error(await chat(client, "texty", messages=looks([AUDIO]), stream=True), 400, "not_supported")
    assert refused["message"] == "model texty does not take audio"
    refused = openai_error(await chat(client, "pooled"), 400, "not_supported")
    assert refused["message"] == "model pooled does not serve chat completions (it serves embeddings, rerank)"
    refused = openai_error(await post(client, "completions", {"model": "pooled", "prompt": "x"}), 400, "not_supported")
    assert refused["message"] == "model pooled does not serve text completions (it serves embeddings, rerank)"
    refused = openai_error(await chat(client, "declared"), 400, "not_supported")
    assert refused["message"] == "model declared does not serve chat completions (it serves embeddings, Anthropic Messages)"

    # what each does serve goes through
    assert (await chat(client, "texty", messages=looks([]))).status_code == 200
    assert (await chat(client, "seeing", messages=looks([IMAGE, AUDIO]))).status_code == 200
    assert (await post(client, "embeddings", {"model": "pooled", "input": "hi"})).status_code == 200
    assert (await post(client, "embeddings", {"model": "declared", "input": "hi"})).status_code == 200
    assert (await post(client, "embeddings", {"model": "qwen", "input": "hi"})).status_code == 200


# What llama.cpp (xllamacpp 0.2) answers, word for word, and what the client gets instead.
REFUSALS = [
    pytest.param(
        "embeddings",
        {"status": 501, "type": "not_supported_error", "code": 501,
         "message": "This server does not support embeddings. Start it with `--embeddings`"},
        400, "not_supported", "model qwen does not serve embeddings", id="501-no-embeddings",
    ),
    pytest.param(
        "chat/completions",
        {"status": 500, "type": "server_error", "code": 500,
         "message": "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"},
        400, "not_supported", "model qwen does not take images", id="500-no-images",
    ),
    pytest.param(
        "completions",
        {"status": 400, "type": "exceed_context_size_error", "code": 400, "n_prompt_tokens": 5001, "n_ctx": 4096,
         "message": "request (5001 tokens) exceeds the available context size (4096 tokens), try increasing it"},
        400, "context_length_exceeded", "the request (5001 tokens) is longer than model qwen's context (4096 tokens)",
        id="400-context",
    ),
    pytest.param(
        "chat/completions",
        {"status": 400, "type": "invalid_request_error", "code": 400,
         "message": "Field 'n_probs': [json.exception.type_error.302] type must be number, but is string"},
        400, "invalid_request",
        "model qwen refused the request: Field 'n_probs': [json.exception.type_error.302] type must be number, but is"
        " string", id="400-field",
    ),
    pytest.param(
        "chat/completions", {"status": 422, "message": "cannot reach http://10.9.8.7:20001/x or 10.9.8.7:20002"},
        400, "invalid_request", "model qwen refused the request: cannot reach <engine> or <engine>", id="422-address",
    ),
    pytest.param("chat/completions", {"status": 404, "message": "Not Found"}, 400, "not_supported",
                 "model qwen does not serve chat completions", id="404"),
    pytest.param("chat/completions", {"status": 413}, 413, "request_too_large",
                 "model qwen refused the request as too large", id="413"),
    pytest.param("chat/completions", {"status": 429, "message": "busy"}, 429, "rate_limited",
                 "model qwen is busy; try again", id="429"),
    pytest.param(
        "chat/completions", {"status": 500, "message": "CUDA error in /build/ggml-cuda.cu:75 on 10.0.0.3:20001"},
        502, "upstream_error", "model qwen failed the request (its engine answered 500)", id="500",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint, error, status, code, message", REFUSALS)
async def test_an_engines_error_is_answered_in_the_gateways_words(client, caplog, endpoint, error, status, code,
                                                                   message, stream):
    body = {"model": "qwen", "test_engine_error": error}
    body.update({"embeddings": {"input": "x"}, "completions": {"prompt": "x"}}.get(endpoint, {"messages": looks([])}))
    if stream and endpoint != "embeddings":
        body["stream"] = True
    with caplog.at_level(logging.WARNING, logger="llmgw.gateway"):
        response = await post(client, endpoint, body)
    assert openai_error(response, status, code)["message"] == message
    if status == 429:
        assert response["Retry-After"] == "1"
    # the engine's own words are in the web log, for the operator
    assert any(error.get("message", "") in r.getMessage() for r in caplog.records if r.name == "llmgw.gateway")
    assert not runtime().local


async def test_no_upstream_error_names_an_engines_host_or_port(cluster, client):
    port = free_port()  # nothing listens there
    model = await sync_to_async(make_model)("lonely")
    await sync_to_async(ready_replica)(model, cluster.node, port)
    for stream in (False, True):
        refused = openai_error(await chat(client, "lonely", stream=stream), 502, "upstream_error")
        assert str(port) not in refused["message"] and "127.0.0.1" not in refused["message"], refused

    # an engine that refuses the gateway's key (the key it was started with is gone): another replica may take
    # it, and the client hears only that the key was refused
    def lose_the_key():
        ClusterSettings.objects.filter(pk=1).update(engine_key="lek_new_" + "x" * 30, previous_engine_key="")

    await sync_to_async(lose_the_key)()
    await runtime().refresh()
    refused = openai_error(await chat(client), 502, "upstream_error")
    assert refused["message"] == "a replica of qwen refused the gateway's engine key"
    assert ENGINE_KEY not in json.dumps(refused)
    assert not runtime().local



async def test_a_refused_request_is_no_demand(cluster):
    """Only a request the gateway takes asks for its model (what keeps an on-demand model loaded, and wakes one
    at zero): a key refused the model (403), a request the model cannot serve (400), a key over its limit (429)
    leave its last request where it was."""
    await sync_to_async(make_model)("texty")  # chat and completions only: no embeddings
    secret = await sync_to_async(add_key)("only-qwen", models=["qwen", "texty"], rpm=1)
    client = key_client(secret)
    gw = runtime()

    openai_error(await chat(client, "empty"), 403, "model_not_allowed")
    openai_error(await post(client, "embeddings", {"model": "texty", "input": "hi"}), 400, "not_supported")
    assert "empty" not in gw.asked and "texty" not in gw.asked, gw.asked

    assert (await chat(client, "qwen")).status_code == 200
    asked = gw.asked["qwen"]
    refused = await chat(client, "qwen")
    if refused.status_code == 200:  # the minute turned between the two: a new window
        asked = gw.asked["qwen"]
        refused = await chat(client, "qwen")
    openai_error(refused, 429, "rate_limited")
    assert gw.asked["qwen"] == asked
