"""`ctl replicas` and `ctl restart`: the engine processes, and replacing them without an outage."""

from __future__ import annotations

from llmgw.cli.output import age, as_json, now, size, table

OVER = ("stopped", "failed")  # as cluster.models.Replica.TERMINAL


def replica_note(r: dict) -> str:
    notes = []
    if r.get("canary"):
        notes.append("(canary)")
    if r["restart"] != "none" and r["state"] not in OVER:
        notes.append(f"(restart {r['restart']})")
    if r["stale"]:
        notes.append(f"(stale: {r['stale']})")
    if r["state"] == "downloading" and r["download_total"]:
        notes.append(f"{100 * r['download_done'] // r['download_total']}% of {size(r['download_total'])}")
    if r["reason"]:
        notes.append(r["reason"])
    return " ".join(notes)


def replicas_list(o, out):
    replicas = o["api"].rows("replicas/", model=o.get("model"), node=o.get("node"),
                             current=None if o.get("all") else "true")
    replicas.sort(key=lambda r: (r["model"], r["created_at"]))
    if o.get("json"):
        return as_json(replicas, out)
    at = now()
    rows = [[r["name"], r["model"], r["node"] or "-", r["state"], r["port"] or "-", age(r["created_at"], at),
             replica_note(r)] for r in replicas]
    table(["NAME", "MODEL", "NODE", "STATE", "PORT", "AGE", "NOTE"], rows, out)


def restart(o, out):
    body = {"replicas": o["replicas"], "models": o["model"] or [], "all": o["all"], "stale": o["stale"]}
    queued = o["api"].post("restart/", body, doing="restart replicas")
    for skipped in queued["skipped"]:
        out.write(f"{skipped['name']}: {skipped['why']}; nothing to do\n")
    out.write(f"{len(queued['queued'])} replica(s) queued for restart; watch with: llmgw ctl replicas\n")
