"""`ctl rollout start|status|promote|abort`: a model change tried on canary replicas first (issue 39), promoted or
rolled back by llmgw on the canary's errors and latency against the current replicas'. What is shown is the API's
rollout (cluster.queries.rollout_shown)."""

from __future__ import annotations

from ground.units import format_duration
from llmgw.cli.args import parse_size_arg
from llmgw.cli.client import CliError
from llmgw.cli.output import age, as_json, moment, now, table

CHANGES = ("file", "profile", "engine")
NUMBERS = {"canary": "canary", "traffic": "traffic", "shadow": "shadow", "watch": "watch_seconds",
           "min_requests": "min_requests", "max_error_rate": "max_error_rate", "max_ttft_ratio": "max_ttft_ratio",
           "max_tpot_ratio": "max_tpot_ratio"}


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.3g}%"


def _path(name: str) -> str:
    return f"models/{name}/rollout/"


def rollout_start(o, out):
    body = {k: o[k] for k in CHANGES if o.get(k) is not None}
    if not body:
        raise CliError(f"nothing to roll out: give --file, --profile or --engine for model {o['name']}'s canary")
    body.update({field: o[option] for option, field in NUMBERS.items() if o.get(option) is not None})
    if o.get("memory") is not None:
        body["memory_bytes"] = 0 if o["memory"] in ("auto", "0") else parse_size_arg(o["memory"])
    r = o["api"].post(_path(o["name"]), body, doing="start rollouts")
    out.write(f"rollout of model {r['model']} started: {r['change_text']}; {_takes(r)}; watch with: llmgw ctl "
              f"rollout status {r['model']}\n")


def _takes(r: dict) -> str:
    """`1 canary replica(s) take 10% of new conversations` (and the shadow's copies, if any)."""
    shadow = r.get("shadow") or 0  # a server from before the shadow has none
    return (f"{r['canary']} canary replica(s) take {percent(r['traffic'])} of new conversations"
            + (f" and a copy of {percent(shadow)} of the others' requests" if shadow else ""))


def rollout_promote(o, out):
    r = o["api"].post(_path(o["name"]) + "promote/", doing="promote rollouts")
    out.write(f"rollout of model {r['model']} promoting: every replica is replaced with {r['change_text']}, one at a "
              f"time; watch with: llmgw ctl rollout status {r['model']}\n")


def rollout_abort(o, out):
    r = o["api"].post(_path(o["name"]) + "abort/", doing="abort rollouts")
    if r["state"] == "rolling_back":  # it was promoting
        out.write(f"rollout of model {r['model']} rolling back: the model goes back to its settings before, its "
                  "replicas on the new ones replaced one at a time\n")
    else:
        out.write(f"rollout of model {r['model']} aborted: its canary drains and stops; the model runs as it did\n")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def _ratio(canary: float | None, current: float | None) -> str:
    if canary is None or current is None or current <= 0:
        return "-"
    return f"{canary / current:.2f}x"


def figures_table(r: dict, out) -> None:
    """Both sides' figures side by side: CANARY | CURRENT | RATIO / BOUND."""
    canary, current = r["figures"]["canary"] or {}, r["figures"]["current"] or {}

    def row(label: str, field: str, shown, bound: str = "") -> list:
        a, b = canary.get(field), current.get(field)
        ratio = _ratio(a, b) if field.startswith(("ttft", "tpot")) else ""
        return [label, shown(a), shown(b), " / ".join(x for x in (ratio, bound) if x) or "-"]

    count = lambda x: "-" if x is None else str(x)  # noqa: E731
    table(["", "CANARY", "CURRENT", "RATIO / BOUND"], [
        row("requests", "requests", count, f"at least {r['min_requests']}"),
        row("errors", "errors", count),
        row("error rate", "error_rate", percent, f"at most {percent(r['max_error_rate'])}"),
        row("TTFT p50", "ttft_p50", _ms, f"at most {r['max_ttft_ratio']:g}x"),
        row("TTFT p99", "ttft_p99", _ms),
        row("TPOT p50", "tpot_p50", _ms, f"at most {r['max_tpot_ratio']:g}x"),
        row("TPOT p99", "tpot_p99", _ms),
    ], out)


def _replicas(side: list[dict]) -> str:
    return ", ".join(f"{x['name']} ({x['state']}{' on ' + x['node'] if x['node'] else ''})" for x in side) or "none"


def _window(r: dict) -> str:
    if r["window_left_seconds"] is not None:
        return f"{format_duration(r['window_left_seconds'])} left of {format_duration(r['watch_seconds'])}"
    if r["watching_since"] is None and r["state"] == "watching":
        return f"{format_duration(r['watch_seconds'])}, from the first canary replica ready (none yet)"
    return f"{format_duration(r['watch_seconds'])} (over)"


def rollout_status(o, out):
    r = o["api"].get(_path(o["name"]))
    if o.get("json"):
        return as_json(r, out)
    at = now()
    started = moment(r["started_at"])
    lines = [
        f"rollout of model {r['model']}: {r['state_text']}",
        f"change: {r['change_text']}",
        f"started by {r['actor']} at {started:%Y-%m-%d %H:%M:%S} UTC ({age(started, at)} ago)"
        + (f", ended at {moment(r['ended_at']):%Y-%m-%d %H:%M:%S} UTC" if r["ended_at"] else ""),
        f"canary: {_takes(r)}",
        f"window: {_window(r)}",
    ]
    if r["reason"]:
        lines.append(f"reason: {r['reason']}")
    if r["verdict"] and r["verdict"] != r["reason"]:
        lines.append(f"verdict so far: {r['verdict']}")
    if r["note"]:
        lines.append(f"note: {r['note']}")
    lines.append(f"canary replicas: {_replicas(r['replicas']['canary'])}")
    lines.append(f"current replicas: {_replicas(r['replicas']['current'])}")
    out.write("\n".join(lines) + "\n\n")
    figures_table(r, out)
