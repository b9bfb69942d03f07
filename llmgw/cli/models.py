"""`ctl models` and `ctl model add|set|remove`: what to serve."""

from __future__ import annotations

from ground.confirmation import needs_confirmation
from ground.units import format_age, format_duration
from llmgw.cli.args import UNSET, parse_size_arg
from llmgw.cli.client import CliError
from llmgw.cli.output import age, as_json, moment, now, size, table


def models_list(o, out):
    models = o["api"].rows("models/")
    if o.get("json"):
        return as_json(models, out)
    at = now()
    rows = []
    for m in models:
        scaling = m["scaling"]
        replicas = scaling["replicas_text"]  # the domain's one figure (cluster.queries.scaling_shown)
        idle = moment(scaling["idle_at"])
        rows.append(
            [m["name"], m["engine"], m["profile"], ",".join(m["capabilities"]), m["routing"], _resuming(m),
             scaling["mode"], replicas, *_queue_columns(m.get("queue")),
             age(scaling["last_request_at"], at) + " ago" if scaling["last_request_at"] else "-",
             ("in " + format_age((idle - at).total_seconds())) if idle and idle > at else ("now" if idle else "-"),
             size(m["memory_bytes"]), ",".join(m["aliases"]) or "-",
             "removing" if m["removing"] else m["placement_note"]]
        )
    table(["NAME", "ENGINE", "PROFILE", "SERVES", "ROUTING", "RESUME", "MODE", "READY/WANT", "WAITING", "LONGEST WAIT",
           "LAST REQUEST", "IDLE", "MEMORY", "ALIASES", "NOTE"], rows, out)


def _resuming(model: dict) -> str:
    """RESUME: how often one answer may be resumed on another replica when its engine fails, and how long a
    streaming engine may stay silent before it counts as failed: `2, idle 30s`; `off, idle 30s`."""
    limit = model.get("resume_limit")
    idle = model.get("stream_idle_timeout_seconds")
    if limit is None or idle is None:  # a server from before issue 38
        return "-"
    return f"{limit or 'off'}, idle {format_duration(idle)}"


def _queue_columns(queue: dict | None) -> tuple[str, str]:
    """WAITING and LONGEST WAIT: the requests waiting for a slot (`-`: none; `?`: unknown, Redis away) and the
    oldest's wait, e.g. 4.2s."""
    queue = queue or {}
    waiting = queue.get("waiting")
    if waiting is None:
        return "?", "-"
    if not waiting:
        return "-", "-"
    longest = queue.get("longest_wait_seconds")
    return str(waiting), "-" if longest is None else f"{longest:.1f}s"


SCALING_OPTIONS = {"min_replicas": "min_replicas", "max_replicas": "max_replicas", "target_inflight": "target_inflight",
                   "idle_after": "idle_after_seconds", "scale_down_delay": "scale_down_delay_seconds"}


def _scaling_values(o) -> dict:
    return {field: o[option] for option, field in SCALING_OPTIONS.items() if o.get(option) is not None}


def _confirmed(o, current: dict | None, values: dict) -> None:
    """A change that adds many replicas at once (ground.confirmation) goes ahead only with --yes."""
    why = needs_confirmation(current, values)
    if why and not o.get("yes"):
        raise CliError(f"{why}: pass --yes if you mean it")


def model_add(o, out):
    body = {
        "name": o["name"], "file": o["file"], "engine": o["engine"], "profile": o["profile"],
        "replicas": o["replicas"], "nodes": o["nodes"] or [], "wait_seconds": o["wait"],
        "max_tokens": o["max_tokens"], "max_logprobs": o["max_logprobs"], "max_choices": o["max_choices"],
        "routing": o["routing"], "aliases": o.get("aliases") or [], **_scaling_values(o),
        "queue_limit": o.get("queue_limit"), "max_wait_seconds": o.get("max_wait"),
        "resume_limit": o.get("resume_limit"), "stream_idle_timeout_seconds": o.get("stream_idle_timeout"),
    }
    if o["memory"]:
        body["memory_bytes"] = parse_size_arg(o["memory"])
    _confirmed(o, None, body)
    model = o["api"].post("models/", body, doing="add models")
    out.write(
        f"model {model['name']} added: {model['file']['name']} on {model['engine']}, {size(model['memory_bytes'])} "
        f"each; {model['scaling_text']}; {_answers_to(model)}watch with: llmgw ctl replicas --model {model['name']}\n"
    )


def _answers_to(model: dict) -> str:
    return f"also answers to {', '.join(model['aliases'])}; " if model["aliases"] else ""


def model_set(o, out):
    values = {
        k: o[k] for k in ("replicas", "engine", "profile", "file", "nodes", "routing", "aliases")
        if o.get(k) is not None
    }
    if o.get("wait") is not None:
        values["wait_seconds"] = o["wait"]
    if o.get("memory") is not None:
        values["memory_bytes"] = 0 if o["memory"] in ("auto", "0") else parse_size_arg(o["memory"])
    for cap in ("max_tokens", "max_logprobs", "max_choices"):  # None is a value here: no cap
        if o.get(cap, UNSET) is not UNSET:
            values[cap] = o[cap]
    for option, field in (("queue_limit", "queue_limit"), ("max_wait", "max_wait_seconds")):
        if o.get(option, UNSET) is not UNSET:  # None is a value here: the cluster's default
            values[field] = o[option]
    for option, field in (("resume_limit", "resume_limit"), ("stream_idle_timeout", "stream_idle_timeout_seconds")):
        if o.get(option) is not None:
            values[field] = o[option]
    values.update(_scaling_values(o))
    if not values:
        raise CliError(
            "nothing to change: give --replicas, --min-replicas, --max-replicas, --target-inflight, --idle-after, "
            "--scale-down-delay, --profile, --engine, --file, --memory, --nodes, --wait, --max-tokens, --max-logprobs, "
            "--max-choices, --routing, --alias, --queue-limit, --max-wait, --resume-limit or --stream-idle-timeout"
        )
    if any(values.get(k) is not None for k in ("replicas", "min_replicas", "max_replicas")) and not o.get("yes"):
        _confirmed(o, o["api"].get(f"models/{o['name']}/"), values)
    model = o["api"].patch(f"models/{o['name']}/", values, doing="change models")
    out.write(f"model {model['name']}: {model['scaling_text']}, profile {model['profile']}, engine {model['engine']}, "
              f"routing {model['routing']}, aliases {', '.join(model['aliases']) or 'none'}, "
              f"resume {_resuming(model)}\n")


def model_remove(o, out):
    o["api"].delete(f"models/{o['name']}/", doing="remove models")
    out.write(f"model {o['name']} removed: its replicas are stopping; watch with: llmgw ctl replicas\n")
