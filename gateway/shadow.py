"""A rollout's shadow (`ctl rollout start M --shadow 5%`): a share of the requests the current replicas take is
also sent to the canary, as the engine was sent it, and its answer read to the end and discarded. The client
never waits for it nor sees it. Its record (`shadow`, the request's id with `.shadow`) is what the rollout
judges the canary by (gateway/rollout_figures.py), beside the records of the current side: a change can be
judged before it answers anyone (`--traffic 0%`).

A copy takes no slot of admission and no key's limits: the fleet's cost, bounded per process (MAX_IN_FLIGHT
copies at once; past it, none is sent) and in time (a copy is given up after its model's wait for an answer).
"""

from __future__ import annotations

import logging
import random
import re
import time

from gateway.call import Call
from gateway.engines_http import UpstreamError
from gateway.records import Row, Try
from gateway.runtime import Gateway
from gateway.surfaces import Surface
from gateway.table import ModelRoute, Upstream

log = logging.getLogger("llmgw.gateway")

MAX_IN_FLIGHT = 32  # copies at once per process
TIMEOUT = 300.0  # seconds a copy may take
_TOKENS = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*([0-9]+)')
_PROMPT = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*([0-9]+)')
_in_flight = 0


def maybe(gw: Gateway, call: Call, route: ModelRoute, upstream: Upstream, surface: Surface, payload: bytes) -> None:
    """Send a copy of the request to the model's canary, at its rollout's shadow share, when a current replica
    took it."""
    global _in_flight
    if not route.shadow or not route.canary or upstream.replica in route.canary or random.random() >= route.shadow:
        return
    canaries = [u for u in route.ready if u.replica in route.canary]
    if not canaries or _in_flight >= MAX_IN_FLIGHT or gw.records is None:
        return
    _in_flight += 1
    target = min(canaries, key=lambda u: gw.load_of(u.replica))
    gw.spawn(_copy(gw, call, target, surface, payload))


async def _copy(gw: Gateway, call: Call, upstream: Upstream, surface: Surface, payload: bytes) -> None:
    global _in_flight
    started, at = time.monotonic(), time.time()
    first: float | None = None
    tail, status, outcome = b"", 0, ""
    gw.start(upstream.replica)
    try:
        response = await gw.engines.post(upstream.host, upstream.port, f"/v1/{surface.path}", payload,
                                         upstream.authorization, call.engine_headers, upstream.replica)
        status = response.status
        try:
            async for part in response.chunks():
                if first is None:
                    first = time.monotonic()
                tail = (tail + part)[-4096:]  # the usage comes last
                if time.monotonic() - started > TIMEOUT:
                    raise TimeoutError
            outcome = f"answered {status}"
        finally:
            response.close()
    except UpstreamError as exc:
        outcome = f"failed: {type(exc).__name__}"
        status = status or 502
    except TimeoutError:
        outcome, status = "did not answer in time", 504
    except Exception as exc:  # a copy never fails anything of the client's
        log.warning("a shadow copy to %s failed: %s", upstream.replica, exc)
        outcome, status = f"failed: {type(exc).__name__}", 502
    finally:
        gw.end(upstream.replica)
        _in_flight -= 1
    ended = time.monotonic()
    tokens = [int(n) for n in _TOKENS.findall(tail)]
    prompt = [int(n) for n in _PROMPT.findall(tail)]
    assert gw.records is not None  # (maybe() sends none without them)
    gw.records.add(Row(
        f"{call.request_id[:120]}.shadow", call.trace.trace_id if call.trace else "", at, None, call.model[:128],
        call.model[:128], call.surface, call.streamed, status, "", "", None, upstream.replica, 1,
        None if first is None or not call.streamed else (first - started) * 1000, (ended - started) * 1000,
        prompt[-1] if prompt else 0, tokens[-1] if tokens else 0, "", "", "", None, None,
        (Try(upstream.replica, 0.0, (ended - started) * 1000, outcome),), 0, None, None, "", "", shadow=True))
