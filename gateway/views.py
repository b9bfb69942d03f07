"""The OpenAI-compatible endpoint: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Every answer is the engine's own or an OpenAI-shaped error; a client never sees a 500 or an HTML page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from gateway import metrics
from gateway.accounting import check_limits, count_tokens
from gateway.errors import GatewayError, error_response, invalid
from gateway.models import ApiKey
from gateway.runtime import runtime

log = logging.getLogger("llmgw.gateway")
access = logging.getLogger("llmgw.access")

# endpoint -> the field it cannot do without
ENDPOINTS = {"chat/completions": "messages", "completions": "prompt", "embeddings": "input"}
RETRYABLE_STATUS = (502, 503)


async def models_list(request):
    try:
        gw = runtime()
        table = await gw.current()
        await _authenticate(gw, table, request)
    except GatewayError as exc:
        return exc.response()
    data = [_model_object(route) for route in sorted(table.models.values(), key=lambda r: r.name)]
    return JsonResponse({"object": "list", "data": data})


async def model_detail(request, model: str):
    try:
        gw = runtime()
        table = await gw.current()
        await _authenticate(gw, table, request)
        route = table.models.get(model)
        if route is None:
            raise GatewayError(404, "model_not_found", f"no model named {model!r}")
    except GatewayError as exc:
        return exc.response()
    return JsonResponse(_model_object(route))


def _model_object(route) -> dict:
    return {"id": route.name, "object": "model", "created": 0, "owned_by": "llmgw", "ready": bool(route.ready)}


async def chat_completions(request):
    return await proxy(request, "chat/completions")


async def completions(request):
    return await proxy(request, "completions")


async def embeddings(request):
    return await proxy(request, "embeddings")


async def not_found(request, rest=""):
    return error_response(404, "not_found", f"no such endpoint: {request.method} {request.path}")


class Call:
    """One request's bookkeeping, for the access log, metrics, usage."""

    def __init__(self, request):
        self.started = time.monotonic()
        self.key = None
        self.model = "-"
        self.replica = "-"
        self.status = 0
        self.prompt = self.completion = 0
        self.first_chunk: float | None = None
        self.gw = None  # the process's gateway runtime, once the request reached it

    def finish(self, status: int) -> None:
        self.status = status
        seconds = time.monotonic() - self.started
        metrics.REQUESTS.labels(self.model, str(status), self.replica).inc()
        metrics.LATENCY.labels(self.model).observe(seconds)
        if self.prompt or self.completion:
            metrics.TOKENS.labels(self.model, "prompt").inc(self.prompt)
            metrics.TOKENS.labels(self.model, "completion").inc(self.completion)
        if self.gw is not None:
            self.gw.ledger.count(status, self.prompt + self.completion)
        access.info(
            "key=%s model=%s replica=%s status=%s duration_ms=%.1f prompt_tokens=%d completion_tokens=%d",
            self.key.prefix if self.key else "-",
            self.model,
            self.replica,
            status,
            seconds * 1000,
            self.prompt,
            self.completion,
        )


async def proxy(request, endpoint: str):
    call = Call(request)
    try:
        if request.method != "POST":
            raise GatewayError(405, "method_not_allowed", f"{request.path} takes POST")
        gw = call.gw = runtime()
        table = await gw.current()
        if table.serving_stopped:
            raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
        call.key = await _authenticate(gw, table, request)
        raw, body = _parse(request, endpoint)
        call.model = body["model"]
        route = table.models.get(call.model)
        if route is None:
            raise GatewayError(404, "model_not_found", f"no model named {call.model!r}")
        if call.key.models and call.model not in call.key.models:
            raise GatewayError(403, "model_not_allowed", f"this key may not use model {call.model!r}")
        await check_limits(gw.redis, call.key)
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
        payload = raw  # the client's bytes as they came, unknown fields and all
        if stream and not wants_usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            payload = json.dumps(body).encode()
        if stream:
            return await _stream(gw, call, endpoint, payload, wants_usage)
        return await _once(gw, call, endpoint, payload)
    except GatewayError as exc:
        call.finish(exc.status)
        return exc.response()
    except asyncio.CancelledError:  # the client went away before the answer: still one access-log line
        call.finish(499)
        raise
    except Exception:  # a bug of ours must still not become a 500 for the client
        log.exception("gateway error on %s", request.path)
        call.finish(503)
        return error_response(503, "gateway_error", "the gateway failed on this request; see the web log", 5)


async def _authenticate(gw, table, request):
    header = request.headers.get("Authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise GatewayError(401, "invalid_api_key", "give your API key as `Authorization: Bearer sk-…`")
    key_hash = ApiKey.hash(header[7:].strip())
    key = table.keys.get(key_hash)
    if key is None and gw.may_reload_for_unknown_key():
        await gw.refresh()  # a key created a moment ago, before the change reached this process
        key = gw.table.keys.get(key_hash)
    if key is None or key.revoked:
        raise GatewayError(401, "invalid_api_key", "unknown or revoked API key")
    if key.expires_at is not None and key.expires_at <= time.time():
        raise GatewayError(401, "invalid_api_key", f"API key {key.prefix}… expired")
    gw.ledger.last_used[key.id] = time.time()
    return key


def _parse(request, endpoint: str) -> tuple[bytes, dict]:
    try:
        raw = request.body
    except RequestDataTooBig:
        raise GatewayError(413, "request_too_large", f"the request body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes")
    if len(raw) > settings.LLMGW_MAX_BODY_BYTES:
        raise GatewayError(413, "request_too_large", f"the request body is over {settings.LLMGW_MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("`model` is required and must be a string")
    needed = ENDPOINTS[endpoint]
    if needed not in body:
        raise invalid(f"`{needed}` is required for /v1/{endpoint}")
    if endpoint == "chat/completions" and not isinstance(body["messages"], list):
        raise invalid("`messages` must be a list")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise invalid("`stream` must be true or false")
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise invalid("`stream_options` must be an object")
    return raw, body


async def _choose(gw, call, tried: set[str], last_error: GatewayError | None = None):
    """A ready replica with the fewest requests in flight; wait for one that is on its way, up to wait_seconds.
    With every ready replica tried and none coming, the last one's failure is the answer."""
    deadline = None
    while True:
        table = await gw.current()
        if table.serving_stopped:
            raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
        route = table.models.get(call.model)
        if route is None:
            raise GatewayError(404, "model_not_found", f"no model named {call.model!r}")
        upstream = gw.pick(route.ready, tried)
        if upstream is not None:
            return upstream
        if deadline is None:
            deadline = time.monotonic() + route.wait_seconds
        left = deadline - time.monotonic()
        if tried and route.coming == 0:
            raise last_error or GatewayError(502, "upstream_error", f"every ready replica of {call.model} failed this request")
        if route.coming == 0 or left <= 0:
            what = "none is on its way" if route.coming == 0 else f"waited {route.wait_seconds}s"
            raise GatewayError(503, "no_replica_ready", f"no replica of {call.model} is ready ({what})", 5)
        await gw.wait_for_change(min(left, 1.0))


def _done(gw, call, upstream) -> None:
    gw.end(upstream.replica)
    metrics.INFLIGHT.labels(call.model).dec()


async def _send(gw, call, endpoint, payload):
    """Send to a replica; before any byte of an answer, retry another on a connection failure or a 502/503."""
    tried: set[str] = set()
    last_error = None
    for _ in range(settings.LLMGW_GATEWAY_TRIES):
        upstream = await _choose(gw, call, tried, last_error)
        tried.add(upstream.replica)
        call.replica = upstream.replica
        gw.start(upstream.replica)
        metrics.INFLIGHT.labels(call.model).inc()
        try:
            response = await gw.http.post(f"{upstream.base_url}/v1/{endpoint}", data=payload, headers=_headers(upstream))
        except aiohttp.ConnectionTimeoutError:
            _done(gw, call, upstream)
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} did not accept the connection")
            continue
        except (aiohttp.ServerTimeoutError, TimeoutError):
            _done(gw, call, upstream)
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not answer in time") from None
        except aiohttp.ClientError as exc:  # refused, reset, closed before an answer: nothing reached the client
            _done(gw, call, upstream)
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} failed: {_describe(exc)}")
            continue
        except BaseException:  # cancelled: the client went away before the engine answered; the count must not leak
            _done(gw, call, upstream)
            raise
        if response.status in RETRYABLE_STATUS:
            response.close()
            _done(gw, call, upstream)
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status}")
            continue
        return upstream, response
    raise last_error or GatewayError(502, "upstream_error", "no replica could take the request")


def _describe(exc: BaseException) -> str:
    detail = str(exc).strip()
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


async def _once(gw, call, endpoint, payload):
    upstream, response = await _send(gw, call, endpoint, payload)
    try:
        try:
            content = await response.read()
        except (aiohttp.ServerTimeoutError, TimeoutError):
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not finish in time") from None
        except aiohttp.ClientError as exc:
            raise GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {_describe(exc)}") from None
    finally:
        response.release()
        _done(gw, call, upstream)
    status = response.status
    if status >= 500:
        raise GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {status}: {content[:300]!r}")
    if status == 200:
        _take_usage(call, content)
        await _account(gw, call)
    call.finish(status)
    return HttpResponse(content, status=status, content_type=response.headers.get("Content-Type", "application/json"))


def _headers(upstream) -> dict:
    """Only what the engine needs: the client's key and anything that identifies the client stay here."""
    return {"content-type": "application/json", "authorization": f"Bearer {upstream.engine_key}"}


def _take_usage(call, content: bytes) -> None:
    try:
        usage = json.loads(content).get("usage") or {}
        call.prompt = int(usage.get("prompt_tokens") or 0)
        call.completion = int(usage.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        pass


async def _account(gw, call) -> None:
    gw.ledger.add(call.key.id, call.model, call.prompt, call.completion)
    if call.key.tpm:
        await count_tokens(gw.redis, call.key, call.prompt + call.completion)


async def _stream(gw, call, endpoint, payload, wants_usage: bool):
    upstream, response = await _send(gw, call, endpoint, payload)
    if response.status != 200:
        try:
            content = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            content = b""
        finally:
            response.release()
            _done(gw, call, upstream)
        if response.status >= 500:
            raise GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status}")
        call.finish(response.status)
        return HttpResponse(content, status=response.status, content_type=response.headers.get("Content-Type"))

    state = {"finished": False, "settled": False}

    def settle(status: int) -> None:
        """Let the upstream go and count the request, once, however the stream ended."""
        if state["settled"]:
            return
        state["settled"] = True
        if state["finished"]:
            response.release()  # read to the end: the connection goes back to the pool
        else:
            response.close()  # cut short: the engine sees its client go and stops generating
        _done(gw, call, upstream)
        gw.ledger.add(call.key.id, call.model, call.prompt, call.completion)
        if call.key.tpm and (call.prompt or call.completion):
            gw.spawn(count_tokens(gw.redis, call.key, call.prompt + call.completion))
        call.finish(status)

    async def events():
        buffer = b""
        status = 499  # unless it ends otherwise: the client went away, and closing the upstream cancels the work
        try:
            async for chunk in response.content.iter_any():
                if call.first_chunk is None:
                    call.first_chunk = time.monotonic()
                    metrics.FIRST_TOKEN.labels(call.model).observe(call.first_chunk - call.started)
                buffer += chunk
                out = []
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if _keep_event(call, event, wants_usage):
                        out.append(event + b"\n\n")
                if out:
                    yield b"".join(out)
            if buffer.strip():
                yield buffer
            state["finished"], status = True, 200
        except (aiohttp.ServerTimeoutError, TimeoutError):
            status = 504
            yield GatewayError(504, "upstream_timeout", f"replica {upstream.replica} stopped sending").event()
            yield b"data: [DONE]\n\n"
        except aiohttp.ClientError as exc:
            status = 502
            yield GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {_describe(exc)}").event()
            yield b"data: [DONE]\n\n"
        finally:
            settle(status)

    return GatewayStream(events(), settle)


class GatewayStream(StreamingHttpResponse):
    """An event stream that lets its upstream go however it ends: read to the end, cut short, or never started
    (the client left between the view's answer and its first byte: a generator that never ran runs no
    `finally`). gateway.handler calls `settle` after sending; Django's own handler calls `close()`."""

    def __init__(self, events, settle):
        super().__init__(events, content_type="text/event-stream")
        self.settle = settle
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"

    def close(self):
        self.settle(499)
        super().close()


def _keep_event(call, event: bytes, wants_usage: bool) -> bool:
    """Read the usage off the stream; drop the usage-only chunk the client did not ask for."""
    if b'"usage"' not in event:
        return True
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            data = json.loads(line[5:])
        except ValueError:
            return True
        usage = data.get("usage") if isinstance(data, dict) else None
        if usage:
            call.prompt = int(usage.get("prompt_tokens") or 0)
            call.completion = int(usage.get("completion_tokens") or 0)
            if not wants_usage and not data.get("choices"):
                return False
    return True
