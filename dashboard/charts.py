"""The overview's charts, drawn on the server as SVG (no chart library, no CDN): the last hour of the gateway's
traffic per minute, from the counters every web process adds to in Redis (gateway.accounting). And a rollout's
gauges: a canary's figure against its bound, as a bar."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.accounting import TrafficMinute

WIDTH, HEIGHT = 360, 90


def nice_top(peak: float) -> float:
    """The y axis' top: the peak rounded up to 1, 2 or 5 times a power of ten, at least 1."""
    if peak <= 1:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(peak))
    return float(next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= peak))


@dataclass
class Chart:
    title: str
    unit: str
    values: list[float]
    colour: str

    @property
    def top(self) -> float:
        return nice_top(max(self.values, default=0))

    def _xy(self) -> list[tuple[float, float]]:
        n = len(self.values)
        top = self.top
        return [(round(WIDTH * i / max(n - 1, 1), 1), round(HEIGHT - HEIGHT * v / top, 1)) for i, v in enumerate(self.values)]

    @property
    def line(self) -> str:
        return " ".join(f"{x},{y}" for x, y in self._xy())

    @property
    def area(self) -> str:
        points = self._xy()
        if not points:
            return ""
        return f"M0,{HEIGHT} L" + " L".join(f"{x},{y}" for x, y in points) + f" L{WIDTH},{HEIGHT} Z"

    @property
    def now(self) -> str:
        return _fmt(self.values[-1] if self.values else 0)

    @property
    def peak(self) -> str:
        return _fmt(max(self.values, default=0))

    @property
    def top_label(self) -> str:
        return _fmt(self.top)

    width = WIDTH
    height = HEIGHT


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}".rstrip("0").rstrip(".") if v else "0"


def traffic_charts(rows: list[TrafficMinute]) -> list[Chart]:
    """Requests per second, tokens per second and the error rate (5xx answers, %) per minute."""
    return [
        Chart("Requests per second", "req/s", [r["requests"] / 60 for r in rows], "#1f5fbf"),
        Chart("Tokens per second", "tok/s", [r["tokens"] / 60 for r in rows], "#137a4b"),
        Chart("Error rate (5xx)", "%", [100 * r["errors"] / r["requests"] if r["requests"] else 0 for r in rows], "#b42318"),
    ]


@dataclass
class Gauge:
    """A figure against its bound, as a bar whose middle mark is the bound: a figure past the bound runs past the
    mark, and is red when the domain says the bound is breached (`breached`, as the judge reads it). `value`
    None: no figure yet."""

    label: str
    value: float | None
    bound: float
    breached: bool
    percent: bool = False  # a share, shown as a percentage (else a ratio: 1.20x)

    @property
    def width(self) -> float:
        """The bar's length, % of the whole: the bound at 50, twice the bound and more at 100."""
        if not self.value:
            return 0.0
        if self.bound <= 0:
            return 100.0
        return round(min(100.0, 50 * self.value / self.bound), 1)

    def _fmt(self, v: float) -> str:
        return f"{v * 100:.3g}%" if self.percent else f"{v:.2f}x"

    @property
    def shown(self) -> str:
        return "—" if self.value is None else self._fmt(self.value)

    @property
    def bound_shown(self) -> str:
        return f"{self.bound * 100:g}%" if self.percent else f"{self.bound:g}x"
