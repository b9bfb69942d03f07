"""gateway/resume.py on its own: what a transcript reads off the events a client was passed, the request that
continues an answer, and a continuation's events as the answer's (the shapes llama.cpp's server streams, and
vLLM's where they differ). The whole path, with engines that fail, is tests/gateway/views/test_resume.py."""

import json

import pytest

from gateway.resume import ChatTranscript, CompletionsTranscript, MessagesTranscript, ResponsesTranscript


def sse(data: dict, kind: str = "") -> bytes:
    return (f"event: {kind}\n" if kind else "").encode() + b"data: " + json.dumps(data).encode()


def data_of(event: bytes) -> dict:
    (line,) = [x for x in event.split(b"\n") if x.startswith(b"data:")]
    return json.loads(line[5:])


def chunk(content=None, finish=None, role=False, cid="chatcmpl-1"):
    delta = {"role": "assistant", "content": None} if role else ({"content": content} if content else {})
    return sse({"id": cid, "created": 1, "model": "m", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_a_chat_answer_goes_on_from_its_text_as_a_prefill_asking_for_what_is_owed():
    t = ChatTranscript({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                        "seed": 3, "temperature": 0, "stream": True}, prompt_about=5)
    for event in (chunk(role=True), chunk("Hello"), chunk(" there")):
        t.add(event)
    assert t.why_not() == "" and t.owed() == 8
    body = t.continuation()
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello there"}
    assert (body["max_tokens"], body["seed"], body["temperature"]) == (8, 3, 0)
    assert body["stream_options"] == {"include_usage": True} and body["continue_final_message"] is True
    seam = t.seam()
    # the continuation's role chunk is left out; its id becomes the answer's; its usage counts the answer
    assert seam.splice(chunk(role=True, cid="chatcmpl-2")) == []
    (went_on,) = seam.splice(chunk(" friend", cid="chatcmpl-2"))
    assert data_of(went_on)["id"] == "chatcmpl-1" and data_of(went_on)["choices"][0]["delta"] == {"content": " friend"}
    usage = sse({"id": "chatcmpl-2", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                                               "total_tokens": 10}})
    assert data_of(seam.splice(usage)[0])["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert t.fleet_prompt == 9


def test_the_clients_own_prefill_is_continued_with_what_followed_it():
    t = ChatTranscript({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": [{"type": "text", "text": "Sure:"}]}]})
    t.add(chunk(" one"))
    assert t.continuation()["messages"][-1] == {"role": "assistant", "content": [{"type": "text", "text": "Sure: one"}]}


@pytest.mark.parametrize(("body", "why"), [
    ({"n": 2}, "an answer of several choices"),
    ({"response_format": {"type": "json_object"}}, "a JSON answer on an engine that takes no grammar with a request"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}},
     "an answer held to a grammar (a JSON schema, or a grammar of its own)"),
    ({"grammar": "root ::= \"x\""}, "an answer held to a grammar (a JSON schema, or a grammar of its own)"),
])
def test_what_cannot_go_on_says_why(body, why):
    t = ChatTranscript({"messages": [], **body})
    t.add(chunk("{"))
    assert t.why_not() == why


def test_a_json_answer_goes_on_held_to_the_rest_of_its_document():
    t = ChatTranscript({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}],
                        "response_format": {"type": "json_object"}}, grammar=True)
    t.add(chunk('"a": [1, "x'))
    assert t.why_not() == ""
    body = t.continuation()
    assert "response_format" not in body and body["messages"][-1]["content"] == '{"a": [1, "x'
    assert body["grammar"].startswith('root ::= chars "\\"" ws ( "," ws value ws )* "]" ws ( "," ws member )* "}" ws\n')
    t = ChatTranscript({"messages": [], "response_format": {"type": "json_object"}}, grammar=True)
    t.add(chunk('{"a": 1}}'))
    assert t.why_not() == "a JSON answer that is not JSON so far"


def test_a_tool_call_or_reasoning_in_progress_cannot_go_on():
    t = ChatTranscript({"messages": []})
    t.add(sse({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}))
    assert t.why_not() == "a tool call in progress"
    t = ChatTranscript({"messages": []})
    t.add(sse({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}))
    assert t.why_not() == "reasoning in progress"


def test_an_answer_at_its_last_token_is_ended_here():
    t = ChatTranscript({"messages": [], "max_tokens": 2}, prompt_about=4)
    t.add(chunk("a"))
    t.add(chunk(" b"))
    assert t.owed() == 0
    finish, usage, done = (data_of(e) if e != b"data: [DONE]" else e for e in t.ending())
    assert finish["choices"][0]["finish_reason"] == "length" and finish["id"] == "chatcmpl-1"
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6} and done == b"data: [DONE]"


def test_a_completion_goes_on_at_the_end_of_its_prompt():
    t = CompletionsTranscript({"prompt": ["Once"], "max_tokens": 5})
    t.add(sse({"id": "cmpl-1", "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}))
    assert t.continuation()["prompt"] == "Once upon" and t.continuation()["max_tokens"] == 4
    assert CompletionsTranscript({"prompt": [1, 2]}).why_not() == "a prompt that is not one string"
    assert CompletionsTranscript({"prompt": "x", "echo": True}).why_not() == "a prompt echoed"


def messages_stream(text_deltas, sparse=False):
    events = [] if sparse else [
        sse({"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 6}}}, "message_start"),
        sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            "content_block_start")]
    return events + [sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}},
                         "content_block_delta") for d in text_deltas]


def test_a_messages_answer_goes_on_in_its_open_block():
    t = MessagesTranscript({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
    for e in messages_stream(["Hel", "lo"]):
        t.add(e)
    body = t.continuation()
    assert body["messages"][-1] == {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}
    assert body["max_tokens"] == 7
    seam = t.seam()
    start, block, delta = messages_stream([" you"])
    assert seam.splice(start) == [] and seam.splice(block) == []
    assert data_of(seam.splice(delta)[0])["index"] == 0
    ended = sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}})
    assert data_of(seam.splice(ended)[0])["usage"] == {"output_tokens": 3}
    assert t.fleet_prompt == 6


def test_a_tool_use_block_cannot_go_on():
    t = MessagesTranscript({"messages": []})
    t.add(sse({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "name": "f"}}))
    assert t.why_not() == "a tool call in progress"


def responses_stream(deltas, rid="resp_1", mid="msg_1", prefill="", full=True):
    """As llama.cpp's server streams it: no sequence numbers or indices, `done` texts whole (`full`: with the
    prefill before them, as llama.cpp says them; vLLM's say only what they generated)."""
    text = (prefill if full else "") + "".join(deltas)
    part = {"type": "output_text", "text": text}
    return [sse({"type": "response.created", "response": {"id": rid, "status": "in_progress"}}),
            sse({"type": "response.output_item.added", "item": {"id": mid, "type": "message", "content": []}}),
            sse({"type": "response.content_part.added", "item_id": mid, "part": {"type": "output_text", "text": ""}}),
            *(sse({"type": "response.output_text.delta", "item_id": mid, "delta": d}) for d in deltas),
            sse({"type": "response.output_text.done", "item_id": mid, "text": text}),
            sse({"type": "response.content_part.done", "item_id": mid, "part": part}),
            sse({"type": "response.output_item.done", "item": {"id": mid, "type": "message", "content": [part]}}),
            sse({"type": "response.completed", "response": {"id": rid, "output": [
                {"id": mid, "type": "message", "content": [part]}], "usage": {"input_tokens": 20, "output_tokens": 2}}})]


@pytest.mark.parametrize("full", [True, False])
def test_a_responses_answer_goes_on_in_its_open_item_and_its_whole_texts_are_the_answers(full):
    t = ResponsesTranscript({"input": "hi", "max_output_tokens": 10})
    for e in responses_stream(["Hel", "lo"])[:5]:  # created, item, part, two deltas
        t.add(e)
    body = t.continuation()
    assert body["input"] == [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant",
                                                                  "content": [{"type": "output_text", "text": "Hello"}]}]
    assert body["max_output_tokens"] == 8
    seam = t.seam()
    spliced = [data_of(e) for event in responses_stream([" you", "!"], "resp_2", "msg_2", "Hello", full)
               for e in seam.splice(event)]
    assert [d["type"] for d in spliced] == ["response.output_text.delta", "response.output_text.delta",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]
    assert {d.get("item_id") for d in spliced[:4]} == {"msg_1"}
    assert spliced[2]["text"] == spliced[3]["part"]["text"] == "Hello you!"
    assert spliced[4]["item"]["id"] == "msg_1" and spliced[4]["item"]["content"][0]["text"] == "Hello you!"
    response = spliced[5]["response"]
    assert response["id"] == "resp_1" and response["output"][0]["id"] == "msg_1"
    assert response["output"][0]["content"][0]["text"] == "Hello you!"
    assert response["usage"]["output_tokens"] == 4 and response["usage"]["input_tokens"] == 18


def test_a_responses_answer_with_a_json_format_cannot_go_on():
    t = ResponsesTranscript({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}})
    assert t.why_not() == "an answer held to a grammar (a JSON schema, or a grammar of its own)"
