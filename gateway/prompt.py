"""What a request asks of an engine, measured before it is sent: how long its prompt is at least and about, and
whether it asks for more than a model allows (log-probabilities, choices).

No tokenizer here: an exact count would cost a round trip to an engine (or a model's vocabulary in every web
process). Two figures are enough:

- a lower bound, to refuse a prompt that cannot fit the model's context before an engine spends anything on it
  (100,000 one-word messages kept an engine templating for minutes): a token id given as such is one token; a
  message, or a prompt of a list, adds at least one (its role, its separator); text adds at least one token per
  MAX_BYTES_PER_TOKEN bytes (no vocabulary has longer tokens that text is made of). Images and audio count as
  nothing: their tokens depend on the model.
- an estimate, to reserve tokens against a key's per-minute limit and to count a prompt whose stream the client
  closed before the engine said how long it was: about one token per BYTES_PER_TOKEN bytes of text (what
  English text and code come to with the usual vocabularies), a few per message for its template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError, invalid

MAX_BYTES_PER_TOKEN = 64
BYTES_PER_TOKEN = 4
TEMPLATE_TOKENS = 4  # per message: its role and the template's markers, about
MAX_DEPTH = 16  # of the content a prompt is made of: content parts are 3 deep; deeper is no prompt

# what multiplies the size of an answer, and the model setting that caps it (cluster.models.Model)
LOGPROB_FIELDS = ("n_probs", "top_logprobs", "logprobs")  # llama.cpp's, chat's, completions' (a number there)
CHOICE_FIELDS = ("n", "best_of")


@dataclass(frozen=True)
class Size:
    text_bytes: int = 0  # UTF-8 bytes of text
    token_ids: int = 0  # tokens given as ids
    items: int = 0  # messages, or prompts of a list

    @property
    def at_least(self) -> int:
        return self.token_ids + self.items + self.text_bytes // MAX_BYTES_PER_TOKEN

    @property
    def about(self) -> int:
        return self.token_ids + TEMPLATE_TOKENS * self.items + -(-self.text_bytes // BYTES_PER_TOKEN)


def _walk(value: object, depth: int = 0) -> tuple[int, int]:
    """(text bytes, token ids) of a prompt, an input or a message's content."""
    if depth > MAX_DEPTH:
        raise invalid("the prompt is nested too deeply")
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")), 0
    if isinstance(value, bool):
        return 0, 0
    if isinstance(value, int):
        return 0, 1
    if isinstance(value, list):
        text = ids = 0
        for part in value:
            t, i = _walk(part, depth + 1)
            text, ids = text + t, ids + i
        return text, ids
    if isinstance(value, dict):  # a content part: only its text is text
        inner = value.get("text")
        return _walk(inner, depth + 1) if isinstance(inner, str) else (0, 0)
    return 0, 0


def _messages(messages: object, text: int = 0, items: int = 0) -> tuple[int, int]:
    """(text bytes, items) of a list of chat or Messages messages, or of Responses input items."""
    for message in messages if isinstance(messages, list) else ():
        items += 1
        if not isinstance(message, dict):
            continue
        text += _walk(message.get("content"))[0]
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                text += len(function["arguments"].encode("utf-8", "surrogatepass"))
        for field in ("arguments", "output"):  # a Responses function call, or its output
            if isinstance(message.get(field), str):
                text += len(message[field].encode("utf-8", "surrogatepass"))
    return text, items


def chat_size(body: dict[str, Any]) -> Size:
    """Chat completions: its messages."""
    return Size(*_shape(_messages(body.get("messages"))))


def messages_size(body: dict[str, Any]) -> Size:
    """Anthropic's Messages (and its token count): its `system` prompt and its messages."""
    text, items = _messages(body.get("messages"))
    return Size(text + _walk(body.get("system"))[0], 0, items)


def responses_size(body: dict[str, Any]) -> Size:
    """Responses: its `instructions` and its input (a string, or items)."""
    value = body.get("input")
    text, items = _messages(value) if isinstance(value, list) else (_walk(value)[0], 1)
    return Size(text + _walk(body.get("instructions"))[0], 0, items)


def rerank_size(body: dict[str, Any]) -> Size:
    """Rerank: its query and documents."""
    documents = body.get("documents")
    return Size(_walk(body.get("query"))[0] + _walk(documents)[0], 0,
                1 + (len(documents) if isinstance(documents, list) else 0))


def completion_size(body: dict[str, Any]) -> Size:
    """Completions: its prompt (text, token ids, or a list of either)."""
    return _prompt_size(body.get("prompt"))


def input_size(body: dict[str, Any]) -> Size:
    """Embeddings: its input (text, token ids, or a list of either)."""
    return _prompt_size(body.get("input"))


def _prompt_size(value: object) -> Size:
    text, ids = _walk(value)
    return Size(text, ids, len(value) if isinstance(value, list) and value and not isinstance(value[0], int) else 0)


def _shape(measured: tuple[int, int]) -> tuple[int, int, int]:
    text, items = measured
    return text, 0, items


def check_context(model: str, context: int | None, measured: Size) -> None:
    """Refuse a prompt that cannot fit the model's context, however the engine would count it."""
    if context and measured.at_least > context:
        raise GatewayError(400, "context_length_exceeded",
                           f"the request (at least {measured.at_least} tokens) is longer than model {model}'s context "
                           f"({context} tokens)")


def _count(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None or value is False:
        return None
    if value is True:  # chat's `logprobs: true` asks for the chosen token's only
        return 1 if field == "logprobs" else None
    if not isinstance(value, int):
        raise invalid(f"`{field}` must be a whole number")
    return value


def check_caps(model: str, body: dict[str, Any], max_logprobs: int | None, max_choices: int | None) -> None:
    """Refuse what would multiply an answer past the model's caps (its `max_logprobs`, `max_choices`; None: no cap):
    top log-probabilities per token, choices per request."""
    for fields, cap, setting in ((LOGPROB_FIELDS, max_logprobs, "max-logprobs"), (CHOICE_FIELDS, max_choices, "max-choices")):
        for field in fields:
            value = _count(body, field)
            if value is not None and cap is not None and value > cap:
                raise invalid(f"`{field}` may be at most {cap} for model {model} (its {setting})")


def completion_at_most(body: dict[str, Any], fields: tuple[str, ...], context: int | None) -> int:
    """The most tokens the answer may have, as the (capped) request says; else the context. Times its choices."""
    asked = [v for f in fields if isinstance(v := body.get(f), int) and not isinstance(v, bool) and v >= 0]
    choices = max((v for f in CHOICE_FIELDS if isinstance(v := body.get(f), int) and not isinstance(v, bool)), default=1)
    return (min(asked) if asked else context or 0) * max(1, choices)
