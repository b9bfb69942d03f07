"""How a rollout's canary is judged against its model's current replicas, as a pure function: both sides'
figures in (from the request records, gateway/rollout_figures.py), a verdict out.

- **Errors.** The canary's errors per request (5xx answers, broken streams, engines that failed or did not
  answer) are held to `max_error_rate`. The canary is rolled back the moment its errors pass what that rate
  allows of `min_requests` (or of its requests, once it has more): its rate at `min_requests` could only be
  worse, so waiting for them would only serve more of them.
- **Latency.** The canary's median time to first token and time per output token, over the current side's
  on the same stretch of traffic, are held to `max_ttft_ratio` and `max_tpot_ratio` once each side has
  `min_requests` of them: a ratio of two medians of the same traffic, not an absolute figure, so a busy
  fleet does not roll back a good change, nor a quiet one promote a slow one.
- **Promoted** once the watch window has passed since the first canary was ready, with `min_requests` on the
  canary and every bound held; until then (a quiet model), it watches on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Side:
    """One side's figures over the window: requests it was sent (each try counts), errors among them, and the
    medians and 99th percentiles of its answered streams' time to first token and time per output token (ms)."""

    requests: int = 0
    errors: int = 0
    timed: int = 0  # answered streams: the latency figures' samples
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def shown(self) -> dict:
        return {**asdict(self), "error_rate": round(self.error_rate, 4)}

    @classmethod
    def of(cls, shown: dict) -> Side:
        """The side again from what `shown` gave (a rollout's `figures`, as last judged)."""
        return cls(**{f.name: shown[f.name] for f in fields(cls) if f.name in shown})


@dataclass(frozen=True)
class Bounds:
    min_requests: int
    max_error_rate: float
    max_ttft_ratio: float
    max_tpot_ratio: float


@dataclass(frozen=True)
class Verdict:
    """`promote`, `roll_back` or neither (watch on), and why, in words for the Event and the status."""

    promote: bool = False
    roll_back: bool = False
    why: str = ""


def ratio(canary: float | None, current: float | None) -> float | None:
    if canary is None or current is None or current <= 0:
        return None
    return canary / current


def percent(x: float) -> str:
    return f"{x * 100:.3g}%"


def errors_over(canary: Side, bounds: Bounds) -> bool:
    """Whether the canary's errors pass what `max_error_rate` allows of `min_requests` (or of its requests, once it
    has more)."""
    return canary.errors > bounds.max_error_rate * max(canary.requests, bounds.min_requests)


def timed(canary: Side, current: Side, bounds: Bounds) -> bool:
    """Whether both sides have `min_requests` answered streams: their latency ratios are judged from then on."""
    return canary.timed >= bounds.min_requests and current.timed >= bounds.min_requests


def breaches(canary: Side, current: Side, bounds: Bounds) -> dict[str, bool]:
    """Which bounds the canary is past now, as `judge` reads them: `error_rate`, `ttft`, `tpot` (what the
    front doors draw in red)."""
    judged = timed(canary, current, bounds)
    over = {"error_rate": errors_over(canary, bounds)}
    for what, bound in (("ttft", bounds.max_ttft_ratio), ("tpot", bounds.max_tpot_ratio)):
        r = ratio(getattr(canary, f"{what}_p50"), getattr(current, f"{what}_p50"))
        over[what] = judged and r is not None and r > bound
    return over


def judge(canary: Side, current: Side, bounds: Bounds, elapsed: float, watch: float) -> Verdict:
    """The verdict on the canary now, `elapsed` seconds into a window of `watch`."""
    if errors_over(canary, bounds):
        return Verdict(roll_back=True, why=(
            f"the canary's errors: {canary.errors} of {canary.requests} requests ({percent(canary.error_rate)}), "
            f"over the bound of {percent(bounds.max_error_rate)}"
            + (f" of at least {bounds.min_requests}" if canary.requests < bounds.min_requests else "")
            + f" (the current replicas: {current.errors} of {current.requests})"))
    judged = timed(canary, current, bounds)
    checks = (("time to first token", "ttft_p50", bounds.max_ttft_ratio),
              ("time per output token", "tpot_p50", bounds.max_tpot_ratio))
    for what, field, bound in checks:
        r = ratio(getattr(canary, field), getattr(current, field))
        if judged and r is not None and r > bound:
            return Verdict(roll_back=True, why=(
                f"the canary's median {what}: {getattr(canary, field):.0f} ms against {getattr(current, field):.0f}"
                f" ms, {r:.2f}x, over the bound of {bound:g}x"))
    if elapsed < watch:
        return Verdict(why=f"watching: {int(watch - elapsed)}s of the window left")
    if canary.requests < bounds.min_requests:
        return Verdict(why=f"waiting for requests: the canary has {canary.requests} of {bounds.min_requests}")
    held = [f"errors {canary.errors} of {canary.requests} ({percent(canary.error_rate)})"]
    for what, field, _bound in checks:
        r = ratio(getattr(canary, field), getattr(current, field))
        if judged and r is not None:
            held.append(f"median {what} {r:.2f}x the current replicas'")
    return Verdict(promote=True, why=f"the canary held every bound over the window: {', '.join(held)}")
