"""Prefix affinity: which replica a request goes to when its model routes by `prefix` (docs/routing.md).

An engine keeps the KV cache of the prompts it has seen, so a request whose prompt begins as an earlier one's
did is served fastest where that one was. Each request gets a key from the part of its prompt that stays the
same while a conversation goes on, and the key is placed on a ring of the model's ready replicas (consistent
hashing, many points per replica): the turns of one conversation, and requests opening with the same
messages, go to one replica; a replica joining or leaving moves only the keys of its own arcs. The ring is
walked from the key, and the first replica under the load bound takes the request (consistent hashing with
bounded loads: at most LOAD_FACTOR × the mean in flight, counted across every web process), so one popular
opening cannot pile onto one replica. A replica already tried (it failed before its first byte) is passed by.

Every web process builds the same ring from the same replica names: two gateways send a conversation to the
same replica, with no state of their own to disagree about. Pure: no Django, no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

POINTS = 160  # points per replica on the ring: each replica's share of the keys within a few per cent
# a replica takes a request while its in-flight count stays within this × the mean (LLMGW_ROUTING_LOAD_FACTOR).
# KubeAI's 1.25 moved a conversation off its replica as often as least-inflight did in bench/routing.py (each move
# a cold prefill); 2 kept most of them home and still spreads a burst of one opening (docs/routing.md)
LOAD_FACTOR = 2.0
COMPLETION_CHARS = 256  # of a completion's prompt, which has no messages to find its opening by
MAX_KEY_BYTES = 1 << 16  # what is hashed at most: beyond it two prompts may as well be the same


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


MAX_DEPTH = 32  # of content walked: a prompt nested deeper (which the gateway refuses first) adds nothing more


def _text(value: object, depth: int = 0) -> str:
    """A message's content, a prompt or an input as text: a string as it is; parts (text, image URLs, token
    ids) joined in order."""
    if isinstance(value, str):
        return value
    if depth >= MAX_DEPTH:
        return ""
    if isinstance(value, list):
        return "\x1e".join(_text(part, depth + 1) for part in value)
    if isinstance(value, dict):  # a content part: {"type": "text", "text": …}, {"type": "image_url", …}
        inner = value.get("text")
        if inner is None:
            inner = value.get("image_url") or value.get("input_audio") or ""
            if isinstance(inner, dict):
                inner = inner.get("url") or inner.get("data") or ""
        return _text(inner, depth + 1)
    return "" if value is None else str(value)


def chat_opening(messages: object) -> str:
    """Every message up to and including the first user message: the system prompt and the opening request,
    which every later turn of the conversation repeats unchanged. A shared instruction at the start of every
    first message (a template) is no problem: the whole message is the key, the document after it included."""
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        parts.append(f"{role}\x1f{_text(message.get('content'))}")
        if role == "user":
            break
    return "\x1d".join(parts)


def responses_opening(body: dict[str, Any]) -> str:
    """The Responses API's opening: its `instructions`, and its input up to and including the first user item
    (a string input is the user's message itself)."""
    items = body.get("input")
    if not isinstance(items, list):
        items = [{"role": "user", "content": items}]
    return f"instructions\x1f{_text(body.get('instructions'))}\x1d{chat_opening(items)}"


def chat_key_text(body: dict[str, Any]) -> str:
    """Chat completions: its opening (`chat_opening`)."""
    return chat_opening(body.get("messages"))


def messages_key_text(body: dict[str, Any]) -> str:
    """Anthropic's Messages (and its token count): its `system` prompt, then its opening."""
    return f"system\x1f{_text(body.get('system'))}\x1d{chat_opening(body.get('messages'))}"


def completion_key_text(body: dict[str, Any]) -> str:
    """Completions: the first COMPLETION_CHARS characters of the prompt (a prompt grows turn by turn, and nothing
    marks where its opening ends)."""
    return _text(body.get("prompt"))[:COMPLETION_CHARS]


def rerank_key_text(body: dict[str, Any]) -> str:
    """Rerank: its query and documents."""
    return f"{_text(body.get('query'))}\x1d{_text(body.get('documents'))}"


def input_key_text(body: dict[str, Any]) -> str:
    """Embeddings: the whole input (the same text, the same replica)."""
    return _text(body.get("input"))


def request_key(text: str) -> int:
    """The ring position of a request, from what its API's surface reads its prefix from (gateway/surfaces.py:
    `chat_key_text` and the rest here; Responses: `responses_opening`)."""
    return _hash(text.encode("utf-8", "surrogatepass")[:MAX_KEY_BYTES])


def session_key(session: str) -> int:
    """The ring position of every request of an agent's session (a session header's value): one replica for the
    whole session, whatever its requests open with."""
    return _hash(b"session\x00" + session.encode("utf-8", "surrogatepass")[:1024])


class Ring:
    """Replica names on a hash ring, POINTS each."""

    __slots__ = ("names", "_points", "_owners")

    def __init__(self, names: Iterable[str]):
        self.names = tuple(sorted(set(names)))
        placed = sorted(
            (_hash(f"{name}\x00{i}".encode()), index) for index, name in enumerate(self.names) for i in range(POINTS)
        )
        self._points = [point for point, _ in placed]
        self._owners = [index for _, index in placed]

    def __len__(self) -> int:
        return len(self.names)

    def walk(self, key: int) -> Iterator[str]:
        """Each replica once, in the ring's order from the key: the first is the key's own."""
        count = len(self._points)
        if not count:
            return
        start = bisect.bisect(self._points, key)
        seen: set[int] = set()
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield self.names[owner]
                if len(seen) == len(self.names):
                    return


def choose(ring: Ring, key: int, load_of: Callable[[str], int], exclude: Collection[str] = (),
           factor: float = LOAD_FACTOR) -> str | None:
    """The first replica from the key that is not excluded and whose in-flight count, with this request, stays
    within the bound: ceil(factor × (everything in flight + 1) / replicas). None when every one is excluded."""
    loads = {name: load_of(name) for name in ring.names if name not in exclude}
    if not loads:
        return None
    bound = math.ceil(factor * (sum(loads.values()) + 1) / len(loads))
    for name in ring.walk(key):
        if name in loads and loads[name] + 1 <= bound:
            return name
    return min(loads, key=loads.__getitem__)  # not reached: some replica is at or below the mean
