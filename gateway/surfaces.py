"""The APIs the gateway routes, each as its clients speak it: OpenAI's chat completions, completions, embeddings
and Responses, Anthropic's Messages (and its token count), and rerank.

Not a translation layer: a request goes to an engine that serves its API as it came. What differs between them
is described here, once, in one entry each (`SURFACES`), and nowhere else: its path and what a model must serve
for it; the fields a request cannot do without, and those it may not have; where its messages are (their images
and audio); how long its prompt is about (gateway/prompt.py) and what its prefix key is read from
(gateway/affinity.py); the fields that cap what it generates; whether it takes an engine's slot; where its usage
is, in a whole answer and in the events of a stream, and whether a stream carries it unasked; which event ends a
stream, and what its SDK's stream helpers need filled in; and how an error looks to its SDK (OpenAI's
`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`), so that each raises its own typed
exception. A new API is one entry here (its URL, view and tests follow from it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from gateway import affinity, prompt
from gateway.errors import GatewayError, error_response
from gateway.http import Answer, json_answer
from gateway.prompt import Size
from gateway.resume import ChatTranscript, CompletionsTranscript, MessagesTranscript, ResponsesTranscript, Transcript
from gateway.streams import MessagesEvents, ResponsesEvents
from gateway.tracing import current_id
from gateway.upstream import TOKEN_FIELDS

OPENAI, ANTHROPIC = "openai", "anthropic"

# A request's or an answer's body as it parsed: an object of any fields, read field by field and checked there
JSON = dict[str, Any]

# Anthropic's error types, by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


# the headers that name an agent's session: its requests stay on one replica (docs/routing.md)
SESSION_HEADERS = ("x-llmgw-session", "x-claude-code-session-id", "session_id", "session-id")


@dataclass(frozen=True)
class Usage:
    prompt: int = 0
    completion: int = 0


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def openai_usage(usage: JSON) -> Usage:
    """chat completions, completions, embeddings, rerank (llama.cpp's: prompt_tokens, total_tokens)."""
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))


def anthropic_usage(usage: JSON) -> Usage:
    """Messages: `input_tokens` counts what was not read from or written to the prompt cache."""
    prompt = sum(_int(usage.get(f)) for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    return Usage(prompt, _int(usage.get("output_tokens")))


def responses_usage(usage: JSON) -> Usage:
    return Usage(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")))


def openai_event_usage(data: JSON, prompt: int, completion: int) -> tuple[int, int, bool] | None:
    usage = data.get("usage")
    if isinstance(usage, dict) and usage:
        said = openai_usage(usage)
        return said.prompt, said.completion, True
    return None


def anthropic_event_usage(data: JSON, prompt: int, completion: int) -> tuple[int, int, bool] | None:
    kind = data.get("type")
    if kind == "message_start" and isinstance(data.get("message"), dict):
        said = anthropic_usage(data["message"].get("usage") or {})
        return said.prompt, said.completion, False
    if kind == "message_delta" and isinstance(data.get("usage"), dict):
        usage = data["usage"]
        if any(f in usage for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")):
            prompt = anthropic_usage(usage).prompt or prompt
        return prompt, _int(usage.get("output_tokens")), True  # output_tokens is the running total
    return None


def responses_event_usage(data: JSON, prompt: int, completion: int) -> tuple[int, int, bool] | None:
    response = data.get("response")
    if data.get("type") == "response.completed" and isinstance(response, dict) and isinstance(response.get("usage"), dict):
        said = responses_usage(response["usage"])
        return said.prompt, said.completion, True
    return None


def openai_error_event(exc: GatewayError) -> bytes:
    return exc.event() + b"data: [DONE]\n\n"


def _with_id(body: JSON) -> JSON:
    """An error body naming its request (gateway/tracing.py), where it has an id."""
    if rid := current_id.get():
        body["request_id"] = rid
    return body


def anthropic_error_event(exc: GatewayError) -> bytes:
    body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": exc.message}}
    return f"event: error\ndata: {json.dumps(_with_id(body))}\n\n".encode()


def responses_error_event(exc: GatewayError) -> bytes:
    body = {"type": "error", "code": exc.code, "message": exc.message, "param": None}
    return f"event: error\ndata: {json.dumps(_with_id(body))}\n\n".encode()


EventUsage = Callable[[JSON, int, int], "tuple[int, int, bool] | None"]


@dataclass(frozen=True)
class Surface:
    path: str  # under /v1/
    capability: str  # what a model must serve (ground.engines.CAPABILITIES)
    needs: tuple[str, ...]  # fields a request cannot do without
    prompt_size: Callable[[JSON], Size]  # how long its prompt is, about and at least (gateway/prompt.py)
    key_text: Callable[[JSON], str]  # what its prefix key is read from (gateway/affinity.py)
    session_headers: tuple[str, ...] = SESSION_HEADERS  # the headers that name a client's session, first found
    items: str | None = None  # the field its messages are in (their content parts: images, audio)
    refused: tuple[tuple[str, str], ...] = ()  # fields a request may not have, and why
    token_fields: tuple[str, ...] = ()  # what caps what it generates (the model's and the key's max tokens)
    flavour: str = OPENAI  # whose errors: OpenAI's or Anthropic's shape
    generates: bool = True  # a completion: its max tokens count toward a key's tokens per minute
    admits: bool = True  # it takes an engine's slot, and may stream (a token count: neither)
    usage_unasked: bool = False  # its streams carry their usage of their own (no `stream_options` to ask for it)
    usage_of: Callable[[JSON], Usage] = openai_usage  # a whole answer's usage, from its `usage`
    event_usage: EventUsage = openai_event_usage  # what one event of a stream says of its usage
    error_event: Callable[[GatewayError], bytes] = openai_error_event  # an error in a stream already begun
    done_event: bytes = b"data: [DONE]"  # how the event that ends a stream begins
    # a stream's events completed for the SDKs' accumulators, made per stream from (model, prompt tokens about)
    completer: Callable[[str, int], Callable[[bytes], bytes]] | None = None
    # what a stream passed, and how it goes on when its engine fails (gateway/resume.py), made per stream from
    # (the request as sent, prompt tokens about, whether its engine takes a grammar); None: its answers are whole,
    # sent again from their start
    resumer: Callable[[JSON, int, bool], Transcript] | None = None

    def error(self, exc: GatewayError) -> Answer:
        if self.flavour == ANTHROPIC:
            return anthropic_error(exc.status, exc.message, exc.retry_after)
        return exc.response()

    def usage(self, body: JSON) -> Usage | None:
        """A whole answer's usage."""
        usage = body.get("usage")
        return self.usage_of(usage) if isinstance(usage, dict) else None

    def prefix_key(self, body: JSON) -> int:
        """The request's position on its model's ring (`prefix` routing)."""
        return affinity.request_key(self.key_text(body))


class Streams(TypedDict):
    """What a surface's streams are like, where they are not OpenAI's (Surface's fields of these names)."""

    usage_unasked: bool
    usage_of: Callable[[JSON], Usage]
    event_usage: EventUsage
    error_event: Callable[[GatewayError], bytes]
    done_event: bytes


ANTHROPIC_STREAMS: Streams = {"usage_unasked": True, "usage_of": anthropic_usage,
                              "event_usage": anthropic_event_usage, "error_event": anthropic_error_event,
                              "done_event": b"event: message_stop"}
STATEFUL = "is not supported: llmgw's engines keep no responses between requests; send the whole conversation as `input`"

SURFACES = {
    s.path: s
    for s in (
        Surface("chat/completions", "chat", ("messages",), prompt.chat_size, affinity.chat_key_text, items="messages",
                token_fields=TOKEN_FIELDS, resumer=ChatTranscript),
        Surface("completions", "completions", ("prompt",), prompt.completion_size, affinity.completion_key_text,
                token_fields=TOKEN_FIELDS, resumer=CompletionsTranscript),
        Surface("embeddings", "embeddings", ("input",), prompt.input_size, affinity.input_key_text, generates=False,
                usage_unasked=True),
        Surface("messages", "messages", ("messages",), prompt.messages_size, affinity.messages_key_text,
                items="messages", token_fields=("max_tokens",), flavour=ANTHROPIC, completer=MessagesEvents,
                resumer=MessagesTranscript, **ANTHROPIC_STREAMS),
        Surface("messages/count_tokens", "messages", ("messages",), prompt.messages_size, affinity.messages_key_text,
                items="messages", flavour=ANTHROPIC, generates=False, admits=False, **ANTHROPIC_STREAMS),
        Surface("responses", "responses", ("input",), prompt.responses_size, affinity.responses_opening, items="input",
                refused=(("previous_response_id", STATEFUL), ("conversation", STATEFUL)),
                token_fields=("max_output_tokens",), usage_unasked=True, usage_of=responses_usage,
                event_usage=responses_event_usage, error_event=responses_error_event,
                done_event=b"event: response.completed", completer=ResponsesEvents, resumer=ResponsesTranscript),
        Surface("rerank", "rerank", ("query", "documents"), prompt.rerank_size, affinity.rerank_key_text,
                generates=False, usage_unasked=True),
    )
}


def anthropic_error(status: int, message: str, retry_after: int | None = None) -> Answer:
    answer = json_answer(_with_id({"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                                               "message": message}}), status)
    if retry_after is not None:
        answer["Retry-After"] = str(max(1, int(retry_after)))
    return answer


def error_for(path: str, status: int, code: str, message: str, retry_after: int | None = None) -> Answer:
    """An error in the shape of the API a path belongs to (an unknown path under /v1/messages is Anthropic's)."""
    surface = next((s for s in SURFACES.values() if path.startswith(f"/v1/{s.path}")), None)
    if surface is not None:
        return surface.error(GatewayError(status, code, message, retry_after))
    return error_response(status, code, message, retry_after)
