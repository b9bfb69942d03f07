"""Prefix affinity (gateway/affinity.py): the key of each endpoint, stickiness, the load bound, fallback, and the
share of keys that moves when a replica joins or leaves."""

import random
from collections import Counter

import pytest

from gateway.affinity import COMPLETION_CHARS, LOAD_FACTOR, Ring, chat_opening, choose
from gateway.surfaces import SURFACES

REPLICAS = ["m-0a1b2c3d", "m-4e5f6a7b", "m-8c9d0e1f"]
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}


def conversation(document: str, turns: int) -> list[dict]:
    messages = [SYSTEM, {"role": "user", "content": f"Read this and answer my questions.\n\n{document}"}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"question {i}"}]
    return messages


def chat_key(messages) -> int:
    return SURFACES["chat/completions"].prefix_key({"model": "m", "messages": messages})


def idle(name: str) -> int:
    return 0


# The key of each endpoint


def test_every_turn_of_a_conversation_has_its_first_turns_key():
    keys = {chat_key(conversation("the annual report of 2025", turns)) for turns in range(6)}
    assert len(keys) == 1


def test_conversations_with_other_documents_have_other_keys():
    keys = {chat_key(conversation(f"document number {i}", 2)) for i in range(200)}
    assert len(keys) == 200


def test_a_shared_template_before_the_document_still_tells_conversations_apart():
    # what KubeAI's 100 characters of the first user message cannot: every opening starts the same
    template = "Summarise the document below in three bullet points, then answer the user's questions. " * 4
    keys = {chat_key([SYSTEM, {"role": "user", "content": template + f"document {i}"}]) for i in range(50)}
    assert len(keys) == 50


def test_the_system_prompt_is_part_of_the_opening():
    user = {"role": "user", "content": "hello"}
    brief, long = {"role": "system", "content": "be brief"}, {"role": "system", "content": "be long"}
    assert chat_key([brief, user]) != chat_key([long, user])
    assert chat_opening([{"role": "system", "content": "s"}, user, {"role": "user", "content": "later"}]) == (
        "system\x1fs\x1duser\x1fhello"
    )


def test_content_parts_count_by_their_text_and_images():
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]
    other = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBB"}}]
    assert chat_key([{"role": "user", "content": parts}]) != chat_key([{"role": "user", "content": other}])
    assert chat_key([{"role": "user", "content": parts}]) == chat_key([{"role": "user", "content": list(parts)}])


@pytest.mark.parametrize("messages", [None, "text", [1, None, "x"], [{"role": "user"}], [{"content": 5}], []])
def test_odd_messages_still_have_a_key(messages):
    assert isinstance(chat_key(messages), int)  # the engine answers what is wrong with them


def test_a_completions_key_is_the_start_of_its_prompt():
    prompt = "x" * COMPLETION_CHARS
    key = SURFACES["completions"].prefix_key({"prompt": prompt})
    assert SURFACES["completions"].prefix_key({"prompt": prompt + " and then more, turn after turn"}) == key
    assert SURFACES["completions"].prefix_key({"prompt": "y" + prompt}) != key
    assert isinstance(SURFACES["completions"].prefix_key({"prompt": [1, 2, 3]}), int)  # token ids


def test_an_embeddings_key_is_its_whole_input():
    assert SURFACES["embeddings"].prefix_key({"input": "a"}) == SURFACES["embeddings"].prefix_key({"input": "a"})
    assert SURFACES["embeddings"].prefix_key({"input": "a"}) != SURFACES["embeddings"].prefix_key({"input": "a b"})
    assert SURFACES["embeddings"].prefix_key({"input": ["a", "b"]}) != SURFACES["embeddings"].prefix_key({"input": ["a", "c"]})


# The ring


def test_one_key_goes_to_one_replica_whatever_the_order_of_the_names():
    key = chat_key(conversation("report", 0))
    chosen = {choose(Ring(names), key, idle) for names in (REPLICAS, REPLICAS[::-1], REPLICAS[1:] + REPLICAS[:1])}
    assert len(chosen) == 1


def test_keys_spread_evenly_over_the_replicas():
    ring = Ring(REPLICAS)
    shares = Counter(choose(ring, chat_key(conversation(f"doc {i}", 0)), idle) for i in range(6000))
    assert set(shares) == set(REPLICAS)
    assert all(1600 <= n <= 2400 for n in shares.values()), shares  # a third each, give or take a fifth


def test_a_replica_joining_takes_only_its_share_and_one_leaving_gives_only_its_own():
    keys = [random.Random(i).getrandbits(64) for i in range(6000)]
    before = {k: choose(Ring(REPLICAS), k, idle) for k in keys}
    joined = {k: choose(Ring(REPLICAS + ["m-new00000"]), k, idle) for k in keys}
    moved = [k for k in keys if joined[k] != before[k]]
    assert all(joined[k] == "m-new00000" for k in moved)  # every key that moved went to the new replica
    assert 0.18 <= len(moved) / len(keys) <= 0.32  # about a quarter: its share, not a reshuffle
    left = {k: choose(Ring(REPLICAS[1:]), k, idle) for k in keys}
    moved = [k for k in keys if left[k] != before[k]]
    assert {before[k] for k in moved} == {REPLICAS[0]}  # only the keys of the replica that left moved


# The load bound and fallback


def test_a_replica_over_the_bound_passes_the_request_to_the_next_on_the_ring():
    ring = Ring(REPLICAS)
    key = chat_key(conversation("popular", 0))
    first, second, third = list(ring.walk(key))
    loads = {first: 0, second: 0, third: 0}
    assert choose(ring, key, loads.__getitem__) == first
    # 4 in flight, mean 5/3 with this one: with KubeAI's factor the bound is ceil(1.25 × 5 / 3) = 3
    loads = {first: 3, second: 1, third: 0}
    assert choose(ring, key, loads.__getitem__, factor=1.25) == second
    loads = {first: 2, second: 1, third: 1}
    assert choose(ring, key, loads.__getitem__, factor=1.25) == first  # 3 is within the bound
    # llmgw's factor, 2: ceil(2 × 5 / 3) = 4, so the first keeps it at 3 in flight and passes it on at 4
    assert choose(ring, key, {first: 3, second: 1, third: 0}.__getitem__) == first
    assert choose(ring, key, {first: 4, second: 0, third: 0}.__getitem__) == second


def test_a_burst_of_one_opening_is_spread_within_the_bound():
    ring = Ring(REPLICAS)
    key = chat_key([SYSTEM, {"role": "user", "content": "hello"}])  # every conversation opens the same
    loads = Counter()
    for n in range(1, 31):
        name = choose(ring, key, loads.__getitem__)
        loads[name] += 1
        bound = -(-LOAD_FACTOR * n // len(REPLICAS))
        assert max(loads.values()) <= bound, loads
    assert len(loads) >= 2  # the first replica alone would take all thirty


def test_a_replica_that_failed_is_passed_by_and_none_is_left_at_the_end():
    ring = Ring(REPLICAS)
    key = chat_key(conversation("report", 0))
    order = list(ring.walk(key))
    assert sorted(order) == sorted(REPLICAS)
    assert choose(ring, key, idle, exclude={order[0]}) == order[1]
    assert choose(ring, key, idle, exclude=set(order[:2])) == order[2]
    assert choose(ring, key, idle, exclude=set(REPLICAS)) is None
    assert choose(Ring([]), key, idle) is None


def test_messages_and_responses_are_keyed_by_their_opening_and_sessions_by_their_id():
    from gateway.affinity import session_key

    first = [{"role": "user", "content": [{"type": "text", "text": "fix the bug in parser.py"}]}]
    later = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now the tests"}]
    messages = {"system": "You are Claude Code.", "messages": first}
    assert SURFACES["messages"].prefix_key(messages) == SURFACES["messages"].prefix_key({**messages, "messages": later})
    assert SURFACES["messages"].prefix_key(messages) == SURFACES["messages/count_tokens"].prefix_key(messages)
    assert SURFACES["messages"].prefix_key(messages) != SURFACES["messages"].prefix_key({**messages, "system": "other"})
    assert SURFACES["messages"].prefix_key(messages) != SURFACES["messages"].prefix_key({**messages, "messages": [
        {"role": "user", "content": "another task"}]})
    responses = {"instructions": "You are Codex.", "input": first}
    assert SURFACES["responses"].prefix_key(responses) == SURFACES["responses"].prefix_key({**responses, "input": later})
    assert SURFACES["responses"].prefix_key({"input": "fix it"}) == SURFACES["responses"].prefix_key(
        {"input": [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "ok"}]})
    assert SURFACES["rerank"].prefix_key({"query": "q", "documents": ["a"]}) != SURFACES["rerank"].prefix_key(
        {"query": "q", "documents": ["b"]})
    assert session_key("abc") == session_key("abc") != session_key("abd")
