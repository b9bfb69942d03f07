"""A request's way to an engine: a ready replica of its model as the routing picks (waiting for one on its way,
up to the model's wait; a slot on it from admission, gateway/slots.py), sent there, and before any byte of an
answer, another tried on a connection failure or a 502/503 (failover)."""

from __future__ import annotations

import logging
import random
import time
from functools import partial

from gateway import metrics, shadow, slots
from gateway.call import Call, Way
from gateway.engines_http import ConnectFailed, ConnectTimeout, EngineAnswer, ReadTimeout, Unreachable, UpstreamError
from gateway.errors import GatewayError
from gateway.records import Try
from gateway.runtime import Gateway
from gateway.surfaces import Surface
from gateway.table import ModelRoute, Table, Upstream
from gateway.upstream import KEY_REFUSED, refusal, scrub

log = logging.getLogger("llmgw.gateway")

RETRYABLE_STATUS = (502, 503)
NO_ROOM_RECHECK = 1.0  # seconds a request asking for a model found without room waits for the reconciler's word


async def choose(gw: Gateway, call: Call, way: Way, tried: set[str], last_error: GatewayError | None = None,
                 back: set[str] | None = None) -> Upstream:
    """A ready replica, as the model's routing picks; wait for one that is on its way, up to wait_seconds. A
    request for an autoscaled model with no replica ready asks for one (at zero, that wakes the model) and waits
    for it, unless no room can be made for it. With every ready replica tried and none coming, the last one's
    failure is the answer, unless one in `back` (the replica an answer being resumed broke off from) is still
    ready: the same one, back."""
    deadline = None
    waiting = False
    # while a rollout watches, its conversation's side (gateway.table.ModelRoute.other_side): by its key, the
    # same every time; a request with none (no prompt to key) falls on one at random
    conversation = call.affinity if call.affinity is not None else random.getrandbits(64)
    try:
        while True:
            route = _route(await gw.current(), call)
            avoid = route.other_side(conversation)
            upstream = await gw.choose(route, tried | avoid, call.affinity) if avoid else None
            if upstream is None:  # no rollout, or its side all tried: any replica
                avoid = frozenset()
                upstream = await gw.choose(route, tried, call.affinity)
            queued = bool(gw.admission.enabled and route.slots and call.admits)
            if upstream is not None and queued:
                upstream = await slots.admit(gw, call, way, route, tried, upstream, avoid=avoid)
                if upstream is None:
                    continue  # its replica went away as it was granted: admitted again
            if upstream is not None:
                return _chosen(gw, call, way, upstream, queued, avoid)
            now = time.monotonic()
            if deadline is None:
                deadline = now + route.wait_seconds
            if tried and route.coming == 0 and back and (again := [u for u in route.ready if u.replica in back]):
                back.clear()
                tried.discard(again[0].replica)
                continue
            if tried and route.coming == 0:
                raise last_error or GatewayError(502, "upstream_error",
                                                 f"every ready replica of {call.model} failed this request")
            if (refusal := _none_coming(call, way, route, now, deadline, asked=waiting or way.lease_asked)) is not None:
                raise refusal
            if gw.admission.enabled and route.slots and call.admits and not tried and not way.lease_asked:
                # it waits for the replica on its way in the model's queue, in the order admission keeps, counted
                # as demand; the replica ready, the queue's own wait bound follows the load's
                way.lease_asked, way.asked_until = True, now + NO_ROOM_RECHECK
                upstream = await slots.admit(gw, call, way, route, tried, None, max_wait=deadline - now + route.max_wait,
                                             check=partial(_still_coming, gw, call, way, deadline))
                if upstream is not None:
                    return _chosen(gw, call, way, upstream, True)
                continue  # granted a replica gone since, or Redis out of reach: as without admission
            if route.autoscaled and not waiting:
                waiting = True
                way.asked_until = now + NO_ROOM_RECHECK
                await gw.wait_begin(call.model)
            await gw.wait_for_change(min(deadline - now, 1.0))
    finally:
        if waiting:
            gw.wait_end(call.model)


def _chosen(gw: Gateway, call: Call, way: Way, upstream: Upstream, queued: bool,
            avoid: frozenset[str] = frozenset()) -> Upstream:
    """The replica chosen, and why (for the request's record): while a rollout watches, a replica of the other
    side is passed over as that, and a canary chosen is said to be one."""
    assert gw.table is not None  # loaded: the request found its route in it
    route = gw.table.find(call.model)
    if route is not None:
        why = gw.explain(route, upstream.replica, {t.replica: t.outcome for t in way.tries}, call.affinity,
                         call.session, queued)
        if avoid:
            said = "a rollout's canary: not this conversation's side" if avoid <= route.canary else \
                "the current side: this conversation is a rollout's canary's"
            why = why._replace(passed=tuple((n, said if n in avoid else w) for n, w in why.passed))
        if upstream.replica in route.canary:
            why = why._replace(chosen=f"{why.chosen}, a rollout's canary")
        way.why = why
    return upstream


def _tried(call: Call, way: Way, upstream: Upstream, sent: float, outcome: str) -> None:
    """What became of the request at a replica it was sent to (`sent`: time.monotonic() then), in its record."""
    way.tries.append(Try(upstream.replica, (sent - call.started) * 1000, (time.monotonic() - call.started) * 1000,
                         outcome))


def _route(table: Table, call: Call) -> ModelRoute:
    """The request's model's route in the table, unless the system is stopped or no such model is there."""
    if table.serving_stopped:
        raise GatewayError(503, "system_stopped", "llmgw is stopped; it answers again after `llmgw start`", 30)
    route = table.find(call.model)
    if route is None:
        raise GatewayError(404, "model_not_found", f"no model named {call.model!r}")
    return route


def _none_coming(call: Call, way: Way, route: ModelRoute, now: float, deadline: float, asked: bool
                 ) -> GatewayError | None:
    """Why a request for a model with no replica ready it may use stops waiting (None: it waits on). An
    autoscaled model found without room, as the reconciler last found, is asked again (the room may be there
    now), and the reconciler has a moment to say otherwise."""
    asks = route.autoscaled and (not route.no_room or not asked or now < way.asked_until)
    if route.coming == 0 and not asks:
        what = "none is on its way" + (f": {route.no_room}" if route.no_room else "")
    elif now >= deadline:
        what = f"waited {route.wait_seconds}s"
    else:
        return None
    return GatewayError(503, "no_replica_ready", f"no replica of {call.model} is ready ({what})", 5)


def _still_coming(gw: Gateway, call: Call, way: Way, deadline: float) -> None:
    """For a request waiting in its model's queue for a replica on its way: raises what ends its wait (the system
    stopped, the model gone, none coming any more, the load's wait over); with a replica ready, nothing."""
    assert gw.table is not None  # loaded: the request found its model's route in it
    route = _route(gw.table, call)
    if not route.ready and (refusal := _none_coming(call, way, route, time.monotonic(), deadline, asked=True)) is not None:
        raise refusal


def done(gw: Gateway, call: Call, way: Way, upstream: Upstream) -> None:
    gw.end(upstream.replica)
    metrics.of(call.model).inflight.dec()
    slots.release(gw, call, way)


async def send(gw: Gateway, call: Call, way: Way, surface: Surface, payload: bytes, avoid: str = ""
               ) -> tuple[Upstream, EngineAnswer]:
    """Send to a replica; before any byte of an answer, retry another on a connection failure or a 502/503. An
    answer being resumed `avoid`s the replica it broke off from while another will do."""
    tried: set[str] = {avoid} if avoid else set()
    back = {avoid} if avoid else None
    last_error = None
    for _ in range(gw.tries):
        choosing = time.monotonic()
        try:
            upstream = await choose(gw, call, way, tried, last_error, back)
        finally:
            way.waited = (way.waited or 0.0) + time.monotonic() - choosing
        way.attempts += 1
        tried.add(upstream.replica)
        way.replica = upstream.replica
        gw.start(upstream.replica)
        metrics.of(call.model).inflight.inc()
        sent = time.monotonic()
        try:
            response = await gw.engines.post(upstream.host, upstream.port, f"/v1/{surface.path}", payload,
                                             upstream.authorization, call.engine_headers, upstream.replica)
        except ConnectTimeout:
            done(gw, call, way, upstream)
            gw.cannot_connect(upstream.replica)
            _tried(call, way, upstream, sent, "did not accept the connection")
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} did not accept the connection")
            continue
        except ReadTimeout:
            done(gw, call, way, upstream)
            _tried(call, way, upstream, sent, "did not answer in time")
            raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not answer in time") from None
        except UpstreamError as exc:  # refused, reset, closed before an answer: nothing reached the client
            done(gw, call, way, upstream)
            if isinstance(exc, (ConnectFailed, Unreachable)):
                gw.cannot_connect(upstream.replica)
            _tried(call, way, upstream, sent, f"failed: {(said := describe(exc))}")
            last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} failed: {said}")
            continue
        except BaseException:  # cancelled: the client went away before the engine answered; the count must not leak
            done(gw, call, way, upstream)
            _tried(call, way, upstream, sent, "cancelled: the client went away")
            raise
        _tried(call, way, upstream, sent, f"answered {response.status}")
        if response.status in RETRYABLE_STATUS or response.status in KEY_REFUSED:
            response.close()
            done(gw, call, way, upstream)
            log.warning("replica %s answered %s to %s; trying another", upstream.replica, response.status, call.model)
            if response.status in KEY_REFUSED:
                last_error = refusal(call.model, surface.capability, response.status, b"")
            else:
                last_error = GatewayError(502, "upstream_error", f"replica {upstream.replica} answered {response.status}")
            continue
        if gw.unreachable:
            gw.unreachable.pop(upstream.replica, None)
        if not avoid and gw.table is not None and (route := gw.table.find(call.model)) is not None and route.shadow:
            shadow.maybe(gw, call, route, upstream, surface, payload)  # (not a resume's continuation)
        return upstream, response
    raise last_error or GatewayError(502, "upstream_error", "no replica could take the request")


def broke(call: Call, way: Way, outcome: str) -> None:
    """The replica a request was last sent to broke off its answer, which goes on elsewhere: its try says so."""
    if way.tries:
        last = way.tries[-1]
        way.tries[-1] = last._replace(ended_ms=(time.monotonic() - call.started) * 1000, outcome=outcome)


def describe(exc: BaseException) -> str:
    """What went wrong, for the client, in words that name no host or port; the web log has the rest."""
    log.warning("upstream failure: %s: %s", type(exc).__name__, exc)
    return scrub(str(exc)) or type(exc).__name__


def refused(call: Call, surface: Surface, upstream: Upstream, status: int, content: bytes) -> GatewayError:
    said = content[:500].decode(errors="replace")
    log.warning("replica %s answered %s to %s: %s", upstream.replica, status, call.model, said)
    return refusal(call.model, surface.capability, status, content)


