"""The Usage page's plots, drawn on the server as SVG (no chart library, no CDN): tokens per key and per model
over time, stacked; requests and errors; each key's spend against its budget. Pure: the usage's rows in
(gateway.operations.usage_report's, per hour or day), SVG out, so a test reads where each value landed.

Each SVG has a viewBox and no size of its own: it takes its card's width, on a phone too (dashboard.css)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape

from django.utils.safestring import SafeString, mark_safe

from dashboard.charts import nice_top
from ground.units import about

HOURS, DAYS = 48, 30  # what the page shows: the last 48 hours by hour, the last 30 days by day
WIDTH, HEIGHT = 400, 180
LEFT, RIGHT, TOP, BOTTOM = 42, 6, 8, 24  # the plot's margins: the y axis' labels on the left, the x axis' below
PALETTE = ("#1f5fbf", "#137a4b", "#d97706", "#7a3cc4", "#0e7490", "#c2410c", "#8a6100", "#98a2b3")
MOST = 8  # series on a plot: past it, the smallest are summed as OTHERS (in the palette's last, grey)
OTHERS = "(the rest)"  # no key or model is named with parentheses
REQUESTS, ERRORS = "#1f5fbf", "#b42318"
BAR_ROW = 40  # the budget plot: a key's line of text and its bar


@dataclass(frozen=True)
class Window:
    """The buckets a plot shows, oldest first: the starts of the last HOURS hours or DAYS days (UTC)."""

    by: str  # hour or day
    starts: tuple[datetime, ...]

    @property
    def since(self) -> datetime:
        return self.starts[0]

    def label(self, start: datetime) -> str:
        if self.by == "day" or start.hour == 0:
            return f"{start:%b} {start.day}"
        return f"{start:%H:%M}"

    def labelled(self) -> list[int]:
        """The buckets whose start is written under the x axis: midnight and noon by hour, every 7th day
        back from today by day."""
        if self.by == "day":
            return [i for i in range(len(self.starts)) if (len(self.starts) - 1 - i) % 7 == 0]
        return [i for i, start in enumerate(self.starts) if start.hour % 12 == 0]


def window(by: str, now: datetime) -> Window:
    now = now.astimezone(UTC)
    if by == "day":
        today = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return Window("day", tuple(today - timedelta(days=DAYS - 1 - i) for i in range(DAYS)))
    hour = now.replace(minute=0, second=0, microsecond=0)
    return Window("hour", tuple(hour - timedelta(hours=HOURS - 1 - i) for i in range(HOURS)))


# a usage row: key, model, hour (its bucket's start), requests, prompt and completion tokens, resumed prompt tokens
Row = Mapping[str, object]


def tokens(row: Row) -> float:
    return float(row["prompt_tokens"]) + float(row["completion_tokens"])  # type: ignore[arg-type]


def resumed(row: Row) -> float:
    """The prompt tokens of its answers' resumes on other replicas: the fleet's, not in the key's tokens."""
    return float(row.get("resumed_prompt_tokens") or 0)  # type: ignore[arg-type]


def series(rows: Iterable[Row], name: Callable[[Row], str], value: Callable[[Row], float],
           starts: tuple[datetime, ...]) -> dict[str, list[float]]:
    """Each name's values per bucket (rows outside the buckets left out), the largest total first; past MOST
    names, the smallest summed as OTHERS, last."""
    index = {start: i for i, start in enumerate(starts)}
    found: dict[str, list[float]] = {}
    for row in rows:
        i = index.get(row["hour"])  # type: ignore[call-overload]
        if i is not None:
            found.setdefault(name(row), [0.0] * len(starts))[i] += value(row)
    ordered = sorted(found.items(), key=lambda item: (-sum(item[1]), item[0]))
    if len(ordered) > MOST:
        rest = [sum(column) for column in zip(*(values for _, values in ordered[MOST - 1:]), strict=True)]
        ordered = [*ordered[:MOST - 1], (OTHERS, rest)]
    return dict(ordered)


def stack(values: Mapping[str, list[float]]) -> dict[str, list[tuple[float, float]]]:
    """Each series' (bottom, top) per bucket, stacked in order: the first at the bottom."""
    base: list[float] = []
    stacked = {}
    for name, own in values.items():
        base = base or [0.0] * len(own)
        stacked[name] = [(base[i], base[i] + v) for i, v in enumerate(own)]
        base = [b + v for b, v in zip(base, own, strict=True)]
    return stacked


@dataclass(frozen=True)
class Legend:
    name: str
    colour: str
    total: str


@dataclass(frozen=True)
class Plot:
    """One card of the page: its title, the SVG and its legend."""

    name: str  # for the page's tests: tokens-by-key, tokens-by-model, requests, budgets
    title: str
    svg: SafeString
    legend: tuple[Legend, ...]


def figure(value: float) -> str:
    """An axis' figure: 1.2M, 500K, 40, 0.5."""
    if value >= 1000:
        return about(round(value))
    return str(int(value)) if value == int(value) else f"{value:g}"


class Frame:
    """A plot's axes: bucket i's bar and a value's height, in the viewBox's units."""

    def __init__(self, window: Window, top: float):
        self.window, self.top = window, top
        self.slot = (WIDTH - LEFT - RIGHT) / len(window.starts)

    def x(self, i: int) -> float:
        return round(LEFT + i * self.slot + self.slot * 0.1, 2)

    @property
    def bar(self) -> float:
        return round(self.slot * 0.8, 2)

    def y(self, value: float) -> float:
        return round(HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * value / self.top, 2)

    def axes(self) -> list[str]:
        drawn = []
        for value in (0.0, self.top / 2, self.top):
            y = self.y(value)
            drawn.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y}" y2="{y}"/>'
                         f'<text class="y" x="{LEFT - 4}" y="{y + 4}" text-anchor="end">{figure(value)}</text>')
        for i in self.window.labelled():
            x = round(LEFT + (i + 0.5) * self.slot, 2)
            anchor = "end" if x > WIDTH - 28 else "middle"
            drawn.append(f'<text class="x" x="{x}" y="{HEIGHT - 5}" text-anchor="{anchor}">'
                         f'{self.window.label(self.window.starts[i])}</text>')
        return drawn

    def rect(self, i: int, low: float, high: float, colour: str, said: str, inset: float = 0.0) -> str:
        start = self.window.starts[i]
        return (f'<rect x="{round(self.x(i) + inset, 2)}" y="{self.y(high)}" width="{round(self.bar - 2 * inset, 2)}" '
                f'height="{round(self.y(low) - self.y(high), 2)}" fill="{colour}" data-at="{start:%Y-%m-%dT%H:%M}Z" '
                f'data-value="{figure(high - low)}"><title>{escape(said)}, {self.window.label(start)}: '
                f'{figure(high - low)}</title></rect>')


def _svg(label: str, parts: list[str], height: int = HEIGHT) -> SafeString:
    body = "".join(parts)
    return mark_safe(f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(label)}">{body}</svg>')


def stacked_plot(name: str, title: str, window: Window, values: Mapping[str, list[float]]) -> Plot:
    """Bars per bucket, one segment per series stacked in order (the largest at the bottom)."""
    colours = {n: PALETTE[-1] if n == OTHERS else PALETTE[i % (len(PALETTE) - 1)] for i, n in enumerate(values)}
    stacked = stack(values)
    peak = max((segments[-1][1] for segments in zip(*stacked.values(), strict=True)), default=0.0)
    frame = Frame(window, nice_top(peak))
    parts = frame.axes()
    for n, segments in stacked.items():
        parts += [frame.rect(i, low, high, colours[n], n) for i, (low, high) in enumerate(segments) if high > low]
    legend = tuple(Legend(n, colours[n], about(round(sum(v)))) for n, v in values.items())
    return Plot(name, title, _svg(f"{title}, per {window.by}", parts), legend)


def requests_plot(window: Window, requests: list[float], errors: list[float]) -> Plot:
    """Requests per bucket as bars, the errors in front of them in red, from the same baseline."""
    frame = Frame(window, nice_top(max([*requests, *errors], default=0.0)))
    parts = frame.axes()
    parts += [frame.rect(i, 0, v, REQUESTS, "requests") for i, v in enumerate(requests) if v]
    parts += [frame.rect(i, 0, v, ERRORS, "errors", inset=frame.bar / 5) for i, v in enumerate(errors) if v]
    legend = (Legend("requests", REQUESTS, about(round(sum(requests)))),
              Legend("errors (4xx, 5xx)", ERRORS, about(round(sum(errors)))))
    return Plot("requests", "Requests and errors", _svg(f"Requests and errors, per {window.by}", parts), legend)


@dataclass(frozen=True)
class Budget:
    key: str
    spent: int
    tokens: int
    period: str  # day, week or month
    resets_at: datetime


def budgets_plot(budgets: list[Budget]) -> Plot | None:
    """A bar per key with a budget: what it spent this period of its budget; red once it is spent."""
    if not budgets:
        return None
    width = WIDTH - 2
    parts = []
    for row, budget in enumerate(budgets):
        y = row * BAR_ROW
        share = min(budget.spent / budget.tokens, 1.0)
        said = (f"{budget.key}: {about(budget.spent)} of {about(budget.tokens)} this {budget.period} "
                f"({round(100 * budget.spent / budget.tokens)}%)")
        parts.append(f'<text class="name" x="1" y="{y + 15}">{escape(said)}</text>'
                     f'<rect class="track" x="1" y="{y + 22}" width="{width}" height="12" rx="6" fill="#e4e7ec"/>'
                     f'<rect x="1" y="{y + 22}" width="{round(width * share, 2)}" height="12" rx="6" '
                     f'fill="{ERRORS if share >= 1 else REQUESTS}" data-key="{escape(budget.key)}">'
                     f'<title>{escape(said)}, resets {budget.resets_at:%Y-%m-%d %H:%M} UTC</title></rect>')
    svg = _svg("Spend against each key's budget, this period", parts, height=BAR_ROW * len(budgets))
    return Plot("budgets", "Spend of each key's budget, this period", svg, ())


def usage_plots(window: Window, rows: Sequence[Row], errors: Mapping[datetime, int], budgets: list[Budget]) -> list[Plot]:
    """The page's plots from the usage's rows in the window and the errors per bucket."""
    requests = series(rows, lambda r: "requests", lambda r: float(r["requests"]), window.starts)  # type: ignore[arg-type]
    plots = [
        stacked_plot("tokens-by-key", "Tokens per key", window, series(rows, lambda r: str(r["key"]), tokens, window.starts)),
        stacked_plot("tokens-by-model", "Tokens per model", window,
                     series(rows, lambda r: str(r["model"]), tokens, window.starts)),
        requests_plot(window, requests.get("requests", [0.0] * len(window.starts)),
                      [float(errors.get(start, 0)) for start in window.starts]),
    ]
    fleets = series(rows, lambda r: str(r["model"]), resumed, window.starts)
    if any(any(v) for v in fleets.values()):  # shown only where answers were resumed
        plots.append(stacked_plot("resumed-by-model", "Prompt tokens of resumes per model (the fleet's cost, not the "
                                  "keys')", window, fleets))
    spend = budgets_plot(budgets)
    return [*plots, spend] if spend else plots
