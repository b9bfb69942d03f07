"""The OpenAI-compatible endpoint: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Every answer is the engine's own or an OpenAI-shaped error; a client never sees a 500 or an HTML page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
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

    def finish(self, status: int) -> None:
        self.status = status
        seconds = time.monotonic() - self.started
        metrics.REQUESTS.labels(self.model, str(status), self.replica).inc()
        metrics.LATENCY.labels(self.model).observe(seconds)
        if self.prompt or self.completion:
            metrics.TOKENS.labels(self.model, "prompt").inc(self.prompt)
            metrics.TOKENS.labels(self.model, "completion").inc(self.completion)
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
        gw = runtime()
        table = await gw.current()
        if table.serving_stopped:
            raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
        call.key = await _authenticate(gw, table, request)
        body = _parse(request, endpoint)
        call.model = body["model"]
        route = table.models.get(call.model)
        if route is None:
            raise GatewayError(404, "model_not_found", f"no model named {call.model!r}")
        if call.key.models and call.model not in call.key.models:
            raise GatewayError(403, "model_not_allowed", f"this key may not use model {call.model!r}")
        await check_limits(gw.redis, call.key)
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
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


def _parse(request, endpoint: str) -> dict:
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
    return body


async def _choose(gw, call, tried: set[str]):
    """A ready replica with the fewest requests in flight; wait for one that is on its way, up to wait_seconds."""
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
            raise GatewayError(502, "upstream_error", f"every ready replica of {call.model} failed this request")
        if route.coming == 0 or left <= 0:
            what = "none is on its way" if route.coming == 0 else f"waited {route.wait_seconds}s"
            raise GatewayError(503, "no_replica_ready", f"no replica of {call.model} is ready ({what})", 5)
        await gw.wait_for_change(min(left, 1.0))


async def _send(gw, call, endpoint, payload):
    """Send to a replica; before any byte of an answer, retry another on a connection failure or a 502/503."""
    tried: set[str] = set()
    last_error = None
    for _ in range(settings.LLMGW_GATEWAY_TRIES):
        upstream = await _choose(gw, call, tried)
        tried.add(upstream.replica)
        call.replica = upstream.replica
        request = gw.http.build_request(
            "POST", f"{upstream.base_url}/v1/{endpoint}", content=payload, headers=_headers(upstream)
        )
        gw.start(upstream.replica)
        metrics.INFLIGHT.labels(call.model).inc()
        try:
            response = await gw.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
            if isinstance(exc, httpx.ConnectTimeout):
                last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} did not accept the connection")
                continue
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not answer in time") from None
        except httpx.TransportError as exc:
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} failed: {type(exc).__name__}")
            continue
        except BaseException:  # cancelled: the client went away before the engine answered; the count must not leak
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
            raise
        if response.status_code in RETRYABLE_STATUS:
            await response.aclose()
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status_code}")
            continue
        return upstream, response
    raise last_error or GatewayError(502, "upstream_error", "no replica could take the request")


async def _once(gw, call, endpoint, payload):
    upstream, response = await _send(gw, call, endpoint, payload)
    try:
        try:
            content = await response.aread()
        except httpx.TimeoutException:
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not finish in time") from None
        except httpx.TransportError as exc:
            raise GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {type(exc).__name__}") from None
    finally:
        await response.aclose()
        gw.end(upstream.replica)
        metrics.INFLIGHT.labels(call.model).dec()
    status = response.status_code
    if status >= 500:
        raise GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {status}: {content[:300]!r}")
    if status == 200:
        _take_usage(call, content)
        await _account(gw, call)
    call.finish(status)
    return HttpResponse(content, status=status, content_type=response.headers.get("content-type", "application/json"))


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
    if response.status_code != 200:
        try:
            content = await response.aread()
        finally:
            await response.aclose()
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
        if response.status_code >= 500:
            raise GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status_code}")
        call.finish(response.status_code)
        return HttpResponse(content, status=response.status_code, content_type=response.headers.get("content-type"))

    async def events():
        buffer = b""
        status = 200
        try:
            async for chunk in response.aiter_raw():
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
        except asyncio.CancelledError:
            status = 499  # the client went away; closing the response cancels the engine's work
            raise
        except httpx.TimeoutException:
            status = 504
            yield GatewayError(504, "upstream_timeout", f"replica {upstream.replica} stopped sending").event()
            yield b"data: [DONE]\n\n"
        except httpx.TransportError as exc:
            status = 502
            yield GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {type(exc).__name__}").event()
            yield b"data: [DONE]\n\n"
        finally:
            await response.aclose()
            gw.end(upstream.replica)
            metrics.INFLIGHT.labels(call.model).dec()
            try:
                await asyncio.shield(_account(gw, call))
            except Exception:
                pass
            call.finish(status)

    result = StreamingHttpResponse(events(), content_type="text/event-stream")
    result["Cache-Control"] = "no-cache"
    result["X-Accel-Buffering"] = "no"
    return result


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
