"""`ctl profiles`, `ctl profile add|set|remove`, `ctl engines` and `ctl engine add`: what engines run with."""

from __future__ import annotations

import shlex

from django.core.management.base import CommandError
from django.db.models import Count

from cluster import operations
from cluster.models import EngineVersion, Profile
from llmgw.cli.args import CLI_ACTOR
from llmgw.cli.output import as_json, table

def _profile_values(o) -> dict:
    values = {}
    for key in ("context_size", "threads", "gpu_layers", "batch_size", "parallel"):
        if o.get(key) is not None:
            values[key] = o[key]
    if o.get("extra") is not None:
        values["extra_args"] = shlex.split(o["extra"])
    return values


def profiles_list(o, out):
    profiles = Profile.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json([{"name": p.name, **p.args(), "models": p.used_by} for p in profiles], out)
    rows = [
        [p.name, p.context_size, p.threads or "auto", p.gpu_layers if p.gpu_layers is not None else "-",
         p.batch_size or "-", p.parallel, " ".join(p.extra_args) or "-", p.used_by]
        for p in profiles
    ]
    table(["NAME", "CONTEXT", "THREADS", "GPU LAYERS", "BATCH", "PARALLEL", "EXTRA", "MODELS"], rows, out)


def profile_add(o, out):
    profile = operations.add_profile(o["name"], CLI_ACTOR, **_profile_values(o))
    out.write(f"profile {profile.name} added\n")


def profile_set(o, out):
    values = _profile_values(o)
    if not values:
        raise CommandError("nothing to change: give --context-size, --threads, --gpu-layers, --batch-size, --parallel or --extra")
    profile = operations.set_profile(o["name"], CLI_ACTOR, **values)
    out.write(f"profile {profile.name} edited; running replicas keep their arguments until restarted\n")


def profile_remove(o, out):
    operations.remove_profile(o["name"], CLI_ACTOR)
    out.write(f"profile {o['name']} removed\n")


def engines_list(o, out):
    engines = EngineVersion.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json([{**e.spec(), "models": e.used_by} for e in engines], out)
    rows = [[e.name, e.kind, e.version or "-", e.device, e.binary or e.command or "(on PATH)", e.used_by] for e in engines]
    table(["NAME", "KIND", "VERSION", "DEVICE", "BINARY / COMMAND", "MODELS"], rows, out)


def engine_add(o, out):
    engine = operations.add_engine(
        o["name"], o["kind"], CLI_ACTOR, version=o["version"], device=o["device"], binary=o["binary"], command=o["command"]
    )
    out.write(f"engine {engine.name} ({engine.kind}, {engine.device}) added\n")
