"""Messages and Responses streams completed for the SDKs that read them.

Anthropic's SDK (`client.messages.stream(...)`) and OpenAI's (`client.responses.stream(...)`) build the answer
from a stream's events as they come, and index by fields an engine may leave out: llama.cpp's server sends
Responses events without `sequence_number`, `output_index` or `content_index` (OpenAI's SDK then fails with
"list indices must be integers or slices, not NoneType" on `output.content[event.content_index]`), and now and
then a Messages stream without its `message_start`. Each event is completed here from what the stream said
before it: the output item and content part (or content block) it belongs to, its place in the stream, its
`event:` line (Anthropic's SDK reads no event without one). An event that has all its fields passes as it came,
after a few byte searches; one that lacks some gets them written in at its start. Nothing is parsed but a
Messages stream's start that lacks its usage, or an item whose id is not plain to see; a delta that begins as
the one before it did (a token's, most events) costs a comparison, a search and a join (about a microsecond).
An engine's own values are never changed.

The fields are those the SDKs read (openai/lib/streaming/responses/_responses.py, anthropic/lib/streaming/
_messages.py) and their event types require.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

# Responses: the events about the response as a whole, which belong to no output item
_LIFECYCLE = frozenset(b"response." + k for k in (b"created", b"in_progress", b"completed", b"failed", b"incomplete",
                                                  b"queued"))
_IN_A_PART = (b"response.content_part.", b"response.output_text.", b"response.refusal.", b"response.reasoning_text.")
_IN_A_SUMMARY = (b"response.reasoning_summary_part.", b"response.reasoning_summary_text.")
_RESPONSES_TYPE = re.compile(rb'"type"\s*:\s*"(response\.[\w.]+|error)"')
_MESSAGES_TYPE = re.compile(rb'"type"\s*:\s*"(message_start|message_delta|message_stop|content_block_start|'
                            rb'content_block_delta|content_block_stop|ping|error)"')
_ITEM_ID = re.compile(rb'"item_id"\s*:\s*"([^"\\]*)"')
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')
_OUTPUT_INDEX = re.compile(rb'"output_index"\s*:\s*(\d+)')
_DELTA_TYPE = re.compile(rb'"type"\s*:\s*"(text|citations|thinking|signature|input_json)_delta"')
# the content block a delta of each kind belongs to, for a stream that left the block's start out
_BLOCKS = {b"text": {"type": "text", "text": ""}, b"citations": {"type": "text", "text": ""},
           b"thinking": {"type": "thinking", "thinking": "", "signature": ""},
           b"signature": {"type": "thinking", "thinking": "", "signature": ""}}
_BEGINS = frozenset((b"response.output_item.added", b"response.content_part.added",
                     b"response.reasoning_summary_part.added"))  # what later events of an item or part refer to
_NEEDS: dict[bytes, tuple[bytes, ...]] = {}
_FIELDS = re.compile(rb'"(?:sequence_number|output_index|item_id|content_index|logprobs|summary_index)"')
_MISSING: dict[tuple[bytes, ...], tuple[bytes, ...]] = {}  # by type and the fields found
_SEQUENCE, _OUTPUT, _ITEM = b'"sequence_number"', b'"output_index"', b'"item_id"'
_CONTENT, _SUMMARY, _LOGPROBS = b'"content_index"', b'"summary_index"', b'"logprobs"'
_SEQUENCE_ONLY = (_SEQUENCE,)
_PART_INDEX = {_CONTENT: re.compile(rb'"content_index"\s*:\s*(\d+)'), _SUMMARY: re.compile(rb'"summary_index"\s*:\s*(\d+)')}
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]*)"')
# what is written into an event, by what it lacks and where it is (its output index, item id, part)
_WRITTEN: dict[tuple[tuple[bytes, ...], int, str | None, int | None], bytes] = {}


def responses_needs(kind: bytes) -> tuple[bytes, ...]:
    """The fields a Responses event of this type must have (as OpenAI's SDK types it), each as `"name"`."""
    needs = _NEEDS.get(kind)
    if needs is None:
        fields = []
        if kind.startswith(b"response.") or kind == b"error":
            fields.append("sequence_number")
            if kind not in _LIFECYCLE and kind != b"error" and not kind.startswith(b"response.audio."):
                fields.append("output_index")
                if not kind.startswith((b"response.output_item.", b"response.shell_call_command.")):
                    fields.append("item_id")
                if kind.startswith(_IN_A_PART):
                    fields.append("content_index")
                if kind in (b"response.output_text.delta", b"response.output_text.done"):
                    fields.append("logprobs")
                if kind.startswith(_IN_A_SUMMARY):
                    fields.append("summary_index")
        named = {n[1:-1].decode(): n for n in (_SEQUENCE, _OUTPUT, _ITEM, _CONTENT, _SUMMARY, _LOGPROBS)}
        needs = tuple(named[f] for f in fields)
        if len(_NEEDS) < 256:  # the types there are, not whatever an engine makes up
            _NEEDS[kind] = needs
    return needs


def _missing(found: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The fields a Responses event of type found[0] lacks, having those of found[1:]."""
    missing = tuple([need for need in responses_needs(found[0]) if need not in found[1:]])
    missing = _SEQUENCE_ONLY if missing == _SEQUENCE_ONLY else missing
    if len(_MISSING) < 1024:
        _MISSING[found] = missing
    return missing


def _split(event: bytes, types: re.Pattern[bytes]) -> tuple[bytes, bytes, int, int] | None:
    """(the `event:` line's type or b"", the event's type (that line's, else its data's `type` of `types`), where
    the data's JSON object starts, where it ends), or None for an event with no such data (a comment, `[DONE]`)
    or of no type known."""
    # the form engines send (llama.cpp's, OpenAI's, Anthropic's): `event: TYPE`, then the data on one line
    newline = event.find(b"\n")
    at = newline + 7
    if event[:7] == b"event: " and event[newline:at + 1] == b"\ndata: {":
        named = event[7:newline]
        return named, named, at, len(event)
    if event.startswith(b"data:"):
        at, named = 5, b""
    else:
        at = event.find(b"\ndata:") + 6
        if at == 5:
            return None
        named = event[6:newline].strip() if event.startswith(b"event:") else b""
    end = event.find(b"\n", at)
    end = len(event) if end < 0 else end
    while at < end and event[at] in b" \t":
        at += 1
    if at == end or event[at] != 0x7B:  # "{"
        return None
    if named:
        return named, named, at, end
    found = types.search(event, at, end)
    return None if found is None else (b"", found.group(1), at, end)


def _parsed(event: bytes, at: int, end: int) -> dict[str, Any]:
    try:
        data = json.loads(event[at:end])
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


class ResponsesEvents:
    """One Responses stream's events, completed: each event's place in the stream (`sequence_number`), the output
    item it belongs to (`output_index`, `item_id`: the one it names, else the last begun), its content part
    (`content_index`: the item's last begun) or summary part (`summary_index`), and a text event's `logprobs`.
    Read with a few searches of the bytes: nothing is parsed unless an item's id is not plain to see."""

    def __init__(self, model: str = "", prompt: int = 0):
        self.sequence = 0
        self.items: list[str] = []  # the output items' ids, by output index
        self.parts: dict[tuple[bytes, int], int] = {}  # parts begun, by (the field counting them, output index)
        # _written's, by (what is missing, output index) until a part begins
        self.known: dict[tuple[tuple[bytes, ...], int], bytes] = {}
        # the last delta's bytes up to its `"delta"`, where the fields go, what goes before them, the fields but
        # its sequence number, whether that is written too: the next delta that begins with the same bytes and
        # has none of the fields after them gets the same (most events: one a token)
        self.delta: tuple[bytes, int, bytes, bytes, bool] | None = None

    def __call__(self, event: bytes) -> bytes:
        delta = self.delta
        if delta is not None and event.startswith(delta[0]) and _FIELDS.search(event, len(delta[0])) is None:
            _, cut, before, written, numbered = delta
            if numbered:
                written = b'"sequence_number":%d,' % self.sequence + written
            self.sequence += 1
            return before + written + event[cut:]
        split = _split(event, _RESPONSES_TYPE)
        if split is None:
            return event
        named, kind, at, end = split
        number = self.sequence
        self.sequence = number + 1
        # the fields it has, and so those it lacks (one search: the `event:` line has no quotes, a string's are
        # escaped)
        found = (kind, *_FIELDS.findall(event, at, end))
        missing = _MISSING.get(found)
        if missing is None:
            missing = _missing(found)
        if kind in _BEGINS:
            self.known.clear()
            self.delta = None
            index, part = self._begin(kind, event, at, end, found)
            written = self._written(missing, index, part)
        elif not missing:
            return event if named else b"event: " + kind + b"\n" + event
        elif missing is _SEQUENCE_ONLY:
            written = b""
        else:
            lacks = _OUTPUT not in found
            index = 0 if lacks and len(self.items) < 2 else self._item_of(kind, event, at, end, lacks)
            known = self.known.get((missing, index))
            if known is None:
                known = self.known[missing, index] = self._written(missing, index, None)
            written = known
            if kind.endswith(b".delta"):
                self._remember(event, kind, named, at, written, missing[0] is _SEQUENCE)
        if missing and missing[0] is _SEQUENCE:
            written = b'"sequence_number":%d,' % number + written
        return _insert(event, kind, named, at, written)

    def _remember(self, event: bytes, kind: bytes, named: bytes, at: int, written: bytes, numbered: bool) -> None:
        """A delta's, for the next (self.delta): where its bytes up to its `"delta"` name its type (its `event:`
        line, or its `type` before the delta) and hold every field it has."""
        cut = event.find(b'"delta"', at)
        typed = named or b'"%s"' % kind in event[at:cut]
        if cut > at and typed and _FIELDS.search(event, cut) is None:
            before = event[:at + 1] if named else b"event: " + kind + b"\n" + event[:at + 1]
            self.delta = (event[:cut], at + 1, before, written, numbered)

    def _item_of(self, kind: bytes, event: bytes, at: int, end: int, missing: bool) -> int:
        """The output item an event belongs to: the one it names (its `output_index`, `item_id`, its item's `id`),
        else the last begun."""
        if not missing:
            given = _given_index(event, _OUTPUT_INDEX, at, end)
            if given is not None:
                return given
        if len(self.items) > 1:
            item_id = _item_id(event, at, end) if kind == b"response.output_item.done" else _named(event, at, end)
            if item_id in self.items:
                return self.items.index(item_id)
        return max(len(self.items) - 1, 0)

    def _begin(self, kind: bytes, event: bytes, at: int, end: int, found: tuple[bytes, ...]) -> tuple[int, int | None]:
        """An event that begins an output item, or a part of one: (the item's output index, the part's index)."""
        if kind == b"response.output_item.added":
            given = _given_index(event, _OUTPUT_INDEX, at, end) if _OUTPUT in found else None
            index = len(self.items) if given is None else given
            self.items.extend([""] * (index + 1 - len(self.items)))
            self.items[index] = _item_id(event, at, end)
            return index, None
        index = self._item_of(kind, event, at, end, _OUTPUT not in found)
        field = _CONTENT if kind == b"response.content_part.added" else _SUMMARY
        given = _given_index(event, _PART_INDEX[field], at, end) if field in found else None
        part = self.parts.get((field, index), 0) if given is None else given
        self.parts[field, index] = max(self.parts.get((field, index), 0), part + 1)
        return index, part

    def _written(self, missing: tuple[bytes, ...], index: int, part: int | None) -> bytes:
        """What an event of output item `index` (and, where it begins one, part `part`) lacking these fields gets
        written in, its sequence number aside."""
        item = self.items[index] if _ITEM in missing and index < len(self.items) else None
        if _CONTENT in missing or _SUMMARY in missing:
            field = _CONTENT if _CONTENT in missing else _SUMMARY
            if part is None:
                part = max(self.parts.get((field, index), 1) - 1, 0)
        key = (missing, index, item, part)
        written = _WRITTEN.get(key)
        if written is None:
            fill: dict[str, object] = {}
            for need in missing:
                if need == _SEQUENCE:
                    continue
                if need == _OUTPUT:
                    fill["output_index"] = index
                elif need == _ITEM and item:  # no item begun to name: left out, as it came
                    fill["item_id"] = item
                elif need in (_CONTENT, _SUMMARY):
                    fill[need[1:-1].decode()] = part
                elif need == _LOGPROBS:
                    fill["logprobs"] = []
            written = _fields(fill)
            if len(_WRITTEN) >= 4096:  # each stream's item ids: the table is a cache, not a record
                _WRITTEN.clear()
            _WRITTEN[key] = written
        return written


def _item_id(event: bytes, at: int, end: int) -> str:
    """The `id` of the item an `output_item` event carries: read off the bytes where it has one `"id"`, else
    parsed."""
    ids: list[bytes] = _ID.findall(event, at, end)  # one group: each match its bytes
    if len(ids) == 1:
        return ids[0].decode(errors="replace")
    item = _parsed(event, at, end).get("item")
    item_id = item.get("id") if isinstance(item, dict) else None
    return item_id if isinstance(item_id, str) else ""


def _named(event: bytes, at: int, end: int) -> str | None:
    found = _ITEM_ID.search(event, at, end)
    return found.group(1).decode(errors="replace") if found is not None else None


def _fields(fill: dict[str, object]) -> bytes:
    return b"".join(b'"%s":%s,' % (k.encode(), b"%d" % v if type(v) is int else json.dumps(v).encode())
                    for k, v in fill.items())


def _insert(event: bytes, kind: bytes, named: bytes, at: int, fields: bytes) -> bytes:
    """The event with these fields (each `"name":value,`) first in its object, and its `event:` line where it
    had none."""
    if fields:
        rest = event[at + 1:]
        if rest[:1] in b"} \t\r\n" and rest.lstrip()[:1] == b"}":  # an empty object
            fields = fields[:-1]
        event = event[:at + 1] + fields + rest
    return event if named else b"event: " + kind + b"\n" + event


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 20


def _given_index(data: bytes, pattern: re.Pattern[bytes], at: int = 0, end: int | None = None) -> int | None:
    found = pattern.search(data, at, len(data) if end is None else end)
    return int(found.group(1)) if found is not None and int(found.group(1)) < 1 << 20 else None


class MessagesEvents:
    """One Messages stream's events, completed: a `message_start` first where the engine left it out (its input
    tokens llmgw's estimate; the engine's `message_delta` gives the output tokens), the content block each block
    event belongs to (`index`: the last begun), a block's start where it was left out, `usage` where the SDK
    reads it, and each event's `event:` line."""

    def __init__(self, model: str = "", prompt: int = 0):
        self.model, self.prompt = model, prompt
        self.begun = False
        self.blocks: set[int] = set()  # the content blocks begun
        self.current = -1  # the last begun
        self.deltas = 0

    def __call__(self, event: bytes) -> bytes:
        if self.blocks and event.startswith(b"event: content_block_delta\n") and b'"index"' in event:
            self.deltas += 1  # (most events: one a token)
            return event
        split = _split(event, _MESSAGES_TYPE)
        if split is None:
            return event
        named, kind, at, end = split
        before = b""
        if not self.begun and kind != b"ping":
            self.begun = True
            if kind not in (b"message_start", b"error"):
                before = message_start(self.model, self.prompt) + b"\n\n"
        data = event[at:end]
        fill: dict[str, object] = {}
        if kind == b"content_block_delta":
            self.deltas += 1
            if b'"index"' not in data or not self.blocks:
                given = _given_index(data, _INDEX)
                index = self.current if given is None else given
                if index < 0 or index not in self.blocks:
                    before += self._block_start(data, max(index, 0))
                if given is None:
                    fill["index"] = max(self.current, 0)
        elif kind == b"content_block_start":
            given = _given_index(data, _INDEX)
            index = max(self.blocks, default=-1) + 1 if given is None else given
            self.blocks.add(index)
            self.current = index
            if given is None:
                fill["index"] = index
        elif kind == b"content_block_stop":
            if b'"index"' not in data:
                fill["index"] = max(self.current, 0)
        elif kind == b"message_delta":
            if b'"usage"' not in data:
                fill["usage"] = {"output_tokens": self.deltas}
        elif kind == b"message_start" and (b'"usage"' not in data or b'"content"' not in data):
            message = _parsed(event, at, end).get("message")
            if isinstance(message, dict):
                message.setdefault("content", [])
                message.setdefault("usage", {"input_tokens": self.prompt, "output_tokens": 0})
                event = event[:at] + json.dumps({"type": "message_start", "message": message}).encode() + event[end:]
        if not fill and named and not before:
            return event
        return before + _insert(event, kind, named, at, _fields(fill))

    def _block_start(self, data: bytes, index: int) -> bytes:
        """The `content_block_start` a delta's block lacks (a text or thinking block; a tool's input cannot be
        begun without its name, so that delta passes as it came)."""
        found = _DELTA_TYPE.search(data)
        block = _BLOCKS.get(found.group(1)) if found is not None else None
        if block is None:
            return b""
        self.blocks.add(index)
        self.current = index
        body = {"type": "content_block_start", "index": index, "content_block": block}
        return b"event: content_block_start\ndata: " + json.dumps(body).encode() + b"\n\n"


def message_start(model: str, prompt: int) -> bytes:
    """The `message_start` a Messages stream must open with, for an engine that left it out: llama.cpp's server
    does now and then (its first token a character still incomplete), and Anthropic's SDK then has no message to
    build. Its input tokens are llmgw's estimate; the engine's `message_delta` gives the output tokens."""
    message: dict[str, object] = {
        "id": f"msg_llmgw_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "content": [],
        "model": model, "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0}}
    return f"event: message_start\ndata: {json.dumps({'type': 'message_start', 'message': message})}".encode()
