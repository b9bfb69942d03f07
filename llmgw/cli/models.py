"""`ctl models` and `ctl model add|set|remove`: what to serve."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.utils import timezone

from agents.units import format_age
from cluster import operations, queries
from cluster.models import Replica
from llmgw.cli.args import CLI_ACTOR, UNSET, parse_size_arg
from llmgw.cli.output import age, as_json, size, table


def models_list(o, out):
    rows, data = [], []
    now = timezone.now()
    for m in queries.models_with_counts():
        note = "removing" if m.removing else m.placement_note
        serves = m.capabilities()
        scaling = queries.scaling_shown(m)
        ready = m.n_ready
        running = sum(getattr(m, f"n_{s}") for s in Replica.RUNNING)
        if m.autoscaled:
            replicas = f"{ready}/{scaling['wanted']} ({m.min_replicas}-{m.max_replicas})"
        else:
            replicas = f"{ready}/{m.replicas}"
        last = scaling["last_request_at"]
        idle = scaling["idle_at"]
        rows.append(
            [m.name, m.engine.name, m.profile.name, ",".join(serves), m.routing, m.mode, replicas,
             age(last, now) + " ago" if last else "-",
             ("in " + format_age((idle - now).total_seconds())) if idle and idle > now else ("now" if idle else "-"),
             size(m.memory_estimate()), note]
        )
        data.append(
            {
                "name": m.name,
                "file": m.file.sha256,
                "engine": m.engine.name,
                "profile": m.profile.name,
                "capabilities": list(serves),
                "replicas": m.replicas,
                "ready": ready,
                "running": running,
                "memory_bytes": m.memory_estimate(),
                "max_tokens": m.max_tokens,
                "routing": m.routing,
                **{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in scaling.items()},
                "removing": m.removing,
                "note": m.placement_note,
            }
        )
    if o.get("json"):
        return as_json(data, out)
    table(["NAME", "ENGINE", "PROFILE", "SERVES", "ROUTING", "MODE", "READY/WANT", "LAST REQUEST", "IDLE", "MEMORY",
           "NOTE"], rows, out)


def model_add(o, out):
    model = operations.add_model(
        o["name"],
        CLI_ACTOR,
        file=o["file"],
        engine=o["engine"],
        profile=o["profile"],
        replicas=o["replicas"],
        memory_bytes=parse_size_arg(o["memory"]) if o["memory"] else None,
        nodes=o["nodes"] or [],
        wait_seconds=o["wait"],
        max_tokens=o["max_tokens"],
        routing=o["routing"],
        **_scaling_values(o),
    )
    out.write(
        f"model {model.name} added: {model.scaling_text()} of {model.file.name} on {model.engine.name}, "
        f"{size(model.memory_estimate())} each; watch with: llmgw ctl replicas --model {model.name}\n"
    )


SCALING_OPTIONS = {"min_replicas": "min_replicas", "max_replicas": "max_replicas", "target_inflight": "target_inflight",
                   "idle_after": "idle_after_seconds", "scale_down_delay": "scale_down_delay_seconds"}


def _scaling_values(o) -> dict:
    return {field: o[option] for option, field in SCALING_OPTIONS.items() if o.get(option) is not None}


def model_set(o, out):
    values = {
        k: o[k] for k in ("replicas", "engine", "profile", "file", "nodes", "routing") if o.get(k) is not None
    }
    if o.get("wait") is not None:
        values["wait_seconds"] = o["wait"]
    if o.get("memory") is not None:
        values["memory_bytes"] = 0 if o["memory"] in ("auto", "0") else parse_size_arg(o["memory"])
    if o.get("max_tokens", UNSET) is not UNSET:
        values["max_tokens"] = o["max_tokens"]
    values.update(_scaling_values(o))
    if not values:
        raise CommandError(
            "nothing to change: give --replicas, --min-replicas, --max-replicas, --target-inflight, --idle-after, "
            "--scale-down-delay, --profile, --engine, --file, --memory, --nodes, --wait, --max-tokens or --routing"
        )
    model = operations.set_model(o["name"], CLI_ACTOR, **values)
    out.write(f"model {model.name}: {model.scaling_text()}, profile {model.profile.name}, engine {model.engine.name}, "
              f"routing {model.routing}\n")


def model_remove(o, out):
    operations.remove_model(o["name"], CLI_ACTOR)
    out.write(f"model {o['name']} removed: its replicas are stopping; watch with: llmgw ctl replicas\n")
