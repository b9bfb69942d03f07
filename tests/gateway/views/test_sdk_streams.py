"""Messages and Responses streams through /v1/, read by the official SDKs' own stream helpers as their docs show
(`client.responses.stream(...)`, `client.messages.stream(...)`): each builds the answer from the events and
indexes by fields an engine may leave out. tests/engine.py streams every field (model `qwen`), or with --sparse
leaves out what llama.cpp's server does and more (model `sparse`): no `event:` lines, no `sequence_number`,
`output_index`, `content_index`, `item_id` or `logprobs`, no `message_start`, `content_block_start` or `index`.
The SDKs talk HTTP to the gateway's own ASGI application (httpx's ASGI transport)."""

import re
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from asgiref.sync import sync_to_async

from gateway.urls import application
from tests.factories import make_model
from tests.gateway.views.harness import ANSWER, ENGINE_KEY, Engine, events, key_client, post, read, ready_replica

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

SAY = [{"role": "user", "content": "say five words"}]


@pytest.fixture(scope="module")
def sparse_engine(tmp_path_factory):
    started = Engine(tmp_path_factory.mktemp("sparse"), "--answer", ANSWER, "--sparse")
    yield started
    started.stop()


@pytest.fixture
def sparse(cluster, sparse_engine):
    """Model `sparse`, ready on the engine that leaves fields out."""
    ready_replica(make_model("sparse"), cluster.node, sparse_engine.port)


def gateway_app() -> Any:
    """The gateway as httpx's ASGITransport takes an app: httpx types a scope as any mutable mapping, Django's
    stubs (and so the gateway, which Django's ASGI router calls) as a dict."""
    return application()


def openai_client(secret: str) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=gateway_app(), client=("127.0.0.1", 40000))
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=secret, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def anthropic_client(secret: str) -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=gateway_app(), client=("127.0.0.1", 40000))
    return anthropic.AsyncAnthropic(base_url="http://testserver", api_key=secret, max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))


@pytest.mark.parametrize("model", ["qwen", "sparse"])
async def test_the_openai_sdks_responses_stream_builds_the_answer(cluster, sparse, model):
    async with openai_client(cluster.secret).responses.stream(model=model, input="say five words") as stream:
        got = [event async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == ANSWER and final.usage.output_tokens == 5
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == ANSWER
    assert [e.sequence_number for e in got] == list(range(len(got)))
    deltas = [e for e in got if e.type == "response.output_text.delta"]
    assert {(e.output_index, e.content_index, e.item_id) for e in deltas} == {(0, 0, final.output[0].id)}
    assert [e.snapshot for e in deltas][-1] == ANSWER  # the SDK's own accumulation


@pytest.mark.parametrize("model", ["qwen", "sparse"])
async def test_the_anthropic_sdks_messages_stream_builds_the_answer(cluster, sparse, model):
    async with anthropic_client(cluster.secret).messages.stream(model=model, max_tokens=64, messages=SAY) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == ANSWER and [block.text for block in final.content] == [ANSWER]
    assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0 and final.stop_reason == "end_turn"


async def test_an_engine_that_sends_every_field_is_passed_on_as_it_came(cluster, sparse):
    """The gateway writes in only what an engine left out: the full engine's stream arrives byte for byte."""
    client = key_client(cluster.secret)
    for path, body in (("responses", {"model": "qwen", "input": "hi", "stream": True}),
                       ("messages", {"model": "qwen", "max_tokens": 64, "messages": SAY, "stream": True})):
        got = await read(await post(client, path, body))
        direct = await sync_to_async(httpx.post)(f"http://127.0.0.1:{cluster.engine.port}/v1/{path}", json=body,
                                                 headers={"Authorization": f"Bearer {ENGINE_KEY}"})
        assert _masked(got) == _masked(direct.content), path


async def test_what_the_gateway_writes_in_follows_the_stream(cluster, sparse):
    """The sparse engine's Responses stream, as a client reads it: the `event:` line of each, its place, the item
    and part it belongs to."""
    got = await read(await post(key_client(cluster.secret), "responses",
                                {"model": "sparse", "input": "hi", "stream": True, "max_output_tokens": 2}))
    kinds = [line[7:].decode() for line in got.split(b"\n") if line.startswith(b"event: ")]
    data = events(got)
    assert kinds == [d["type"] for d in data] and len(data) == 10
    assert [d["sequence_number"] for d in data] == list(range(10))
    item = data[2]["item"]["id"]
    assert all((d["output_index"], d.get("content_index", 0), d.get("item_id", item)) == (0, 0, item)
               for d in data[2:-1]), data
    assert [d["logprobs"] for d in data if d["type"].startswith("response.output_text.")] == [[], [], []]


def _masked(content: bytes) -> bytes:
    """The stream less what differs from one answer to the next: its ids, its time."""
    return re.sub(rb'"(?:resp|msg)_[0-9a-f]{24}"|"created_at": \d+', b"X", content)
