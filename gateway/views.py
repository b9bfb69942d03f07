"""The gateway's endpoints: OpenAI's /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses and
/v1/models, Anthropic's /v1/messages and /v1/messages/count_tokens, and /v1/rerank (gateway/surfaces.py says how
they differ).

A request's way in is here: its key, its body, what its model serves and allows, its key's limits, concurrency and
budget; then its way to an engine (gateway/sending.py) and its answer (gateway/answers.py), as its record
(gateway/call.py) keeps them. Every answer is the engine's own or an error in its API's shape; a client never sees
a 500 or an HTML page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from cluster import throttle
from cluster.clients import address_of
from gateway import admission, affinity, answers, slots, tracing
from gateway.call import Call
from gateway.errors import GatewayError, invalid
from gateway.http import Answer, HungUp, Request, Streamed, json_answer
from gateway.models import ApiKey
from gateway.prompt import check_caps, check_context, completion_at_most
from gateway.runtime import PREFIX, Gateway, runtime
from gateway.surfaces import JSON, SURFACES, Surface, error_for
from gateway.table import KeyInfo, ModelRoute, Table
from gateway.upstream import cap_tokens, check_capabilities

log = logging.getLogger("llmgw.gateway")



async def models_list(request: Request) -> Answer:
    try:
        gw = runtime()
        table = await gw.current()
        key = await _authenticate(gw, table, request)
    except GatewayError as exc:
        return exc.response()
    data = [entry for route in sorted(table.models.values(), key=lambda r: r.name)
            if not key.models or route.name in key.models
            for entry in (_model_object(route), *(_model_object(route, alias) for alias in route.aliases))]
    return json_answer({"object": "list", "data": data})


async def model_detail(request: Request, model: str) -> Answer:
    try:
        gw = runtime()
        table = await gw.current()
        key = await _authenticate(gw, table, request)
        route = table.find(model)
        if route is None:
            await gw.look_again("model")
            assert gw.table is not None  # look_again waits for a load
            route = gw.table.find(model)
        if route is None or (key.models and route.name not in key.models):  # what it may not use, it is not told of
            raise GatewayError(404, "model_not_found", f"no model named {model!r}")
    except GatewayError as exc:
        return exc.response()
    return json_answer(_model_object(route, None if model == route.name else model))


def _model_object(route: ModelRoute, alias: str | None = None) -> JSON:
    """A model as /v1/models lists it; an alias of it as an entry of its own, naming the model it is one of."""
    shown: JSON = {"id": alias or route.name, "object": "model", "created": 0, "owned_by": "llmgw",
                   "ready": bool(route.ready), "replicas_ready": len(route.ready), "routing": route.routing}
    if alias:
        shown["alias_of"] = route.name
    return shown


def surface_view(path: str) -> Callable[[Request], Awaitable[Answer | Streamed]]:
    """The view of one API (gateway/surfaces.py describes each): a POST proxied to a replica of its model."""

    async def view(request: Request) -> Answer | Streamed:
        return await proxy(request, path)

    view.__name__ = view.__qualname__ = path.replace("/", "_")
    return view


async def not_found(request: Request, rest: str = "") -> Answer:
    return error_for(request.path, 404, "not_found", f"no such endpoint: {request.method} {request.path}")


REPLICA_HEADER = "X-Llmgw-Replica"  # where the request went (`-`: to no replica), as the access log says


async def proxy(request: Request, endpoint: str) -> Answer | Streamed:
    trace = request.trace
    assert trace is not None  # given with its id, before any view
    call = Call(request_id=request.id, trace=trace, surface=endpoint, client=request.client,
                engine_headers=f"traceparent: {trace.traceparent()}\r\n{tracing.HEADER}: {request.id}\r\n")
    response = await _proxy(call, request, endpoint)
    response[REPLICA_HEADER] = call.way.replica
    return response


async def _proxy(call: Call, request: Request, endpoint: str) -> Answer | Streamed:
    surface = SURFACES[endpoint]
    try:
        if request.method != "POST":
            raise GatewayError(405, "method_not_allowed", f"{request.path} takes POST")
        gw = call.gw = runtime()
        table = await gw.current()
        if table.serving_stopped:
            await gw.look_again("stopped")  # `llmgw start` a moment ago, before the change reached this process
            assert gw.table is not None  # look_again waits for a load
            table = gw.table
        if table.serving_stopped:
            raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
        call.key = await _authenticate(gw, table, request)
        call.rank = admission.rank_of(call.key.priority, request.header("x-llmgw-priority"))
        raw, body = _parse(await request.read_body(), surface)
        call.model = call.asked = body["model"]
        if call.key.log_bodies:  # kept in its record (never a header: its key is in them)
            call.request_body = raw
        route = table.find(call.model)
        if route is None:
            await gw.look_again("model")  # a model added a moment ago, before the change reached this process
            assert gw.table is not None
            route = gw.table.find(call.model)
        if route is None:
            raise GatewayError(404, "model_not_found", f"no model named {call.model[:64]!r}")
        call.model = route.name  # by its own name from here (an alias's model: its key allow-list, log, metrics)
        call.known = True
        if call.key.models and call.model not in call.key.models:
            raise GatewayError(403, "model_not_allowed", f"this key may not use model {call.model!r}")
        check_capabilities(call.model, route.capabilities, surface, body)
        check_caps(call.model, body, route.max_logprobs, route.max_choices)
        measured = surface.prompt_size(body)
        check_context(call.model, route.context, measured)
        call.estimated = measured.about if surface.admits else 0
        call.prompt_about = call.estimated + gw.prompt_overhead(call.model) if call.estimated else 0
        call.admits = surface.admits
        if route.routing == PREFIX or route.canary:  # (a rollout's side is a conversation's: its key)
            session = next((v for h in surface.session_headers if (v := request.header(h))), "")
            call.affinity = affinity.session_key(session) if session else surface.prefix_key(body)
            call.session = bool(session)
        changed = bool(surface.token_fields) and cap_tokens(body, (route.max_tokens, call.key.max_tokens),
                                                             surface.token_fields)
        if call.key.tpm:
            call.reserved = call.prompt_about
            if surface.generates:
                call.reserved += completion_at_most(body, surface.token_fields, route.context)
        call.reserved_minute = await gw.limits.check(call.key, call.reserved)
        if call.key.max_concurrency:  # its requests in flight or waiting, across every web process
            call.key_slot = await gw.admission.keys.hold(call.key.id, call.key.name, call.key.max_concurrency)
        if call.key.budget_tokens:  # what it may use reserved at once: concurrent requests cannot overspend
            reserve = call.prompt_about
            if surface.generates:
                reserve += completion_at_most(body, surface.token_fields, route.context)
            call.budget = await gw.budgets.reserve(call.key, reserve, gw.now())
        gw.requested(call.model)  # demand, once nothing refuses it (a refused request must keep no model loaded)
        stream = call.streamed = bool(body.get("stream")) and surface.admits
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
        if surface.usage_unasked:
            wants_usage = True  # its streams carry their usage of their own
        if stream and not wants_usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            changed = True
        # the client's bytes as they came, unknown fields and all, unless the gateway had to add to them
        payload = json.dumps(body).encode() if changed else raw
        if stream:
            return await answers.stream(gw, call, call.used, surface, payload, wants_usage, body)
        return await answers.once(gw, call, call.used, surface, payload)
    except GatewayError as exc:
        if exc.code in slots.REFUSALS and call.key is not None:
            slots.refused_for_key(gw, call, exc)
        call.error = exc.code
        answer = surface.error(exc)
        if call.request_body is not None:
            call.error_body = answer.body
        call.finish(exc.status)
        return answer
    except (asyncio.CancelledError, HungUp):  # the client went away before the answer: still one access-log line
        call.finish(499)
        raise
    except Exception:  # a bug of ours must still not become a 500 for the client
        log.exception("gateway error on %s", request.path)
        call.finish(503)
        return surface.error(GatewayError(503, "gateway_error", "the gateway failed on this request; see the web log", 5))


async def _authenticate(gw: Gateway, table: Table, request: Request) -> KeyInfo:
    # an address that keeps guessing waits, whatever it sends (cluster/throttle.py)
    found = throttle.subjects(address_of(request.client, request.header("x-forwarded-for")))
    wait = throttle.GATEWAY.shut(found)
    if wait:
        raise GatewayError(429, "rate_limited", f"too many unknown API keys from your address; try again in {wait} s", wait)
    header = request.header("authorization")
    if header.lower().startswith("bearer ") and header[7:].strip():
        secret = header[7:].strip()
    else:  # Anthropic's SDK and Claude Code send theirs so
        secret = request.header("x-api-key").strip()
    if not secret:
        raise GatewayError(401, "invalid_api_key", "give your API key as `Authorization: Bearer sk-…` or `x-api-key: sk-…`")
    key_hash = ApiKey.hash(secret)
    key = table.keys.get(key_hash)
    if key is None:
        await gw.look_again("key")  # a key created a moment ago, before the change reached this process
        assert gw.table is not None
        key = gw.table.keys.get(key_hash)
    if key is None:
        if not gw.reach.away:  # counted at once, but waited for no longer than Redis is (its count may land later)
            await asyncio.wait({gw.spawn(throttle.GATEWAY.afailed(gw.redis, found))}, timeout=gw.reach.wait)
    if key is None or key.revoked:
        raise GatewayError(401, "invalid_api_key", "unknown or revoked API key")
    if key.expires_at is not None and key.expires_at <= time.time():
        raise GatewayError(401, "invalid_api_key", f"API key {key.prefix}… expired")
    gw.ledger.last_used[key.id] = time.time()
    return key


def _parse(raw: bytes, surface: Surface) -> tuple[bytes, JSON]:
    """The body as it came (no larger than LLMGW_MAX_BODY_BYTES: gateway.handler refused it as it came), and as JSON."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("`model` is required and must be a string")
    for needed in surface.needs:
        if needed not in body:
            raise invalid(f"`{needed}` is required for /v1/{surface.path}")
    if "messages" in surface.needs and not isinstance(body["messages"], list):
        raise invalid("`messages` must be a list")
    for field, why in surface.refused:
        if body.get(field):
            raise invalid(f"`{field}` {why}")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise invalid("`stream` must be true or false")
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise invalid("`stream_options` must be an object")
    return raw, body


