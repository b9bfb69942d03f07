"""The views' side of admission (gateway/admission.py) and of a key's budget and concurrency: a request's slot
taken and given back, and the refusals a key's operator hears of."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from channels.db import database_sync_to_async
from redis.exceptions import RedisError

from cluster.events import record
from gateway import admission, metrics
from gateway.errors import GatewayError
from gateway.redis_reach import RedisAway
from gateway.runtime import PREFIX

if TYPE_CHECKING:
    from gateway.call import Call, Way
    from gateway.runtime import Gateway
    from gateway.table import KeyInfo, ModelRoute, Upstream

log = logging.getLogger("llmgw.gateway")


# refusals a key's operator should hear of: an Event per key and reason per minute (not one per request)
REFUSALS = ("queue_full", "queue_timeout", "concurrency_limit", "budget_exceeded")
REFUSED_NOTED = "llmgw:refused:"  # + key id, reason and minute: set once the minute's Event is written


def refused_for_key(gw: Gateway, call: Call, exc: GatewayError) -> None:
    """Count a refusal of a request with a key (the views ask only for one that has its key), and note it for
    the key's operator."""
    assert call.key is not None
    if exc.code in ("concurrency_limit", "budget_exceeded"):  # the queue's are counted where they happen
        metrics.REJECTED.labels(call.model if call.known else metrics.UNKNOWN_MODEL, admission.CLASSES[call.rank],
                                exc.code).inc()
    gw.spawn(_note_refusal(gw, call.key, call.model, exc))


async def _note_refusal(gw: Gateway, key: KeyInfo, model: str, exc: GatewayError) -> None:
    try:
        minute = int(time.time() // 60)
        if await gw.redis.set(f"{REFUSED_NOTED}{key.id}:{exc.code}:{minute}", 1, nx=True, ex=120):
            await database_sync_to_async(record)(
                "key.refused", "gateway", f"key {key.name}: requests for {model} refused ({exc.code}): {exc.message}",
                subject=key.name, reason=exc.code, model=model)
        until = exc.exhausted_until
        if until and await gw.redis.set(f"{REFUSED_NOTED}{key.id}:budget:{until}", 1, nx=True, exat=until + 60):
            await database_sync_to_async(record)("key.budget_reached", "gateway", exc.message, subject=key.name)
    except Exception as exc:  # an Event missed is not worth a request
        log.warning("could not record a refusal for key %s (%s)", key.name, exc)


async def admit(gw: Gateway, call: Call, way: Way, route: ModelRoute, tried: set[str], chosen: Upstream | None,
                max_wait: float | None = None, check: Callable[[], None] | None = None,
                avoid: frozenset[str] = frozenset()) -> Upstream | None:
    """A slot on a ready replica of the route, waiting for one in the model's queue (gateway/admission.py) at most
    `max_wait` seconds (the model's own by default; `check()` raises what ends the wait sooner); the upstream it
    is on (None: that replica is gone from the table since). With Redis away (gateway/redis_reach.py), the replica
    routing `chosen` without a slot: serving goes on, unordered, until Redis is back."""
    ring = route.ring.walk(call.affinity) if call.affinity is not None and route.routing == PREFIX else ()
    prefs = [name for name in ring if name not in tried and name not in avoid]  # (avoid: a rollout's other side)
    if gw.unreachable:  # tried last
        prefs = [n for n in prefs if n not in gw.unreachable] + [n for n in prefs if n in gw.unreachable]
    waiting = queued = False
    priority = admission.CLASSES[call.rank]

    def waits() -> None:  # counted in the metrics; the autoscaler counts it too (cluster.inflight)
        nonlocal waiting, queued
        queued = True
        metrics.of(call.model).queued[priority].inc()
        if route.autoscaled:
            waiting = True
            gw.spawn(gw.wait_begin(call.model))

    began = time.monotonic()
    try:
        way.lease = await gw.admission.admit(
            call.model, lambda: gw.slots_of(call.model), key=str(call.key_id),
            rank=admission.RANK["interactive"] if tried else call.rank, cost=admission.service(call.prompt_about, 0),
            prefs=prefs, queue_limit=route.queue_limit, max_wait=route.max_wait if max_wait is None else max_wait,
            on_wait=waits, check=check, movable=call.prompt_about < admission.SHORT_PROMPT, exclude=tried | avoid,
            chosen=chosen.replica if chosen is not None and not tried else None, klass=call.rank)
    except GatewayError as exc:
        metrics.REJECTED.labels(call.model, priority, exc.code).inc()
        raise
    except (RedisAway, RedisError, OSError) as exc:  # said once (gateway/redis_reach.py), not per request
        gw.admission.reach.lost(exc)
        gw.admission.reach.went_without()
        return chosen
    finally:
        if queued:
            metrics.of(call.model).queued[priority].dec()
        if waiting:
            gw.wait_end(call.model)
    way.position = way.position if way.lease.position is None else way.lease.position
    metrics.ADMITTED.labels(call.model, priority).inc()
    metrics.QUEUE_WAIT.labels(call.model, priority).observe(time.monotonic() - began)
    assert gw.table is not None  # loaded: the request found its route in it
    now = gw.table.find(call.model)
    upstream = next((u for u in (now.ready if now else ()) if u.replica == way.lease.replica), None)
    if upstream is None:
        release(gw, call, way)
    return upstream


def release(gw: Gateway, call: Call, way: Way) -> None:
    """The request's slot back, with the service it had (its tokens, as far as they are known)."""
    if way.lease is not None:
        lease, way.lease = way.lease, None
        served = admission.service(call.used.prompt or call.prompt_about, call.used.completion or call.used.passed)
        gw.admission.give_back(lease, served)


