"""What a model's engine can take, and what its refusals mean to the client.

A request a model cannot serve (embeddings from an engine started without them, an image for a text model) is
refused before it reaches an engine. An engine's own error is answered in our words, OpenAI-shaped: its 4xx as
the client's 4xx, its 5xx as a 502; the engine's body goes to the web log, and nothing of an engine's address
reaches the client.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from gateway.errors import GatewayError, invalid

# how a refusal names what a model does not serve (ground.engines.CAPABILITIES; gateway/surfaces.py says which
# each API needs)
SERVES = {"chat": "chat completions", "completions": "text completions", "embeddings": "embeddings",
          "messages": "Anthropic Messages", "responses": "Responses", "rerank": "rerank"}
TAKES = {"images": "images", "audio": "audio"}
# the content parts of a chat message that carry images or audio, by their `type`
PART_CAPABILITY = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
                   "audio_url": "audio", "audio": "audio"}
KEY_REFUSED = (401, 403)  # the engine refused the gateway's engine key: another replica may take it

# an engine's address in its own words: http://10.0.0.5:20001/..., 10.0.0.5:20001, [fd00::1]:20001, localhost:20001
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+|\[[0-9a-f:.%]+\](?::\d+)?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
    r"|\b(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+):\d+\b|\b[0-9a-f]{0,4}(?::[0-9a-f]{0,4}){2,7}\b",
    re.IGNORECASE,
)
MESSAGE_CHARS = 300


def scrub(text: str) -> str:
    """One line of an engine's (or a library's) words, with no host, address or port in it."""
    line = " ".join(str(text).split())
    line = _ADDRESS.sub("<engine>", line)
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 1] + "…"


def needs(capability: str, items: str | None, body: dict[str, Any]) -> list[str]:
    """The capabilities a request needs: its API's, and images or audio for such content parts of `items` (the
    field of the body that holds its messages, or None)."""
    wanted = [capability]
    messages = body.get(items) if items else None
    for message in messages if isinstance(messages, list) else ():
        parts = message.get("content") if isinstance(message, dict) else None
        if not isinstance(parts, list):
            continue
        for part in parts:
            kind = PART_CAPABILITY.get(part.get("type", "")) if isinstance(part, dict) else None
            if kind and kind not in wanted:
                wanted.append(kind)
    return wanted


class Asks(Protocol):
    """What an API's surface says of what a model must serve (gateway/surfaces.py's Surface, which sits above)."""

    @property
    def capability(self) -> str: ...
    @property
    def items(self) -> str | None: ...


def check_capabilities(model: str, capabilities: frozenset[str], surface: Asks, body: dict[str, Any]) -> None:
    """Refuse what the model cannot serve: the API (`surface`, gateway/surfaces.py), images, audio."""
    for capability in needs(surface.capability, surface.items, body):
        if capability in capabilities:
            continue
        if capability in TAKES:
            raise GatewayError(400, "not_supported", f"model {model} does not take {TAKES[capability]}")
        raise GatewayError(400, "not_supported", f"model {model} does not serve {SERVES[capability]}{_serving(capabilities)}")


def _serving(capabilities: frozenset[str]) -> str:
    served = [words for capability, words in SERVES.items() if capability in capabilities]
    return f" (it serves {', '.join(served)})" if served else ""


# what a client may ask an engine to generate at most: OpenAI's two names, and llama.cpp's own, which it prefers
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


def cap_tokens(body: dict[str, Any], caps: tuple[int | None, ...], fields: tuple[str, ...] = TOKEN_FIELDS) -> bool:
    """Hold a completion to the smallest of the caps (the model's, the key's): set `max_tokens` when the client
    asks for none, lower what it asks for above the cap (a negative number is llama.cpp's "no limit"). Whether
    the body changed."""
    cap = min((c for c in caps if c), default=None)
    if cap is None:
        return False
    changed, asked = False, False
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"`{field}` must be a whole number")
        asked = True
        if value < 0 or value > cap:
            body[field] = cap
            changed = True
    if not asked:
        body[fields[0]] = cap
        changed = True
    return changed


def _engine_error(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return {"message": error}
    if isinstance(error, dict):
        return error
    if isinstance(body, dict) and isinstance(body.get("detail"), str):  # a FastAPI engine's own refusals
        return {"message": body["detail"]}
    return {}


def _number(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def refusal(model: str, capability: str, status: int, content: bytes) -> GatewayError:
    """The client's answer to an engine's error answer (a status of 400 or more), in our words."""
    error = _engine_error(content)
    kind = str(error.get("type") or "")
    said = str(error.get("message") or "")
    if status in KEY_REFUSED:
        return GatewayError(502, "upstream_error", f"a replica of {model} refused the gateway's engine key")
    if status == 501 or kind == "not_supported_error" or status in (404, 405):
        return GatewayError(400, "not_supported", f"model {model} does not serve {SERVES[capability]}")
    for capability, words in (("images", "image input is not supported"), ("audio", "audio input is not supported")):
        if words in said:  # llama.cpp without a projector answers these with a 500
            return GatewayError(400, "not_supported", f"model {model} does not take {TAKES[capability]}")
    if kind == "exceed_context_size_error" or "maximum context length" in said:
        asked, context = _number(error.get("n_prompt_tokens")), _number(error.get("n_ctx"))
        if asked is not None and context is not None:
            message = f"the request ({asked} tokens) is longer than model {model}'s context ({context} tokens)"
        else:
            message = f"the request is longer than model {model}'s context: {scrub(said)}"
        return GatewayError(400, "context_length_exceeded", message)
    if status == 413:
        return GatewayError(413, "request_too_large", f"model {model} refused the request as too large")
    if status == 429:
        return GatewayError(429, "rate_limited", f"model {model} is busy; try again", 1)
    if status >= 500:
        return GatewayError(502, "upstream_error", f"model {model} failed the request (its engine answered {status})")
    if said:
        return invalid(f"model {model} refused the request: {scrub(said)}")
    return invalid(f"model {model} refused the request (its engine answered {status})")
