"""gateway/streams.py on streams no test engine sends: several output items, events naming an earlier item, a ping
before anything, an empty object; read back by the official SDKs' stream helpers (over a mock transport)."""

import json

import anthropic
import httpx
import httpx2
import openai

from gateway.streams import MessagesEvents, ResponsesEvents


def sse(kind: str, named: bool = False, **data) -> bytes:
    line = b"data: " + json.dumps({"type": kind, **data}).encode()
    return (b"event: " + kind.encode() + b"\n" + line) if named else line


def through(completer, events: list[bytes]) -> bytes:
    return b"".join(completer(event) + b"\n\n" for event in events)


def item(item_id: str, text: str | None = None) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed", "content": content}


def test_events_go_to_the_item_they_name_or_the_last_begun():
    head = {"id": "resp_1", "object": "response", "status": "in_progress"}
    done = {**head, "status": "completed", "output": [item("msg_a", "one and"), item("msg_b", "two")]}
    events = [
        sse("response.created", response=head),
        sse("response.output_item.added", item=item("msg_a")),
        sse("response.content_part.added", part={"type": "output_text", "text": ""}),
        sse("response.output_text.delta", delta="one"),
        sse("response.output_item.added", item=item("msg_b")),
        sse("response.content_part.added", item_id="msg_b", part={"type": "output_text", "text": ""}),
        sse("response.output_text.delta", delta="two"),  # the last begun: msg_b
        sse("response.output_text.delta", item_id="msg_a", delta=" and"),  # named: msg_a, output 0
        sse("response.output_item.done", item=item("msg_b", "two")),
        sse("response.output_item.done", item=item("msg_a", "one and")),
        sse("response.completed", response=done),
    ]
    stream = through(ResponsesEvents(), events)
    sent = [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: ")]
    assert [(e.get("output_index"), e.get("item_id")) for e in sent[1:10]] == [
        (0, None), (0, "msg_a"), (0, "msg_a"), (1, None), (1, "msg_b"), (1, "msg_b"), (0, "msg_a"), (1, None),
        (0, None)]
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream,
                                                                   headers={"content-type": "text/event-stream"}))
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=httpx.Client(transport=transport))
    with client.responses.stream(model="m", input="hi") as reading:
        deltas = [e.snapshot for e in reading if e.type == "response.output_text.delta"]
        final = reading.get_final_response()
    assert deltas == ["one", "two", "one and"] and [o.content[0].text for o in final.output] == ["one and", "two"]


def test_a_whole_event_passes_byte_for_byte_and_an_empty_one_stays_json():
    whole = sse("response.output_text.delta", True, sequence_number=7, output_index=0, content_index=0,
                item_id="msg_a", delta="x", logprobs=[])
    assert ResponsesEvents()(whole) == whole
    assert ResponsesEvents()(b"event: error\ndata: {}") == b'event: error\ndata: {"sequence_number":0}'
    assert ResponsesEvents()(b"data: [DONE]") == b"data: [DONE]"


def test_a_messages_stream_with_a_ping_first_and_nothing_else_of_its_start():
    events = [
        sse("ping"),
        sse("content_block_delta", delta={"type": "text_delta", "text": "Hello"}),
        sse("content_block_delta", delta={"type": "text_delta", "text": " there"}),
        sse("content_block_stop"),
        sse("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None}),
        sse("message_stop"),
    ]
    stream = through(MessagesEvents("m", 9), events)
    kinds = [line[7:] for line in stream.split(b"\n") if line.startswith(b"event: ")]
    assert kinds == [b"ping", b"message_start", b"content_block_start", b"content_block_delta",
                     b"content_block_delta", b"content_block_stop", b"message_delta", b"message_stop"]
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, content=stream,
                                                                     headers={"content-type": "text/event-stream"}))
    client = anthropic.Anthropic(base_url="http://x", api_key="k", http_client=httpx2.Client(transport=transport))
    with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as reading:
        text = "".join(reading.text_stream)
        final = reading.get_final_message()
    assert text == "Hello there" and final.content[0].text == text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 2)  # the estimate; the deltas counted


def test_deltas_of_two_types_without_event_lines_each_get_their_own_fields():
    """A delta is completed as the one before it was only where its bytes up to `"delta"` name the same type."""
    completer = ResponsesEvents()
    events = [sse("response.output_item.added", item=item("msg_a")),
              sse("response.content_part.added", part={"type": "output_text", "text": ""}),
              b'data: {"delta":"one","type":"response.output_text.delta"}',
              b'data: {"delta":"two","type":"response.output_text.delta"}',
              b'data: {"delta":"{}","type":"response.function_call_arguments.delta"}']
    sent = [json.loads(line[6:]) for line in through(completer, events).split(b"\n") if line.startswith(b"data: ")]
    assert [(e["type"], e.get("content_index"), e.get("logprobs")) for e in sent[2:]] == [
        ("response.output_text.delta", 0, []), ("response.output_text.delta", 0, []),
        ("response.function_call_arguments.delta", None, None)]
    assert [e["sequence_number"] for e in sent] == [0, 1, 2, 3, 4]
