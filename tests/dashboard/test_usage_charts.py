"""The Usage page's plots (dashboard/usage_charts.py): the buckets, the series and their stacking, and where each
value lands in the SVG."""

import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

from dashboard import usage_charts as uc

NOW = datetime(2026, 12, 5, 21, 40, tzinfo=UTC)


def rects(plot: uc.Plot) -> list[dict[str, str]]:
    svg = ET.fromstring(str(plot.svg))
    assert str(svg.get("viewBox")).startswith(f"0 0 {uc.WIDTH} ") and svg.get("width") is None  # it takes the card's
    return [r.attrib for r in svg.iter("rect")]


def texts(plot: uc.Plot) -> list[str]:
    return [t.text or "" for t in ET.fromstring(str(plot.svg)).iter("text")]


def test_the_windows_are_the_last_48_hours_and_the_last_30_days():
    hours = uc.window("hour", NOW)
    assert len(hours.starts) == 48 and hours.starts[-1] == NOW.replace(minute=0)
    assert hours.since == NOW.replace(minute=0) - timedelta(hours=47)
    assert [hours.label(hours.starts[i]) for i in hours.labelled()] == ["Dec 4", "12:00", "Dec 5", "12:00"]
    days = uc.window("day", NOW)
    assert len(days.starts) == 30 and days.starts[-1] == datetime(2026, 12, 5, tzinfo=UTC)
    assert [days.label(days.starts[i]) for i in days.labelled()] == ["Nov 7", "Nov 14", "Nov 21", "Nov 28", "Dec 5"]


def test_series_put_each_row_in_its_bucket_largest_total_first_the_rest_summed():
    starts = uc.window("hour", NOW).starts[-3:]
    rows = [{"key": "a", "hour": starts[0], "prompt_tokens": 1, "completion_tokens": 1},
            {"key": "b", "hour": starts[2], "prompt_tokens": 5, "completion_tokens": 0},
            {"key": "a", "hour": starts[2], "prompt_tokens": 1, "completion_tokens": 0},
            {"key": "c", "hour": starts[0] - timedelta(hours=1), "prompt_tokens": 9, "completion_tokens": 9}]  # before
    assert uc.series(rows, lambda r: r["key"], uc.tokens, starts) == {"b": [0, 0, 5], "a": [2, 0, 1]}
    many = [{"key": f"k{i}", "hour": starts[1], "prompt_tokens": 10 + i, "completion_tokens": 0} for i in range(10)]
    shown = uc.series(many, lambda r: r["key"], uc.tokens, starts)
    assert list(shown)[:2] == ["k9", "k8"] and len(shown) == uc.MOST
    assert shown[uc.OTHERS] == [0, 10 + 11 + 12, 0]  # the three smallest


def test_stacking_puts_each_series_on_the_ones_before_it():
    assert uc.stack({"a": [1, 0, 2], "b": [3, 1, 0]}) == {"a": [(0, 1), (0, 0), (0, 2)], "b": [(1, 4), (0, 1), (2, 2)]}
    assert uc.stack({}) == {}


def test_a_stacked_plots_bars_land_where_their_values_are():
    window = uc.window("hour", NOW)
    values = {"a": [0.0] * 47 + [30.0], "b": [0.0] * 46 + [10.0, 20.0]}
    plot = uc.stacked_plot("tokens-by-key", "Tokens per key", window, values)
    bars = rects(plot)
    assert [(b["data-value"], b["fill"]) for b in bars] == [("30", uc.PALETTE[0]), ("10", uc.PALETTE[1]),
                                                          ("20", uc.PALETTE[1])]
    frame = uc.Frame(window, 50.0)  # the peak, 50, is the axis' top
    a, b_before, b_last = bars
    bottom, height = uc.HEIGHT - uc.BOTTOM, uc.HEIGHT - uc.TOP - uc.BOTTOM
    assert float(a["y"]) == bottom - height * 30 / 50 and float(a["height"]) == round(height * 30 / 50, 2)
    assert float(b_last["y"]) == uc.TOP and float(b_last["y"]) + float(b_last["height"]) == float(a["y"])  # on a
    assert float(b_before["x"]) == frame.x(46) < float(a["x"]) == float(b_last["x"]) == frame.x(47)
    assert float(a["x"]) + float(a["width"]) <= uc.WIDTH - uc.RIGHT
    assert a["data-at"] == "2026-12-05T21:00Z" and "a, 21:00: 30" in str(plot.svg)
    assert ["0", "25", "50"] == texts(plot)[:3] and [(item.name, item.total) for item in plot.legend] == [
        ("a", "30"), ("b", "30")]


def test_requests_and_errors_share_the_baseline_and_names_are_escaped():
    window = uc.window("day", NOW)
    plot = uc.requests_plot(window, [0.0] * 29 + [2000.0], [0.0] * 29 + [500.0])
    requests, errors = rects(plot)
    assert (requests["fill"], errors["fill"]) == (uc.REQUESTS, uc.ERRORS)
    assert float(requests["y"]) + float(requests["height"]) == float(errors["y"]) + float(errors["height"])
    assert float(errors["height"]) == float(requests["height"]) / 4 and float(errors["width"]) < float(requests["width"])
    assert texts(plot)[:3] == ["0", "1K", "2K"]
    sneaky = uc.stacked_plot("k", "Tokens per key", window, {"<b>": [1.0] * 30})
    assert "<b>" not in str(sneaky.svg) and "&lt;b&gt;" in str(sneaky.svg)


def test_each_budget_is_a_bar_of_its_spend_red_once_spent():
    resets = datetime(2027, 1, 1, tzinfo=UTC)
    plot = uc.budgets_plot([uc.Budget("agent", 250, 1000, "month", resets), uc.Budget("team", 3000, 2000, "day", resets)])
    track, agent, _, team = rects(plot)
    assert float(agent["width"]) == round(float(track["width"]) / 4, 2) and agent["fill"] == uc.REQUESTS
    assert float(team["width"]) == float(track["width"]) and team["fill"] == uc.ERRORS
    assert texts(plot) == ["agent: 250 of 1K this month (25%)", "team: 3K of 2K this day (150%)"]
    assert uc.budgets_plot([]) is None
