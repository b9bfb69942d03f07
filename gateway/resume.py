"""An answer that outlives its engine: a stream whose engine fails after its first byte, continued on another
replica as the same answer.

What the client was passed is kept as it passed (`Transcript.add`: the events, as bytes, read only when a resume
needs them, and folded into what they say once they grow past FOLD_BYTES). When the engine fails, the transcript
says whether the answer can go on (`why_not`), and makes the request that continues it (`continuation`): the
client's request as it came, its sampling parameters and seed kept, with the text passed so far as a final
assistant message (a prefill, which llama.cpp's server and vLLM continue) or, for a raw completion, at the end of
its prompt, asking only for the tokens still owed. The continuation's stream is then spliced into the client's
(`Seam.splice`): what the client already has is left out (the message's or response's start, the open content
block or item), the continuation's ids, indices and sequence numbers become the answer's own, a text the engine
gives whole (a Responses `done` event) is the whole answer's, and its usage counts the answer's prompt once and
every token the client received. The continuation's prompt is the fleet's cost (`Seam.fleet_prompt`), not the
key's. When nothing is owed (the answer had its last token, or its `max_tokens`), the answer's end is written
here (`Transcript.ending`).

What cannot go on, and is ended with an error event as before: an answer of several choices, a tool call or
reasoning in progress (their prefill is the model's own chat-template text, which the gateway does not see), a
completion whose prompt is not one string or that echoes it. docs/gateway.md says what holds.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable
from typing import Any

from gateway.json_rest import rest_of

JSON = dict[str, Any]

FOLD_BYTES = 64 << 10  # events kept as bytes before they are read into what they say (each read once)

# why an answer was resumed, as the metric and the record name it
CLOSED, SILENT, LOST = "closed", "silent", "lost"


def _dump(data: object) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _data_lines(event: bytes) -> Iterable[tuple[int, JSON | None]]:
    """Each `data:` line of an event: its index among the event's lines and its JSON (None: not an object)."""
    for i, line in enumerate(event.split(b"\n")):
        if line.startswith(b"data:"):
            try:
                data = json.loads(line[5:])
            except (ValueError, RecursionError):
                yield i, None
                continue
            yield i, data if isinstance(data, dict) else None


def _rewrite(event: bytes, changed: dict[int, JSON]) -> bytes:
    lines = event.split(b"\n")
    for i, data in changed.items():
        lines[i] = b"data: " + _dump(data)
    return b"\n".join(lines)


def _text(content: object) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _joined(content: str | list[Any], kind: str, text: str) -> str | list[Any]:
    """A prefill's content with `text` after it: in its last text part (a part of its own would be joined to it
    by an engine's template with a line break between)."""
    if isinstance(content, str):
        return content + text
    if content and isinstance(content[-1], dict) and isinstance(content[-1].get("text"), str):
        return [*content[:-1], {**content[-1], "text": content[-1]["text"] + text}]
    return [*content, {"type": kind, "text": text}]


# what constrains an answer's text to a grammar: OpenAI's response format (the Responses API's `text.format`),
# llama.cpp's `grammar` and `json_schema`, vLLM's guided decoding
_CONSTRAINTS = ("grammar", "json_schema", "guided_json", "guided_grammar", "guided_regex", "guided_choice",
                "structured_outputs")


def _constrained(body: JSON) -> str:
    """Why an answer held to a grammar cannot go on ("": it is not held to one, or to JSON alone, which
    `json_object` says): an engine applies a grammar from the first token it generates, so a continuation of half a
    JSON object held to it would be a new object after it."""
    if any(body.get(k) for k in _CONSTRAINTS) or _format(body) not in ("", "json_object"):
        return "an answer held to a grammar (a JSON schema, or a grammar of its own)"
    return ""


def _format(body: JSON) -> str:
    """The answer's format, as OpenAI's `response_format` (the Responses API's `text.format`) says ("": text)."""
    text = body.get("text")
    for given in (body.get("response_format"), text.get("format") if isinstance(text, dict) else None):
        if isinstance(given, dict) and given.get("type") not in (None, "text"):
            return str(given.get("type"))
    return ""


def _json_rest(transcript: Transcript, body: JSON) -> str:
    """Why a JSON answer cannot go on (""): it can, under the rest of the JSON document as a grammar."""
    if _format(transcript.body) != "json_object":
        return ""
    if not transcript.grammar:
        return "a JSON answer on an engine that takes no grammar with a request"
    rest = rest_of(transcript.given() + transcript.text)
    if rest is None:
        return "a JSON answer that is not JSON so far"
    body.pop("response_format", None)
    if isinstance(body.get("text"), dict):
        body["text"] = {k: v for k, v in body["text"].items() if k != "format"}
    body["grammar"] = rest
    return ""


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class Transcript:
    """What a stream passed to its client, and how it goes on (one subclass per API; `Surface.resumer`)."""

    token_fields: tuple[str, ...] = ()

    def __init__(self, body: JSON, prompt_about: int = 0, grammar: bool = False):
        self.body = body  # the request as sent to the engine
        self.grammar = grammar  # its engine takes a GBNF grammar (a JSON answer goes on under the rest of it)
        self.prompt_about = prompt_about  # its prompt's tokens as estimated (until an event says)
        self._pending: list[bytes] = []
        self._size = 0
        self.text = ""  # generated text passed so far
        self.tokens = 0  # tokens passed so far (the events that carried text)
        self.problem = ""  # why it cannot go on, once something passed says so
        self.finished = ""  # the finish reason passed, if any
        self.prompt = 0  # the answer's prompt tokens, once an event said
        self.fleet_prompt = 0  # prompt tokens its continuations cost the fleet
        self.resumes = 0

    # kept as it passes (the hot path: an append)

    def add(self, event: bytes) -> None:
        self._pending.append(event)
        self._size += len(event)
        if self._size > FOLD_BYTES:
            self.fold()

    def fold(self) -> None:
        pending, self._pending, self._size = self._pending, [], 0
        for event in pending:
            for _, data in _data_lines(event):
                if data is not None:
                    self.read(data)

    def read(self, data: JSON) -> None:
        raise NotImplementedError

    # on the engine's failure

    def why_not(self) -> str:
        """Why the answer cannot go on ("": it can)."""
        self.fold()
        return self.problem or self._request_problem() or _json_rest(self, {})

    def _request_problem(self) -> str:
        return _constrained(self.body)

    def given(self) -> str:
        """The answer's text the client gave itself (a prefill of its own), before what was generated."""
        return ""

    def owed(self) -> int | None:
        """Tokens still owed (None: as many as the engine gives; 0: none, the answer is at its end)."""
        self.fold()
        if self.finished:
            return 0
        caps = [v for f in self.token_fields if isinstance(v := self.body.get(f), int) and not isinstance(v, bool)]
        return max(0, min(caps) - self.tokens) if caps else None

    def continuation(self) -> JSON:
        """The request that continues the answer: the client's, with what was passed as its prefill."""
        self.fold()
        body = copy.deepcopy(self.body)
        owed = self.owed()
        for f in self.token_fields:
            if f in body and owed is not None:
                body[f] = max(1, owed)
        body["stream"] = True
        self._prefill(body)
        _json_rest(self, body)
        return body

    def _prefill(self, body: JSON) -> None:
        raise NotImplementedError

    def seam(self) -> Seam:
        """What splices the next continuation's events into the answer."""
        self.fold()
        return self._seam()

    def _seam(self) -> Seam:
        raise NotImplementedError

    def ending(self) -> list[bytes]:
        """The events that end the answer when nothing more is owed."""
        self.fold()
        return self._ending()

    def _ending(self) -> list[bytes]:
        raise NotImplementedError


class Seam:
    """A continuation's stream made part of the answer the client has (one per resume)."""

    def __init__(self, transcript: Transcript):
        self.t = transcript
        self.before = transcript.tokens  # tokens the client had when the continuation began

    def splice(self, event: bytes) -> list[bytes]:
        changed: dict[int, JSON] = {}
        for i, data in _data_lines(event):
            if data is None:
                continue
            kept = self.take(data)
            if kept is None:
                return []
            changed[i] = kept
        return [_rewrite(event, changed) if changed else event]

    def take(self, data: JSON) -> JSON | None:
        """An event of the continuation as the answer's (None: the client has it already)."""
        raise NotImplementedError

    def prompt(self, continued: int) -> int:
        """The answer's prompt, from the continuation's (which is it and the prefill), counted for the fleet."""
        self.t.fleet_prompt += continued
        if not self.t.prompt:
            self.t.prompt = max(1, continued - self.before)
        return self.t.prompt


# OpenAI's chat completions and completions


class ChoicesTranscript(Transcript):
    token_fields = ("max_tokens", "max_completion_tokens", "n_predict")
    chat = True

    def __init__(self, body: JSON, prompt_about: int = 0, grammar: bool = False):
        super().__init__(body, prompt_about, grammar)
        self.head: JSON = {}  # id, created, model, object, system_fingerprint: as the client had them
        self.usage: JSON | None = None

    def read(self, data: JSON) -> None:
        if not self.head and "id" in data:
            self.head = {k: data[k] for k in ("id", "object", "created", "model", "system_fingerprint") if k in data}
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.problem = "an answer of several choices"
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.problem = "a tool call in progress"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.problem = "reasoning in progress"
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self.text += text
                self.tokens += 1
            if choice.get("finish_reason"):
                self.finished = choice["finish_reason"]
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
            self.prompt = _int(data["usage"].get("prompt_tokens")) or self.prompt

    def _request_problem(self) -> str:
        if constrained := _constrained(self.body):
            return constrained
        if _int(self.body.get("n")) > 1 or _int(self.body.get("best_of")) > 1:
            return "an answer of several choices"
        if not self.chat:
            prompt = self.body.get("prompt")
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                                and isinstance(prompt[0], str))):
                return "a prompt that is not one string"
            if self.body.get("echo"):
                return "a prompt echoed"
        return ""

    def given(self) -> str:
        last = (self.body.get("messages") or [None])[-1] if self.chat else None
        if isinstance(last, dict) and last.get("role") == "assistant" and not last.get("tool_calls"):
            return _text(last.get("content"))
        return ""

    def _prefill(self, body: JSON) -> None:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if not self.chat:
            prompt = body["prompt"]
            body["prompt"] = (prompt if isinstance(prompt, str) else prompt[0]) + self.text
            return
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "assistant" and not last.get("tool_calls"):
            messages[-1] = {**last, "content": _joined(last.get("content") or "", "text", self.text)}  # its own prefill
        else:
            messages.append({"role": "assistant", "content": self.text})
        body["messages"] = messages
        body["continue_final_message"], body["add_generation_prompt"] = True, False  # vLLM's words for a prefill

    def _seam(self) -> Seam:
        return ChoicesSeam(self)

    def _ending(self) -> list[bytes]:
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        events = []
        if not self.finished:
            delta: JSON = {"delta": {}} if self.chat else {"text": "", "logprobs": None}
            events.append(b"data: " + _dump({**head, "choices": [{"index": 0, **delta, "finish_reason": "length"}]}))
        if self.usage is None:
            prompt = self.prompt or self.prompt_about
            usage = {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}
            events.append(b"data: " + _dump({**head, "choices": [], "usage": usage}))
        return [*events, b"data: [DONE]"]


class ChoicesSeam(Seam):
    t: ChoicesTranscript

    def take(self, data: JSON) -> JSON | None:
        choices = data.get("choices") or []
        if self.t.chat and choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta") or {}
            if "role" in delta and not delta.get("content") and not choices[0].get("finish_reason"):
                return None  # the role's chunk: the client has it
            if "role" in delta:
                choices[0]["delta"] = {k: v for k, v in delta.items() if k != "role"}
        data.update({k: v for k, v in self.t.head.items() if k != "object"})
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            prompt = self.prompt(_int(usage.get("prompt_tokens")))
            completion = self.before + _int(usage.get("completion_tokens"))
            data["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and "cached_tokens" in details:
                data["usage"]["prompt_tokens_details"] = {**details, "cached_tokens": min(prompt, _int(
                    details["cached_tokens"]))}
        return data


class ChatTranscript(ChoicesTranscript):
    chat = True


class CompletionsTranscript(ChoicesTranscript):
    chat = False


# Anthropic's Messages


class MessagesTranscript(Transcript):
    token_fields = ("max_tokens",)

    def __init__(self, body: JSON, prompt_about: int = 0, grammar: bool = False):
        super().__init__(body, prompt_about, grammar)
        self.started = False  # message_start passed
        self.blocks: list[str] = []  # the content blocks passed, by index: their text
        self.open: int | None = None  # the block still open
        self.delta_sent = False  # message_delta passed (its stop reason and usage)
        self.message: JSON = {}

    def read(self, data: JSON) -> None:
        kind = data.get("type")
        if kind == "message_start":
            self.started = True
            message = data.get("message")
            self.message = message if isinstance(message, dict) else {}
            usage = self.message.get("usage") or {}
            self.prompt = sum(_int(usage.get(f)) for f in ("input_tokens", "cache_read_input_tokens",
                                                             "cache_creation_input_tokens")) or self.prompt
        elif kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") != "text":
                self.problem = "a tool call in progress" if block.get("type") == "tool_use" else "thinking in progress"
            self.blocks.append(block.get("text") or "")
            self.open = len(self.blocks) - 1
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                if self.open is None:  # a stream that left the block's start out
                    self.blocks.append("")
                    self.open = len(self.blocks) - 1
                self.blocks[self.open] += delta["text"]
                self.text += delta["text"]
                self.tokens += 1
            elif delta.get("type") not in ("citations_delta",):
                self.problem = "a tool call in progress"
        elif kind == "content_block_stop":
            self.open = None
        elif kind == "message_delta":
            self.delta_sent = True
            self.finished = ((data.get("delta") or {}).get("stop_reason")) or "end_turn"

    def _prefill(self, body: JSON) -> None:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), (str, list)):
            messages[-1] = {**last, "content": _joined(last["content"], "text", self.text)}  # the client's own prefill
        else:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": self.text}]})
        body["messages"] = messages

    def _seam(self) -> Seam:
        return MessagesSeam(self)

    def _ending(self) -> list[bytes]:
        events = []
        if self.open is not None:
            events.append(_typed("content_block_stop", {"index": self.open}))
        if not self.delta_sent:
            events.append(_typed("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                                   "usage": {"output_tokens": self.tokens}}))
        return [*events, _typed("message_stop", {})]


def _typed(kind: str, data: JSON) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + _dump({"type": kind, **data})


class MessagesSeam(Seam):
    t: MessagesTranscript

    def __init__(self, transcript: MessagesTranscript):
        super().__init__(transcript)
        # the continuation's first block goes on in the open one, or comes after the last
        self.continues = transcript.open is not None
        self.offset = transcript.open if transcript.open is not None else len(transcript.blocks)
        self.started = transcript.started

    def take(self, data: JSON) -> JSON | None:
        kind = data.get("type")
        if kind == "message_start":
            usage = (data.get("message") or {}).get("usage") or {}
            self.prompt(sum(_int(usage.get(f)) for f in ("input_tokens", "cache_read_input_tokens",
                                                          "cache_creation_input_tokens")))
            return None if self.started else data
        if kind == "content_block_start" and self.continues and _int(data.get("index")) == 0:
            return None
        if "index" in data and kind in ("content_block_start", "content_block_delta", "content_block_stop"):
            data["index"] = _int(data.get("index")) + self.offset
        if kind == "message_delta" and isinstance(data.get("usage"), dict):
            usage = data["usage"]
            data["usage"] = {**usage, "output_tokens": self.before + _int(usage.get("output_tokens"))}
            if any(f in usage for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")):
                data["usage"].update(input_tokens=self.t.prompt, cache_read_input_tokens=0,
                                     cache_creation_input_tokens=0)
        return data


# OpenAI's Responses


class ResponsesTranscript(Transcript):
    token_fields = ("max_output_tokens",)

    def __init__(self, body: JSON, prompt_about: int = 0, grammar: bool = False):
        super().__init__(body, prompt_about, grammar)
        self.response: JSON = {}  # as response.created said
        self.items: list[JSON] = []  # output items passed: {"id", "text", "open", "part_open", "parts"}
        self.sequence = -1  # the last sequence number passed
        self.completed = False

    def read(self, data: JSON) -> None:
        kind = data.get("type")
        if isinstance(data.get("sequence_number"), int):
            self.sequence = max(self.sequence, data["sequence_number"])
        if kind == "response.created" and isinstance(data.get("response"), dict):
            self.response = data["response"]
        elif kind == "response.output_item.added":
            item = data.get("item") or {}
            if item.get("type") != "message":
                self.problem = "a tool call in progress" if "call" in str(item.get("type")) else "reasoning in progress"
            self.items.append({"id": item.get("id") or "", "text": "", "open": True, "part_open": False, "parts": 0})
        elif kind == "response.content_part.added" and self.items:
            self.items[-1]["part_open"] = True
            self.items[-1]["parts"] += 1
        elif kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
            if not self.items:
                self.items.append({"id": data.get("item_id") or "", "text": "", "open": True, "part_open": True,
                                   "parts": 1})
            self.items[-1]["text"] += data["delta"]
            self.text += data["delta"]
            self.tokens += 1
        elif kind == "response.content_part.done" and self.items:
            self.items[-1]["part_open"] = False
        elif kind == "response.output_item.done" and self.items:
            self.items[-1]["open"] = False
        elif kind == "response.completed":
            self.completed = True
            self.finished = "completed"
        elif kind and kind.startswith(("response.function_call", "response.reasoning", "response.custom_tool")):
            self.problem = "a tool call or reasoning in progress"

    def _prefill(self, body: JSON) -> None:
        given = body["input"]
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
        part = {"type": "output_text", "text": self.text}
        last = items[-1] if items else None
        if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), (str, list)):
            items[-1] = {**last, "content": _joined(last["content"], "output_text", self.text)}  # the client's prefill
        else:
            items.append({"type": "message", "role": "assistant", "content": [part]})
        body["input"] = items

    def _seam(self) -> Seam:
        return ResponsesSeam(self)

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence

    def _ending(self) -> list[bytes]:
        if self.completed:
            return []
        events = []
        item: JSON = self.items[-1] if self.items else {"id": "", "text": "", "open": False, "part_open": False,
                                                         "parts": 0}
        at = {"output_index": len(self.items) - 1, "item_id": item["id"]}
        part = {"type": "output_text", "text": item["text"], "annotations": [], "logprobs": []}
        if item["part_open"]:
            events.append(_typed("response.output_text.done", {**at, "content_index": item["parts"] - 1,
                                                               "text": item["text"], "logprobs": [],
                                                               "sequence_number": self._next()}))
            events.append(_typed("response.content_part.done", {**at, "content_index": item["parts"] - 1,
                                                                "part": part, "sequence_number": self._next()}))
        done = {"id": item["id"], "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        if item["open"]:
            events.append(_typed("response.output_item.done", {"output_index": at["output_index"], "item": done,
                                                               "sequence_number": self._next()}))
        prompt = self.prompt or self.prompt_about
        response = {**self.response, "status": "completed", "completed_at": int(time.time()),
                    "output": [{"id": i["id"], "type": "message", "status": "completed", "role": "assistant",
                                "content": [{**part, "text": i["text"]}]} for i in self.items],
                    "usage": {"input_tokens": prompt, "output_tokens": self.tokens,
                              "total_tokens": prompt + self.tokens}}
        events.append(_typed("response.completed", {"response": response, "sequence_number": self._next()}))
        return events


class ResponsesSeam(Seam):
    t: ResponsesTranscript

    def __init__(self, transcript: ResponsesTranscript):
        super().__init__(transcript)
        items = transcript.items
        self.continues = bool(items) and items[-1]["open"]  # the continuation's first item is the open one
        self.part_continues = self.continues and items[-1]["part_open"]
        self.offset = len(items) - 1 if self.continues else len(items)
        self.first_id = ""  # the continuation's first item's id
        self.texts = {i: item["text"] for i, item in enumerate(items)}  # by output index, before the seam

    def take(self, data: JSON) -> JSON | None:
        t = self.t
        kind = data.get("type")
        if kind in ("response.created", "response.in_progress", "response.queued") and t.response:
            return None
        item = data.get("item") if isinstance(data.get("item"), dict) else None
        index = _int(data.get("output_index")) + self.offset
        if kind == "response.output_item.added" and item is not None and not self.first_id:
            self.first_id = item.get("id") or ""
            if self.continues:
                return None
        if kind == "response.content_part.added" and self.part_continues:
            self.part_continues = False
            return None
        own = t.items[self.offset]["id"] if self.continues and self.offset < len(t.items) else ""
        if own and data.get("item_id") in (self.first_id, None, ""):
            data["item_id"] = own
        if item is not None and own and item.get("id") in (self.first_id, ""):
            data["item"] = item = {**item, "id": own}
        if "output_index" in data:
            data["output_index"] = index
        prefill = self.texts.get(index, "")
        if kind == "response.output_text.done":
            data["text"] = self._whole(data.get("text"), prefill)
        elif kind == "response.content_part.done" and isinstance(data.get("part"), dict):
            data["part"] = {**data["part"], "text": self._whole(data["part"].get("text"), prefill)}
        elif kind == "response.output_item.done" and item is not None:
            data["item"] = self._item(item, prefill)
        elif kind == "response.completed" and isinstance(data.get("response"), dict):
            data["response"] = self._response(data["response"])
        if "sequence_number" in data:
            data["sequence_number"] = t._next()
        return data

    def _whole(self, text: object, prefill: str) -> object:
        if isinstance(text, str) and prefill and not text.startswith(prefill):
            return prefill + text
        return text

    def _item(self, item: JSON, prefill: str) -> JSON:
        content = item.get("content")
        if isinstance(content, list) and content and isinstance(content[0], dict):
            content = [{**content[0], "text": self._whole(content[0].get("text"), prefill)}, *content[1:]]
            item = {**item, "content": content}
        return item

    def _response(self, response: JSON) -> JSON:
        t = self.t
        before = [{"id": i["id"], "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": i["text"], "annotations": [], "logprobs": []}]}
                  for i in t.items[:self.offset]]
        output = []
        for n, item in enumerate(response.get("output") or []):
            if isinstance(item, dict):
                if n == 0 and self.continues and item.get("id") in (self.first_id, ""):
                    item = {**item, "id": t.items[self.offset]["id"]}
                output.append(self._item(item, self.texts.get(n + self.offset, "")))
        said = response.get("usage")
        usage: JSON = said if isinstance(said, dict) else {}
        prompt = self.prompt(_int(usage.get("input_tokens")))
        completion = self.before + _int(usage.get("output_tokens"))
        keep: JSON = {k: t.response[k] for k in ("id", "created_at", "model") if k in t.response}
        return {**response, **keep, "output": [*before, *output],
                "usage": {**usage, "input_tokens": prompt, "output_tokens": completion,
                          "total_tokens": prompt + completion}}
