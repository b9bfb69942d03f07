"""The APIs the gateway routes, each as its clients speak it: OpenAI's chat completions, completions, embeddings
and Responses, Anthropic's Messages (and its token count), and rerank.

Not a translation layer: a request goes to an engine that serves its API as it came. What differs between them
is described here once, for the views to use: the field a request cannot do without, the fields that cap what
it generates, where its usage is (in a whole answer, and in which events of a stream), which event ends a
stream, and how an error looks to the client's SDK (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error",
"error": {...}}`), so that each SDK raises its own typed exception.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import GatewayError, error_response
from gateway.http import Answer, json_answer
from gateway.streams import MessagesEvents, ResponsesEvents

OPENAI, ANTHROPIC = "openai", "anthropic"

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


@dataclass(frozen=True)
class Usage:
    prompt: int = 0
    completion: int = 0


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def openai_usage(usage: dict) -> Usage:
    """chat completions, completions, embeddings, rerank (llama.cpp's: prompt_tokens, total_tokens)."""
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))


def anthropic_usage(usage: dict) -> Usage:
    """Messages: `input_tokens` counts what was not read from or written to the prompt cache."""
    prompt = sum(_int(usage.get(f)) for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    return Usage(prompt, _int(usage.get("output_tokens")))


def responses_usage(usage: dict) -> Usage:
    return Usage(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")))


@dataclass(frozen=True)
class Surface:
    path: str  # under /v1/
    capability: str  # what a model must serve (ground.engines.CAPABILITIES)
    needs: tuple[str, ...]  # fields a request cannot do without
    token_fields: tuple[str, ...] = ()  # what caps what it generates (the model's and the key's max tokens)
    flavour: str = OPENAI  # whose errors and streams
    generates: bool = True  # a completion: its max tokens count toward a key's tokens per minute
    done_event: bytes = b"data: [DONE]"  # how the event that ends a stream begins
    # a stream's events completed for the SDKs' accumulators, made per stream from (model, prompt tokens about)
    completer: Callable[[str, int], Callable[[bytes], bytes]] | None = None

    def error(self, exc: GatewayError) -> Answer:
        if self.flavour == ANTHROPIC:
            return anthropic_error(exc.status, exc.message, exc.retry_after)
        return exc.response()

    def error_event(self, exc: GatewayError) -> bytes:
        """The same error, in a stream that already began: then the stream ends."""
        if self.flavour == ANTHROPIC:
            body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": exc.message}}
            return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        if self.path == "responses":
            body = {"type": "error", "code": exc.code, "message": exc.message, "param": None}
            return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        return exc.event() + b"data: [DONE]\n\n"

    def usage(self, body: dict) -> Usage | None:
        """A whole answer's usage."""
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return None
        if self.flavour == ANTHROPIC:
            return anthropic_usage(usage)
        if self.path == "responses":
            return responses_usage(usage)
        return openai_usage(usage)

    def event_usage(self, data: dict, prompt: int, completion: int) -> tuple[int, int, bool] | None:
        """What one event of a stream says of its usage, given what earlier ones said: (prompt, completion, whether
        that is the whole of it), or None when it says nothing."""
        kind = data.get("type")
        if self.flavour == ANTHROPIC:
            if kind == "message_start" and isinstance(data.get("message"), dict):
                said = anthropic_usage(data["message"].get("usage") or {})
                return said.prompt, said.completion, False
            if kind == "message_delta" and isinstance(data.get("usage"), dict):
                usage = data["usage"]
                if any(f in usage for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")):
                    prompt = anthropic_usage(usage).prompt or prompt
                return prompt, _int(usage.get("output_tokens")), True  # output_tokens is the running total
            return None
        if self.path == "responses":
            response = data.get("response")
            if kind == "response.completed" and isinstance(response, dict) and isinstance(response.get("usage"), dict):
                said = responses_usage(response["usage"])
                return said.prompt, said.completion, True
            return None
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            said = openai_usage(usage)
            return said.prompt, said.completion, True
        return None


SURFACES = {
    s.path: s
    for s in (
        Surface("chat/completions", "chat", ("messages",), ("max_tokens", "max_completion_tokens", "n_predict")),
        Surface("completions", "completions", ("prompt",), ("max_tokens", "max_completion_tokens", "n_predict")),
        Surface("embeddings", "embeddings", ("input",), generates=False),
        Surface("messages", "messages", ("messages",), ("max_tokens",), ANTHROPIC, done_event=b"event: message_stop",
                completer=MessagesEvents),
        Surface("messages/count_tokens", "messages", ("messages",), flavour=ANTHROPIC, generates=False),
        Surface("responses", "responses", ("input",), ("max_output_tokens",),
                done_event=b"event: response.completed", completer=ResponsesEvents),
        Surface("rerank", "rerank", ("query", "documents"), generates=False),
    )
}


def anthropic_error(status: int, message: str, retry_after: int | None = None) -> Answer:
    answer = json_answer({"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}},
                         status)
    if retry_after is not None:
        answer["Retry-After"] = str(max(1, int(retry_after)))
    return answer


def error_for(path: str, status: int, code: str, message: str, retry_after: int | None = None) -> Answer:
    """An error in the shape of the API a path belongs to (an unknown path under /v1/messages is Anthropic's)."""
    if path.startswith("/v1/messages"):
        return anthropic_error(status, message, retry_after)
    return error_response(status, code, message, retry_after)
