"""The autoscaler's rule, pure: a model's configuration, the state it kept and what the gateways see now in, the
replicas it wants out, with the reason and the figures when that number changes.

- Load is requests in flight plus requests waiting for a replica or for a slot (gateway/admission.py), all web
  processes together, averaged over the window (weighted by time, from the samples kept in the state).
- At zero, a request waiting or in flight wakes the model: one replica (or its minimum).
- On demand (min 0): no request for `idle_after` and nothing in flight or waiting, down to zero.
- Above `target` requests per replica over a whole window, with every wanted replica ready, one more (up to max).
- Needing fewer replicas for the target (the load over the window ÷ target, rounded up) for `scale_down_delay`,
  one fewer (down to the minimum, and never to zero this way: that is idleness's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ground.units import format_age

MAX_SAMPLES = 720  # a window's samples kept at most (an hour of 5-second reconciles)


@dataclass(frozen=True)
class Scaling:
    """How a model scales, as its operator set it."""

    min: int
    max: int
    target: int  # requests in flight per replica
    idle_after: float  # seconds
    scale_down_delay: float  # seconds


@dataclass(frozen=True)
class DemandState:
    replicas: int
    samples: tuple[tuple[float, float], ...] = ()  # (time, load), oldest first
    below_since: float | None = None
    last_request: float | None = None
    last_scaled: float | None = None


@dataclass(frozen=True)
class Seen:
    """What the gateways report now for the model."""

    inflight: int = 0
    waiting: int = 0
    last_request: float | None = None
    ready: int = 0  # its ready replicas


@dataclass(frozen=True)
class Decision:
    before: int
    after: int
    why: str
    figures: dict[str, float]  # what it was decided on (its Event's data): loads, counts, seconds


def average(samples: tuple[tuple[float, float], ...], now: float, window: float | None = None) -> float:
    """The time-weighted mean load over the window up to now (each sample holds until the next; one from before
    the window holds into it)."""
    if not samples:
        return 0.0
    start = now - window if window is not None else samples[0][0]
    total = weight = 0.0
    for (t, load), (t_next, _) in zip(samples, samples[1:] + ((now, 0.0),)):
        begin = max(t, start)
        if t_next > begin:
            total += load * (t_next - begin)
            weight += t_next - begin
    return total / weight if weight else samples[-1][1]


def _in_window(samples: tuple[tuple[float, float], ...], now: float, window: float) -> tuple[tuple[float, float], ...]:
    """The samples of the window, and the last one before it (it holds into the window)."""
    start = now - window
    before = [s for s in samples if s[0] < start]
    return tuple(before[-1:]) + tuple(s for s in samples if s[0] >= start)


def decide(cfg: Scaling, state: DemandState, seen: Seen, now: float, window: float) -> tuple[DemandState, Decision | None]:
    load = seen.inflight + seen.waiting
    last_request = max((t for t in (state.last_request, seen.last_request) if t is not None), default=None)
    if load:
        last_request = now
    samples = (_in_window(state.samples, now, window) + ((now, float(load)),))[-MAX_SAMPLES:]
    state = replace(state, samples=samples, last_request=last_request)
    before = state.replicas
    floor = max(cfg.min, 1) if before else cfg.min

    def to(after: int, why: str, **figures: float) -> tuple[DemandState, Decision]:
        # a new count starts a new window: what comes next is measured with the replicas it now has
        new = replace(state, replicas=after, last_scaled=now, below_since=None, samples=((now, float(load)),))
        return new, Decision(before, after, why, figures)

    # what the operator changed: within the range at once
    if before < cfg.min or before > cfg.max:
        after = min(max(before, cfg.min), cfg.max)
        return to(after, f"its range is now {cfg.min} to {cfg.max}")
    if before == 0:
        if load:
            after = max(cfg.min, 1)
            waiting = f"{seen.waiting} request(s) waiting" if seen.waiting else f"{seen.inflight} request(s) in flight"
            return to(after, f"woken: {waiting}", waiting=seen.waiting, inflight=seen.inflight)
        return state, None
    if cfg.min == 0 and not load and last_request is not None and now - last_request >= cfg.idle_after:
        return to(0, f"idle: no request for {format_age(now - last_request)}", idle_seconds=round(now - last_request))
    if cfg.min == 0 and last_request is None and not load:
        # never asked for: idle from when it last scaled (a fixed model made on demand keeps what it ran for its idle
        # time from then); never scaled either, nothing to keep loaded
        if state.last_scaled is None:
            return to(0, "idle: no request yet")
        if now - state.last_scaled >= cfg.idle_after:
            return to(0, f"idle: no request since it was last scaled, {format_age(now - state.last_scaled)} ago",
                      idle_seconds=round(now - state.last_scaled))

    mean = average(samples, now, window)
    per = mean / before
    covered = len(samples) > 1 and samples[0][0] <= now - window  # the samples span the whole window
    figures = {"load": round(mean, 2), "per_replica": round(per, 2), "target": cfg.target, "window": window}
    if per > cfg.target and before < cfg.max and covered and seen.ready >= before:
        return to(before + 1, f"{per:.1f} requests per replica over {format_age(window)}, above the target of {cfg.target}",
                  **figures)
    needed = max(floor, math.ceil(mean / cfg.target)) if cfg.target else before
    if needed < before and covered:
        below_since = state.below_since if state.below_since is not None else now
        if now - below_since >= cfg.scale_down_delay:
            return to(before - 1, f"{per:.1f} requests per replica; {needed} replica(s) hold the target of "
                                  f"{cfg.target} for {format_age(now - below_since)}", **figures)
        return replace(state, below_since=below_since), None
    return replace(state, below_since=None), None
