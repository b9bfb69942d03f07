"""`llmgw node …`, `ctl nodes`, `ctl drain` and `ctl undrain`: the machines with an agent."""

from __future__ import annotations

from ground.facts import BUILD_WHEEL, INSTALL_WHEEL
from llmgw.cli.output import age, as_json, now, size, table


def _agents_url(o, api) -> dict:
    server = o.get("agents_server") or api.agents_url
    return {"server": server} if server else {}


def node_add(o, out):
    api = o["api"]
    node = api.post("nodes/", {"name": o["name"], **_agents_url(o, api)}, doing="add nodes")
    out.write(f"node {node['name']} added; its token (shown once): {node['token']}\n")
    out.write(f"on that machine, install llmgw from its wheel (built in the checkout with `{BUILD_WHEEL}`, "
              f"then copied over; llmgw is on no package index):\n"
              f"  {INSTALL_WHEEL}\n"
              f"and start its agent:\n"
              f"  {node['agent_command']}\n")


def node_remove(o, out):
    o["api"].delete(f"nodes/{o['name']}/", force="true" if o["force"] else None, doing="remove nodes")
    out.write(f"node {o['name']} removed\n")


def node_token(o, out):
    api = o["api"]
    shown = api.post(f"nodes/{o['name']}/token/", _agents_url(o, api), doing="give nodes new tokens")
    out.write(f"node {shown['name']}: new token (shown once; the old one no longer works): {shown['token']}\n")
    out.write(f"start its agent again, on that machine:\n"
              f"  {shown['agent_command']}\n")


def nodes_list(o, out):
    nodes = o["api"].rows("nodes/")
    if o.get("json"):
        return as_json(nodes, out)
    at = now()
    rows = []
    for n in nodes:
        status = "connected" if n["connected"] else ("never connected" if n["last_seen"] is None else "disconnected")
        drain = n["drain"] or ""
        if drain and n["drain_force"] and drain != "drained":
            drain += " (forced)"
        flags = [f for f, on in ((drain, bool(drain)), ("unschedulable", not n["schedulable"])) if on]
        if n["drain_note"] and drain.startswith("blocked"):
            flags.append(f"- {n['drain_note']}")
        gpus = (n["facts"] or {}).get("gpus") or []
        shown_gpus = ", ".join(f"{size(u)} / {size(g.get('memory_bytes'))}"
                               for u, g in zip(n["gpu_memory_used_bytes"], gpus)) or "-"
        engines = ", ".join(sorted((n["facts"] or {}).get("engines") or {})) or "-"
        memory = f"{size(n['memory_used_bytes'])} / {size(n['memory_bytes'])}"
        cpus = f"{n.get('cpus_used', 0)} / {n['cpus']}" if n.get("cpus") else "-"  # (a server of before cpus: -)
        rows.append([n["name"], status, age(n["last_seen"], at), memory, cpus, shown_gpus, n["replica_count"],
                     engines, " ".join(flags)])
    table(["NAME", "STATUS", "SEEN", "MEMORY USED", "CPUS USED", "GPUS", "REPLICAS", "ENGINES", "FLAGS"], rows, out)


def drain(o, out):
    node = o["api"].post(f"nodes/{o['name']}/drain/", {"force": o["force"]}, doing="drain nodes")
    forced = "; forced: a replica with nowhere else to go drains and stops" if node["drain_force"] else ""
    out.write(
        f"node {node['name']} draining: its replicas are replaced elsewhere, one at a time per model{forced}; "
        "watch with: llmgw ctl nodes\n"
    )


def undrain(o, out):
    o["api"].post(f"nodes/{o['name']}/undrain/", doing="undrain nodes")
    out.write(f"node {o['name']} undrained: it takes new replicas again\n")
