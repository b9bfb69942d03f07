"""`ctl replicas` and `ctl restart`: the engine processes, and replacing them without an outage."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.utils import timezone

from cluster import operations, queries
from cluster.models import ClusterSettings, Model, Node, Replica
from llmgw.cli.args import CLI_ACTOR
from llmgw.cli.output import age, as_json, size, table

def replica_note(r: Replica, stale: str | None = None) -> str:
    notes = []
    if r.restart != Replica.Restart.NONE and r.state not in Replica.TERMINAL:
        notes.append(f"(restart {r.restart})")
    if stale:
        notes.append(f"(stale: {stale})")
    if r.state == Replica.State.DOWNLOADING and r.download_total:
        notes.append(f"{100 * r.download_done // r.download_total}% of {size(r.download_total)}")
    if r.reason:
        notes.append(r.reason)
    return " ".join(notes)


def replicas_list(o, out):
    cluster = ClusterSettings.load()
    qs = queries.replicas_listed(include_over=o.get("all"))
    if o.get("model"):
        if not Model.objects.filter(name=o["model"]).exists():
            raise CommandError(f"no model named {o['model']!r}")
        qs = qs.filter(model__name=o["model"])
    if o.get("node"):
        if not Node.objects.filter(name=o["node"]).exists():
            raise CommandError(f"no node named {o['node']!r}")
        qs = qs.filter(node__name=o["node"])
    now = timezone.now()
    qs = qs.order_by("model__name", "created_at")
    if o.get("json"):
        return as_json(
            [
                {
                    "name": r.name,
                    "model": r.model.name,
                    "node": r.node.name if r.node else None,
                    "state": r.state,
                    "restart": r.restart,
                    "stale": operations.staleness(r, r.model, cluster),
                    "port": r.port,
                    "pid": r.pid,
                    "reason": r.reason,
                    "created_at": r.created_at,
                }
                for r in qs
            ],
            out,
        )
    rows = [
        [r.name, r.model.name, r.node.name if r.node else "-", r.state, r.port or "-", age(r.created_at, now),
         replica_note(r, operations.staleness(r, r.model, cluster))]
        for r in qs
    ]
    table(["NAME", "MODEL", "NODE", "STATE", "PORT", "AGE", "NOTE"], rows, out)


def restart(o, out):
    queued = operations.restart_replicas(
        CLI_ACTOR, replicas=o["replicas"], models=o["model"] or [], all=o["all"], stale=o["stale"]
    )
    for name, why in queued.skipped.items():
        out.write(f"{name}: {why}; nothing to do\n")
    out.write(f"{len(queued)} replica(s) queued for restart; watch with: llmgw ctl replicas\n")
