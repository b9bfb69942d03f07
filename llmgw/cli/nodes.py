"""`llmgw node …`, `ctl nodes`, `ctl drain` and `ctl undrain`: the machines with an agent."""

from __future__ import annotations

from django.db.models import Count, Q
from django.utils import timezone

from cluster import operations, queries
from cluster.models import Node, Replica
from llmgw.cli.args import CLI_ACTOR, server_url
from llmgw.cli.output import age, as_json, size, table


def node_add(o, out):
    node, token = operations.add_node(o["name"], CLI_ACTOR)
    server = o["server"] or server_url()
    out.write(f"node {node.name} added; its token (shown once): {token}\n")
    out.write(f"on that machine (pip install llmgw, or the wheel built from the checkout), run:\n"
              f"  {operations.agent_command(server, token)}\n")


def node_remove(o, out):
    operations.remove_node(o["name"], CLI_ACTOR, force=o["force"])
    out.write(f"node {o['name']} removed\n")


def node_token(o, out):
    node, token = operations.reset_node_token(o["name"], CLI_ACTOR)
    server = o["server"] or server_url()
    out.write(f"node {node.name}: new token (shown once; the old one no longer works): {token}\n")
    out.write(f"  {operations.agent_command(server, token)}\n")


def nodes_list(o, out):
    now = timezone.now()
    nodes = Node.objects.annotate(
        running=Count("replicas", filter=Q(replicas__state__in=Replica.RUNNING)),
        left=Count("replicas", filter=~Q(replicas__state__in=Replica.TERMINAL)),
    )
    nodes = list(nodes)
    used = queries.memory_in_use(nodes)
    rows, data = [], []
    for n in nodes:
        alive = n.is_alive(now)
        status = "connected" if alive else ("never connected" if n.last_seen is None else "disconnected")
        drain = n.drain_state(n.left)
        if drain and n.drain_force and drain != "drained":
            drain += " (forced)"
        flags = [f for f, on in ((drain, bool(drain)), ("unschedulable", not n.schedulable)) if on]
        if n.drain_note and drain.startswith("blocked"):
            flags.append(f"- {n.drain_note}")
        gpu_used = used.gpus(n.pk, len(n.gpus))
        gpus = ", ".join(f"{size(u)} / {size(g['memory_bytes'])}" for u, g in zip(gpu_used, n.gpus)) or "-"
        engines = ", ".join(sorted(n.engines)) or "-"
        mem = f"{size(used.ram(n.pk))} / {size(n.memory_bytes)}"
        rows.append([n.name, status, age(n.last_seen, now), mem, gpus, n.running, engines, " ".join(flags)])
        data.append(
            {
                "name": n.name,
                "status": status,
                "last_seen": n.last_seen,
                "memory_used_bytes": used.ram(n.pk),
                "memory_bytes": n.memory_bytes,
                "gpus": [{**g, "memory_used_bytes": u} for u, g in zip(gpu_used, n.gpus)],
                "replicas": n.running,
                "engines": n.engines,
                "schedulable": n.schedulable,
                "draining": n.draining,
                "drain": n.drain_state(n.left) or None,
                "drain_force": n.drain_force,
                "drain_note": n.drain_note,
                "address": n.address,
            }
        )
    if o.get("json"):
        return as_json(data, out)
    table(["NAME", "STATUS", "SEEN", "MEMORY USED", "GPUS", "REPLICAS", "ENGINES", "FLAGS"], rows, out)


def drain(o, out):
    node = operations.drain_node(o["name"], CLI_ACTOR, force=o["force"])
    forced = "; forced: a replica with nowhere else to go drains and stops" if node.drain_force else ""
    out.write(
        f"node {node.name} draining: its replicas are replaced elsewhere, one at a time per model{forced}; "
        "watch with: llmgw ctl nodes\n"
    )


def undrain(o, out):
    operations.undrain_node(o["name"], CLI_ACTOR)
    out.write(f"node {o['name']} undrained: it takes new replicas again\n")
