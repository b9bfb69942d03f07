"""What the gateway measures of a prompt before an engine sees it (gateway/prompt.py)."""

import pytest

from gateway import prompt
from gateway.errors import GatewayError
from gateway.surfaces import SURFACES


def test_sizes_count_text_token_ids_and_messages_but_not_images():
    chat = SURFACES["chat/completions"].prompt_size({"messages": [
        {"role": "system", "content": "abcd" * 16},
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image_url",
                                                                      "image_url": {"url": "data:" + "A" * 10_000}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        "not a message",
    ]})
    assert (chat.text_bytes, chat.token_ids, chat.items) == (64 + 2 + 2, 0, 4)
    assert chat.at_least == 4 + 68 // prompt.MAX_BYTES_PER_TOKEN
    assert chat.about == 4 * prompt.TEMPLATE_TOKENS + 17
    ids = SURFACES["completions"].prompt_size({"prompt": [1, 2, 3]})
    assert (ids.token_ids, ids.items, ids.at_least) == (3, 0, 3)
    batch = SURFACES["embeddings"].prompt_size({"input": ["é", "ab"]})
    assert (batch.text_bytes, batch.items) == (4, 2)
    assert SURFACES["completions"].prompt_size({"prompt": None}) == prompt.Size()


def test_context_and_depth():
    prompt.check_context("m", 10, prompt.Size(token_ids=10))
    prompt.check_context("m", None, prompt.Size(token_ids=10**6))  # an engine llmgw cannot read: not judged
    with pytest.raises(GatewayError) as refused:
        prompt.check_context("m", 10, prompt.Size(token_ids=11))
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    deep = "x"
    for _ in range(prompt.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(GatewayError, match="nested too deeply"):
        SURFACES["completions"].prompt_size({"prompt": deep})


def test_caps_and_the_most_an_answer_may_use():
    prompt.check_caps("m", {"n_probs": 5, "logprobs": True, "top_logprobs": 5, "n": 2}, 5, 2)
    prompt.check_caps("m", {"n_probs": 500, "n": 50}, None, None)
    for body in ({"n_probs": 6}, {"logprobs": 6}, {"top_logprobs": 6}, {"n": 3}, {"best_of": 3}, {"n": "3"}):
        with pytest.raises(GatewayError):
            prompt.check_caps("m", body, 5, 2)
    assert prompt.completion_at_most({"max_tokens": 10, "n": 3}, ("max_tokens",), 4096) == 30
    assert prompt.completion_at_most({}, ("max_tokens",), 4096) == 4096
    assert prompt.completion_at_most({}, ("max_tokens",), None) == 0


def test_sizes_of_messages_responses_and_rerank():
    messages = SURFACES["messages"].prompt_size({"system": "abcd", "messages": [{"role": "user", "content": "ab"}]})
    assert (messages.text_bytes, messages.items) == (6, 1)
    assert SURFACES["messages/count_tokens"].prompt_size({"messages": []}) == prompt.Size()
    text = SURFACES["responses"].prompt_size({"instructions": "ab", "input": "abcd"})
    assert (text.text_bytes, text.items) == (6, 1)
    items = SURFACES["responses"].prompt_size({"input": [{"role": "user", "content": [{"type": "input_text", "text": "ab"}]},
                                                 {"type": "function_call_output", "output": "abc"}]})
    assert (items.text_bytes, items.items) == (5, 2)
    ranked = SURFACES["rerank"].prompt_size({"query": "ab", "documents": ["abc", "d"]})
    assert (ranked.text_bytes, ranked.items) == (6, 3)
