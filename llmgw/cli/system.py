"""`llmgw status`, `stop`, `start`, `restart` and `service`: the whole system."""

from __future__ import annotations

from django.core.management.base import CommandError

from cluster import operations, system
from cluster.models import Replica
from llmgw.cli.args import CLI_ACTOR
from llmgw.cli.output import as_json
from llmgw.cli.service import service

def status(o, out):
    s = operations.cluster_status()
    if o.get("json"):
        return as_json(s, out)
    stopped = s["serving"] == "stopped"
    out.write(
        "llmgw: STOPPED (every model held at zero replicas; /v1/ answers 503 until `llmgw start`)\n"
        if stopped
        else "llmgw: serving\n"
    )
    out.write(f"nodes: {s['nodes']['connected']} connected of {s['nodes']['total']}\n")
    states = s["replicas"]
    order = [st for st in Replica.State.values if st in states]
    shown = ", ".join(f"{states[st]} {st}" for st in order) or "none"
    out.write(f"replicas: {shown}\n")
    out.write(f"models: {len(s['models'])}\n")
    for m in s["models"]:
        note = " (removing)" if m["removing"] else (f" - {m['placement_note']}" if m["placement_note"] else "")
        out.write(f"  {m['name']}: {m['ready']}/{m['replicas']} ready{note}\n")


def system_stop(o, out):
    operations.stop_serving(CLI_ACTOR)
    out.write("llmgw stopped: every model goes to zero replicas and /v1/ answers 503 until `llmgw start`\n")


def system_start(o, out):
    operations.start_serving(CLI_ACTOR)
    out.write("llmgw started: models are placed again; watch with: llmgw ctl replicas\n")


def service_cmd(o, out):
    service(o, out)


def system_restart(o, out):
    out.write("restarting llmgw: every agent, then web, beat and worker processes; engines keep serving\n")
    out.flush()

    def report(line: str) -> None:
        out.write(f"  {line}\n")
        out.flush()

    result = system.restart_system(CLI_ACTOR, report, agent_timeout=o["timeout"], process_timeout=o["timeout"])
    if "timeout" in {*result["agents"].values(), *result["processes"].values()}:
        raise CommandError("some parts did not come back; see above and `llmgw ctl events`")
