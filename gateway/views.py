"""The gateway's endpoints: OpenAI's /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses and
/v1/models, Anthropic's /v1/messages and /v1/messages/count_tokens, and /v1/rerank (gateway/surfaces.py says how
they differ).

Every answer is the engine's own or an error in its API's shape; a client never sees a 500 or an HTML page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

from cluster import throttle
from cluster.clients import address_of
from gateway import admission, affinity, metrics, slots
from gateway.engines_http import ConnectFailed, ConnectTimeout, ReadTimeout, Unreachable, UpstreamError
from gateway.errors import GatewayError, invalid
from gateway.http import Answer, HungUp, Streamed, json_answer
from gateway.models import ApiKey
from gateway.prompt import check_caps, check_context, completion_at_most
from gateway.runtime import PREFIX, runtime
from gateway.spend import Hold
from gateway.surfaces import SURFACES, error_for
from gateway.upstream import KEY_REFUSED, cap_tokens, check_capabilities, refusal, scrub

log = logging.getLogger("llmgw.gateway")
access = logging.getLogger("llmgw.access")

# the headers that name an agent's session: its requests stay on one replica (docs/routing.md)
SESSION_HEADERS = ("x-llmgw-session", "x-claude-code-session-id", "session_id", "session-id")
RETRYABLE_STATUS = (502, 503)
NO_ROOM_RECHECK = 1.0  # seconds a request asking for a model found without room waits for the reconciler's word


async def models_list(request):
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


async def model_detail(request, model: str):
    try:
        gw = runtime()
        table = await gw.current()
        key = await _authenticate(gw, table, request)
        route = table.find(model)
        if route is None:
            await gw.look_again("model")
            route = gw.table.find(model)
        if route is None or (key.models and route.name not in key.models):  # what it may not use, it is not told of
            raise GatewayError(404, "model_not_found", f"no model named {model!r}")
    except GatewayError as exc:
        return exc.response()
    return json_answer(_model_object(route, None if model == route.name else model))


def _model_object(route, alias: str | None = None) -> dict:
    """A model as /v1/models lists it; an alias of it as an entry of its own, naming the model it is one of."""
    shown = {"id": alias or route.name, "object": "model", "created": 0, "owned_by": "llmgw",
             "ready": bool(route.ready), "replicas_ready": len(route.ready), "routing": route.routing}
    if alias:
        shown["alias_of"] = route.name
    return shown


def surface_view(path: str):
    """The view of one API (gateway/surfaces.py describes each): a POST proxied to a replica of its model."""

    async def view(request):
        return await proxy(request, path)

    view.__name__ = view.__qualname__ = path.replace("/", "_")
    return view


async def not_found(request, rest=""):
    return error_for(request.path, 404, "not_found", f"no such endpoint: {request.method} {request.path}")


class Call:
    """One request's bookkeeping, for the access log, metrics, usage."""

    def __init__(self, request):
        self.started = time.monotonic()
        self.key = None
        self.model = "-"
        self.known = False  # `model` names a model llmgw serves: only such names become metric labels
        self.replica = "-"
        self.status = 0
        self.prompt = self.completion = 0
        self.first_chunk: float | None = None
        self.gw = None  # the process's gateway runtime, once the request reached it
        self.affinity: int | None = None  # its key on the model's ring, when the model routes by prefix
        self.attempts = 0  # replicas it was sent to
        self.waited: float | None = None  # seconds it waited for a ready replica, once it looked for one
        self.asked_until = 0.0  # an autoscaled model found without room: until when the request waits for news
        self.lease_asked = False  # it waited in its model's queue for a replica on its way (once)
        self.prompt_about = 0  # its prompt's tokens as estimated (gateway.prompt), until the engine says
        self.estimated = 0  # the same, before its model's learned overhead (Gateway.prompt_overhead)
        self.passed = 0  # tokens of a streamed answer passed on to the client, as counted by its chunks
        self.reserved = 0  # tokens reserved against its key's tpm limit when it was admitted
        self.reserved_minute: int | None = None  # the minute they were reserved in (None: no tpm limit)
        self.usage_known = False  # the engine said what the request used
        self.rank = admission.RANK[admission.DEFAULT_CLASS]  # its class when it waits for a slot
        self.lease: admission.Lease | None = None  # the slot it holds (gateway/admission.py)
        self.admits = True  # it takes a slot of an engine (counting tokens takes none)
        self.key_slot: str | None = None  # one of its key's requests at once (max_concurrency)
        self.budget: Hold | None = None  # what it reserved of its key's budget

    @property
    def label(self) -> str:
        """The model as a metric label: a model llmgw serves, else the one `unknown` bucket (any client could
        otherwise grow the series, and the web process with them, a name at a time)."""
        return self.model if self.known else metrics.UNKNOWN_MODEL

    def count_cut_short(self) -> None:
        """A stream that ended before the engine said what it used (the client closed it, say) still used what the
        engine produced: the tokens passed on, and its prompt as estimated when anything was passed."""
        if not self.usage_known and self.passed:
            self.prompt, self.completion = self.prompt or self.prompt_about, max(self.completion, self.passed)

    async def settle(self) -> None:
        """Count what it used against its key's tpm limit in place of what it reserved (never raises: an answer
        given is never replaced for it)."""
        if self.reserved_minute is not None:
            minute, self.reserved_minute = self.reserved_minute, None
            await self.gw.limits.settle(self.key, self.prompt + self.completion, self.reserved, minute)

    def finish(self, status: int) -> None:
        self.status = status
        if self.usage_known and self.gw is not None:
            self.gw.learn_prompt(self.model, self.estimated, self.prompt)
        if self.reserved_minute is not None and self.gw is not None:
            self.gw.spawn(self.settle())
        if self.gw is not None:
            if self.key_slot is not None:
                slot, self.key_slot = self.key_slot, None
                self.gw.spawn(self.gw.admission.let_key_go(slot))
            if self.budget is not None:
                budget, self.budget = self.budget, None
                self.gw.budgets.settle(budget, self.prompt + self.completion)
        seconds = time.monotonic() - self.started
        series = metrics.of(self.label)
        series.requests(status).inc()
        series.latency.observe(seconds)
        if self.attempts:
            series.attempts.observe(self.attempts)
        if self.waited is not None:
            series.waited.observe(self.waited)
        if self.prompt or self.completion:
            series.prompt.inc(self.prompt)
            series.completion.inc(self.completion)
        if self.gw is not None:
            first = self.first_chunk - self.started if self.first_chunk is not None else None
            self.gw.ledger.count(status, self.prompt + self.completion, first_chunk=first)
        access.info(
            "key=%s model=%s replica=%s status=%s duration_ms=%.1f prompt_tokens=%d completion_tokens=%d",
            self.key.prefix if self.key else "-",
            self.model if self.known or self.model == "-" else f"unknown({self.model[:64]!r})",
            self.replica,
            status,
            seconds * 1000,
            self.prompt,
            self.completion,
        )


REPLICA_HEADER = "X-Llmgw-Replica"  # where the request went (`-`: to no replica), as the access log says


async def proxy(request, endpoint: str):
    call = Call(request)
    response = await _proxy(call, request, endpoint)
    response[REPLICA_HEADER] = call.replica
    return response


async def _proxy(call, request, endpoint: str):
    surface = SURFACES[endpoint]
    try:
        if request.method != "POST":
            raise GatewayError(405, "method_not_allowed", f"{request.path} takes POST")
        gw = call.gw = runtime()
        table = await gw.current()
        if table.serving_stopped:
            await gw.look_again("stopped")  # `llmgw start` a moment ago, before the change reached this process
            table = gw.table
        if table.serving_stopped:
            raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
        call.key = await _authenticate(gw, table, request)
        call.rank = admission.rank_of(call.key.priority, request.header("x-llmgw-priority"))
        raw, body = _parse(await request.read_body(), surface)
        call.model = body["model"]
        route = table.find(call.model)
        if route is None:
            await gw.look_again("model")  # a model added a moment ago, before the change reached this process
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
        if route.routing == PREFIX:
            session = next((v for h in SESSION_HEADERS if (v := request.header(h))), "")
            call.affinity = affinity.session_key(session) if session else surface.prefix_key(body)
        changed = bool(surface.token_fields) and cap_tokens(body, (route.max_tokens, call.key.max_tokens),
                                                             surface.token_fields)
        if call.key.tpm:
            call.reserved = call.prompt_about
            if surface.generates:
                call.reserved += completion_at_most(body, surface.token_fields, route.context)
        call.reserved_minute = await gw.limits.check(call.key, call.reserved)
        if call.key.max_concurrency:  # its requests in flight or waiting, across every web process
            call.key_slot = await gw.admission.hold_key(call.key.id, call.key.name, call.key.max_concurrency)
        if call.key.budget_tokens:  # what it may use reserved at once: concurrent requests cannot overspend
            reserve = call.prompt_about
            if surface.generates:
                reserve += completion_at_most(body, surface.token_fields, route.context)
            call.budget = await gw.budgets.reserve(call.key, reserve, gw.now())
        gw.requested(call.model)  # demand, once nothing refuses it (a refused request must keep no model loaded)
        stream = bool(body.get("stream")) and surface.admits
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
        if surface.usage_unasked:
            wants_usage = True  # its streams carry their usage of their own
        if stream and not wants_usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            changed = True
        # the client's bytes as they came, unknown fields and all, unless the gateway had to add to them
        payload = json.dumps(body).encode() if changed else raw
        if stream:
            return await _stream(gw, call, surface, payload, wants_usage)
        return await _once(gw, call, surface, payload)
    except GatewayError as exc:
        if exc.code in slots.REFUSALS and call.key is not None:
            slots.refused_for_key(gw, call, exc)
        call.finish(exc.status)
        return surface.error(exc)
    except (asyncio.CancelledError, HungUp):  # the client went away before the answer: still one access-log line
        call.finish(499)
        raise
    except Exception:  # a bug of ours must still not become a 500 for the client
        log.exception("gateway error on %s", request.path)
        call.finish(503)
        return surface.error(GatewayError(503, "gateway_error", "the gateway failed on this request; see the web log", 5))


async def _authenticate(gw, table, request):
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


def _parse(raw: bytes, surface) -> tuple[bytes, dict]:
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


async def _choose(gw, call, tried: set[str], last_error: GatewayError | None = None):
    """A ready replica, as the model's routing picks; wait for one that is on its way, up to wait_seconds. A
    request for an autoscaled model with no replica ready asks for one (at zero, that wakes the model) and waits
    for it, unless no room can be made for it. With every ready replica tried and none coming, the last one's
    failure is the answer."""
    deadline = None
    waiting = False
    try:
        while True:
            route = _route(await gw.current(), call)
            upstream = await gw.choose(route, tried, call.affinity)
            if upstream is not None and gw.admission.enabled and route.slots and call.admits:
                upstream = await slots.admit(gw, call, route, tried, upstream)
                if upstream is None:
                    continue  # its replica went away as it was granted: admitted again
            if upstream is not None:
                return upstream
            now = time.monotonic()
            if deadline is None:
                deadline = now + route.wait_seconds
            if tried and route.coming == 0:
                raise last_error or GatewayError(502, "upstream_error",
                                                 f"every ready replica of {call.model} failed this request")
            if (refusal := _none_coming(call, route, now, deadline, asked=waiting or call.lease_asked)) is not None:
                raise refusal
            if gw.admission.enabled and route.slots and call.admits and not tried and not call.lease_asked:
                # it waits for the replica on its way in the model's queue, in the order admission keeps, counted
                # as demand; the replica ready, the queue's own wait bound follows the load's
                call.lease_asked, call.asked_until = True, now + NO_ROOM_RECHECK
                upstream = await slots.admit(gw, call, route, tried, None, max_wait=deadline - now + route.max_wait,
                                             check=lambda deadline=deadline: _still_coming(gw, call, deadline))
                if upstream is not None:
                    return upstream
                continue  # granted a replica gone since, or Redis out of reach: as without admission
            if route.autoscaled and not waiting:
                waiting = True
                call.asked_until = now + NO_ROOM_RECHECK
                await gw.wait_begin(call.model)
            await gw.wait_for_change(min(deadline - now, 1.0))
    finally:
        if waiting:
            gw.wait_end(call.model)


def _route(table, call):
    """The request's model's route in the table, unless the system is stopped or no such model is there."""
    if table.serving_stopped:
        raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
    route = table.find(call.model)
    if route is None:
        raise GatewayError(404, "model_not_found", f"no model named {call.model!r}")
    return route


def _none_coming(call, route, now: float, deadline: float, asked: bool) -> GatewayError | None:
    """Why a request for a model with no replica ready it may use stops waiting (None: it waits on). An
    autoscaled model found without room, as the reconciler last found, is asked again (the room may be there
    now), and the reconciler has a moment to say otherwise."""
    asks = route.autoscaled and (not route.no_room or not asked or now < call.asked_until)
    if route.coming == 0 and not asks:
        what = "none is on its way" + (f": {route.no_room}" if route.no_room else "")
    elif now >= deadline:
        what = f"waited {route.wait_seconds}s"
    else:
        return None
    return GatewayError(503, "no_replica_ready", f"no replica of {call.model} is ready ({what})", 5)


def _still_coming(gw, call, deadline: float) -> None:
    """For a request waiting in its model's queue for a replica on its way: raises what ends its wait (the system
    stopped, the model gone, none coming any more, the load's wait over); with a replica ready, nothing."""
    route = _route(gw.table, call)
    if not route.ready and (refusal := _none_coming(call, route, time.monotonic(), deadline, asked=True)) is not None:
        raise refusal


def _done(gw, call, upstream) -> None:
    gw.end(upstream.replica)
    metrics.of(call.model).inflight.dec()
    slots.release(gw, call)


async def _send(gw, call, surface, payload):
    """Send to a replica; before any byte of an answer, retry another on a connection failure or a 502/503."""
    tried: set[str] = set()
    last_error = None
    for _ in range(gw.tries):
        choosing = time.monotonic()
        try:
            upstream = await _choose(gw, call, tried, last_error)
        finally:
            call.waited = (call.waited or 0.0) + time.monotonic() - choosing
        call.attempts += 1
        tried.add(upstream.replica)
        call.replica = upstream.replica
        gw.start(upstream.replica)
        metrics.of(call.model).inflight.inc()
        try:
            response = await gw.engines.post(upstream.host, upstream.port, f"/v1/{surface.path}", payload,
                                             upstream.authorization)
        except ConnectTimeout:
            _done(gw, call, upstream)
            gw.cannot_connect(upstream.replica)
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} did not accept the connection")
            continue
        except ReadTimeout:
            _done(gw, call, upstream)
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not answer in time") from None
        except UpstreamError as exc:  # refused, reset, closed before an answer: nothing reached the client
            _done(gw, call, upstream)
            if isinstance(exc, (ConnectFailed, Unreachable)):
                gw.cannot_connect(upstream.replica)
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} failed: {_describe(exc)}")
            continue
        except BaseException:  # cancelled: the client went away before the engine answered; the count must not leak
            _done(gw, call, upstream)
            raise
        if response.status in RETRYABLE_STATUS or response.status in KEY_REFUSED:
            response.close()
            _done(gw, call, upstream)
            log.warning("replica %s answered %s to %s; trying another", upstream.replica, response.status, call.model)
            if response.status in KEY_REFUSED:
                last_error = refusal(call.model, surface.capability, response.status, b"")
            else:
                last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status}")
            continue
        if gw.unreachable:
            gw.unreachable.pop(upstream.replica, None)
        return upstream, response
    raise last_error or GatewayError(502, "upstream_error", "no replica could take the request")


def _describe(exc: BaseException) -> str:
    """What went wrong, for the client, in words that name no host or port; the web log has the rest."""
    log.warning("upstream failure: %s: %s", type(exc).__name__, exc)
    return scrub(str(exc)) or type(exc).__name__


def _refused(call, surface, upstream, status: int, content: bytes) -> GatewayError:
    said = content[:500].decode(errors="replace")
    log.warning("replica %s answered %s to %s: %s", upstream.replica, status, call.model, said)
    return refusal(call.model, surface.capability, status, content)


async def _once(gw, call, surface, payload):
    """A whole answer: held and sent as one when it is small (ONCE_BYTES), else passed on as it comes, with no more
    of it in memory than the engine connection's buffer (an answer of many embeddings or log-probabilities)."""
    upstream, response = await _send(gw, call, surface, payload)
    passing = False
    try:
        try:
            content, whole = await response.read_upto(ONCE_BYTES if response.status == 200 else ERROR_BYTES)
        except ReadTimeout:
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not finish in time") from None
        except UpstreamError as exc:
            raise GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {_describe(exc)}") from None
        status = response.status
        if status >= 400:
            raise _refused(call, surface, upstream, status, content)
        if not whole:
            passing = True
            return _pass_on(gw, call, upstream, response, content)
        if status == 200:
            _take_usage(call, surface, content)  # before its slot goes back: the key's service counts it
    finally:
        if not passing:
            response.release()  # read to the end: back to the pool; else closed
            _done(gw, call, upstream)
    if status == 200:
        gw.ledger.add(call.key.id, call.model, call.prompt, call.completion)
        await call.settle()  # before the answer: the key's next request sees what this one used
    call.finish(status)
    return Answer(content, status, response.content_type)


ONCE_BYTES = 1 << 20  # a whole answer larger than this is passed on as it comes instead of held
ERROR_BYTES = 64 << 10  # of an engine's error answer, read for its words; the rest is not wanted
USAGE_TAIL = 64 << 10  # of a passed-on answer, kept to find its usage in (the engines put it near the end)
_USAGE_FIELD = re.compile(rb'[{,]\s*"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')


def _pass_on(gw, call, upstream, response, head: bytes) -> Streamed:
    """A large whole answer, passed on as it comes; its usage read off its tail."""
    state = {"settled": False}

    def settle(status: int) -> None:
        if state["settled"]:
            return
        state["settled"] = True
        if response.complete:
            response.release()
        else:
            response.close()
        if status != 200 and not call.completion:  # cut short: the engine had generated it all; its usage never came
            call.prompt = call.prompt_about
            call.completion = max(0, call.reserved - call.prompt_about)  # with a tpm limit: what it may have used
        _done(gw, call, upstream)
        gw.ledger.add(call.key.id, call.model, call.prompt, call.completion)
        call.finish(status)

    async def chunks():
        tail = head[-USAGE_TAIL:]
        status = 499
        try:
            yield head
            async for chunk in response.chunks():
                tail = (tail + chunk)[-USAGE_TAIL:]
                yield chunk
            status = 200
            for name, value in _USAGE_FIELD.findall(tail):  # the last of each: the answer's own usage
                if name in (b"prompt_tokens", b"input_tokens"):
                    call.prompt = int(value)
                else:
                    call.completion = int(value)
        except (ReadTimeout, UpstreamError) as exc:  # the status went out: all that is left is to stop
            log.warning("replica %s broke off a large answer: %s", upstream.replica, _describe(exc))
            status = 502
        finally:
            settle(status)

    return Streamed(chunks(), settle, response.content_type)


def _take_usage(call, surface, content: bytes) -> None:
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return
    usage = surface.usage(body) if isinstance(body, dict) else None
    if usage is not None:
        call.prompt, call.completion, call.usage_known = usage.prompt, usage.completion, True


async def _stream(gw, call, surface, payload, wants_usage: bool):
    upstream, response = await _send(gw, call, surface, payload)
    if response.status != 200:
        try:
            content = await response.read()
        except UpstreamError:
            content = b""
        finally:
            response.release()
            _done(gw, call, upstream)
        if response.status >= 400:
            raise _refused(call, surface, upstream, response.status, content)
        call.finish(response.status)
        return Answer(content, response.status, response.content_type)

    state = {"finished": False, "settled": False, "done_sent": False, "released": False}
    complete = surface.completer(call.model, call.prompt_about) if surface.completer is not None else None

    def release() -> None:
        """The replica is done with the request: once, when the engine's [DONE] arrives (before the client has it:
        a conversation's next turn may follow at once, through another web process, and must not find the
        replica still counted busy with this one), or however else the stream ended."""
        if not state["released"]:
            state["released"] = True
            _done(gw, call, upstream)

    def settle(status: int) -> None:
        """Let the upstream go and count the request, once, however the stream ended."""
        if state["settled"]:
            return
        state["settled"] = True
        if state["finished"]:
            response.release()  # read to the end: the connection goes back to the pool
        else:
            response.close()  # cut short: the engine sees its client go and stops generating
        release()
        call.count_cut_short()
        if call.completion and not call.prompt:  # its prompt's count never came (a Messages stream without its start)
            call.prompt = call.prompt_about
        gw.ledger.add(call.key.id, call.model, call.prompt, call.completion)
        call.finish(status)

    async def events():
        buffer = b""
        status = 499  # unless it ends otherwise: the client went away, and closing the upstream cancels the work
        try:
            async for chunk in response.chunks():
                if call.first_chunk is None:
                    call.first_chunk = time.monotonic()
                    metrics.of(call.model).first_token.observe(call.first_chunk - call.started)
                buffer += chunk
                out = []
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if _keep_event(call, surface, event, wants_usage):
                        out.append((complete(event) if complete is not None else event) + b"\n\n")
                if out:
                    last = any(e.startswith(surface.done_event) for e in out)
                    if last:
                        release()
                    yield b"".join(out)
                    # asked for more: the [DONE] went out. A client that hangs up now got the whole stream
                    state["done_sent"] = state["done_sent"] or last
            if buffer.strip():
                yield complete(buffer) if complete is not None else buffer
            state["finished"], status = True, 200
        except ReadTimeout:
            status = 504
            yield _ending(surface, complete, GatewayError(504, "upstream_timeout",
                                                          f"replica {upstream.replica} stopped sending"))
        except UpstreamError as exc:
            status = 502
            yield _ending(surface, complete, GatewayError(502, "upstream_error",
                                                          f"replica {upstream.replica} broke off: {_describe(exc)}"))
        finally:
            settle(200 if status == 499 and state["done_sent"] else status)

    return Streamed(events(), settle)


def _ending(surface, complete, exc: GatewayError) -> bytes:
    """The error that ends a stream the engine broke off, completed as the stream's other events were."""
    event = surface.error_event(exc)
    return complete(event[:-2]) + b"\n\n" if complete is not None else event


# a chunk that carries a token: OpenAI's and Anthropic's deltas, and the Responses API's text deltas
_GENERATED = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"|"type"\s*:\s*"response\.output_text\.delta"')


def _keep_event(call, surface, event: bytes, wants_usage: bool) -> bool:
    """Read the usage off the stream; drop the usage-only chunk the client did not ask for. Count the chunks that
    carry generated text (one token each, as the engines stream), for a stream cut short before its usage."""
    if b'"usage"' not in event:
        if _GENERATED.search(event):
            call.passed += 1
        return True
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            data = json.loads(line[5:])
        except (ValueError, RecursionError):
            return True
        said = surface.event_usage(data, call.prompt, call.completion) if isinstance(data, dict) else None
        if said is None:
            continue
        call.prompt, call.completion, whole = said
        call.usage_known = call.usage_known or whole
        if not wants_usage and not data.get("choices"):
            return False
    return True
