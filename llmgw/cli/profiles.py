"""`ctl profiles`, `ctl profile add|set|remove`, `ctl engines` and `ctl engine add|set`: what engines run with."""

from __future__ import annotations

import shlex
from collections import Counter

from llmgw.cli.client import CliError
from llmgw.cli.output import as_json, table


def _profile_values(o) -> dict:
    values = {}
    for key in ("context_size", "threads", "gpu_layers", "batch_size", "parallel"):
        if o.get(key) is not None:
            values[key] = o[key]
    if o.get("extra") is not None:
        try:
            values["extra_args"] = shlex.split(o["extra"])
        except ValueError as exc:
            raise CliError(f"--extra: {exc}") from None
    return values


def _used_by(api, field: str) -> Counter:
    """How many models use each profile or engine."""
    return Counter(m[field] for m in api.rows("models/"))


def profiles_list(o, out):
    api = o["api"]
    profiles = api.rows("profiles/")
    if o.get("json"):
        return as_json(profiles, out)
    used = _used_by(api, "profile")
    rows = [
        [p["name"], p["context_size"], p["threads"] or "auto", p["gpu_layers"] if p["gpu_layers"] is not None else "-",
         p["batch_size"] or "-", p["parallel"], " ".join(p["extra_args"]) or "-", used[p["name"]]]
        for p in profiles
    ]
    table(["NAME", "CONTEXT", "THREADS", "GPU LAYERS", "BATCH", "PARALLEL", "EXTRA", "MODELS"], rows, out)


def profile_add(o, out):
    profile = o["api"].post("profiles/", {"name": o["name"], **_profile_values(o)}, doing="add profiles")
    out.write(f"profile {profile['name']} added\n")


def profile_set(o, out):
    values = _profile_values(o)
    if not values:
        raise CliError("nothing to change: give --context-size, --threads, --gpu-layers, --batch-size, --parallel or --extra")
    profile = o["api"].patch(f"profiles/{o['name']}/", values, doing="change profiles")
    out.write(f"profile {profile['name']} edited; running replicas keep their arguments until restarted\n")


def profile_remove(o, out):
    o["api"].delete(f"profiles/{o['name']}/", doing="remove profiles")
    out.write(f"profile {o['name']} removed\n")


def engines_list(o, out):
    api = o["api"]
    engines = api.rows("engines/")
    if o.get("json"):
        return as_json(engines, out)
    used = _used_by(api, "engine")
    rows = [[e["name"], e["kind"], e["version"] or "-", e["device"], _serves(e),
             e["binary"] or e["command"] or "(on PATH)", used[e["name"]]] for e in engines]
    table(["NAME", "KIND", "VERSION", "DEVICE", "SERVES", "BINARY / COMMAND", "MODELS"], rows, out)


def _serves(engine: dict) -> str:
    if engine["serves"]:
        return ",".join(engine["serves"])
    return "(any)" if engine["kind"] == "command" else "(profile)"


def engine_add(o, out):
    body = {"name": o["name"], "kind": o["kind"], "version": o["version"], "device": o["device"],
            "binary": o["binary"], "command": o["command"], "serves": o.get("serves") or []}
    engine = o["api"].post("engines/", body, doing="add engines")
    out.write(f"engine {engine['name']} ({engine['kind']}, {engine['device']}) added, serving {_serves(engine)}\n")


def engine_set(o, out):
    if o.get("serves") is None:
        raise CliError("nothing to change: give --serves")
    engine = o["api"].patch(f"engines/{o['name']}/", {"serves": o["serves"]}, doing="change engines")
    out.write(f"engine {engine['name']} serves {_serves(engine)}\n")
