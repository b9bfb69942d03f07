"""A request's id and its trace, from the client to the engine and back.

Every request through /v1/ has an id: the client's `X-Request-Id` when it sent a sane one (up to 128 characters of
letters, digits and `._:/+=@-`, beginning with a letter or digit), else a new one (`req_` and 24 hex digits). It
goes back in `X-Request-Id` (and in `Request-Id`, where Anthropic's SDK reads it) on every answer, errors
included, and in every error body (`request_id`), and on to the engine. A W3C `traceparent` from the client is
kept, its trace continued: the gateway's own span (a new span id) is the engine's parent; a request that came with
none begins a trace. The engine gets both headers.

The id of the request a task serves is `current_id`'s (set by gateway.handler for each request): the errors read
it wherever they are made, with nothing handed down to them.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from typing import NamedTuple

HEADER = "X-Request-Id"
ANTHROPIC_HEADER = "Request-Id"  # the same, where Anthropic's API and SDK look for it
_SANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}", re.ASCII)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})", re.ASCII)
_NO_TRACE, _NO_SPAN = "0" * 32, "0" * 16
SAMPLED = "01"

current_id: ContextVar[str] = ContextVar("llmgw_request_id", default="")


class Trace(NamedTuple):
    trace_id: str  # 32 hex digits
    parent_id: str  # the client's span, 16 hex digits ("" when it sent no traceparent)
    span_id: str  # the gateway's span: the engine's parent
    flags: str  # 2 hex digits, as the client sent them (sampled when the gateway began the trace)

    def traceparent(self) -> str:
        """The header the engine gets: the same trace, the gateway's span its parent."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def identify(sent_id: str, sent_trace: str) -> tuple[str, Trace]:
    """The request's id (the client's when it is sane, else a new one) and its trace (the client's continued, or
    a new one where it sent none or one W3C's rules refuse: another version than 00, ids of zeros, upper case).
    One read of the system's randomness for all the new ids (a request's, a trace's, a span's)."""
    fresh = os.urandom(36).hex()
    rid = sent_id if sent_id and _SANE.fullmatch(sent_id) else "req_" + fresh[:24]
    found = _TRACEPARENT.fullmatch(sent_trace.strip()) if sent_trace else None
    if found is not None and found[1] != _NO_TRACE and found[2] != _NO_SPAN:
        return rid, Trace(found[1], found[2], fresh[56:], found[3])
    return rid, Trace(fresh[24:56], "", fresh[56:], SAMPLED)
