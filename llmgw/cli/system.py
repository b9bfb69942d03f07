"""`llmgw status`, `stop`, `start` and `restart`: the whole system."""

from __future__ import annotations

import time

from llmgw.cli.client import CliError
from llmgw.cli.output import as_json

# the steps of a system restart, as cluster.system records them
RESTART_KINDS = ("system.", "agent.restart", "process.restart")
TAKEN_WITHIN = 30.0  # seconds a worker has to begin a queued restart before the command gives up


def status(o, out):
    s = o["api"].get("status/")
    if o.get("json"):
        return as_json(s, out)
    stopped = s["serving"] == "stopped"
    out.write(
        "llmgw: STOPPED (every model held at zero replicas; /v1/ answers 503 until `llmgw start`)\n"
        if stopped
        else "llmgw: serving\n"
    )
    out.write(f"nodes: {s['nodes']['connected']} connected of {s['nodes']['total']}\n")
    shown = ", ".join(f"{n} {state}" for state, n in s["replicas"].items()) or "none"  # in the states' order
    out.write(f"replicas: {shown}\n")
    out.write(f"models: {len(s['models'])}\n")
    for m in s["models"]:
        note = " (removing)" if m["removing"] else (f" - {m['placement_note']}" if m["placement_note"] else "")
        shown = m.get("replicas_text") or f"{m['ready']}/{m['replicas']}"  # (a server of before replicas_text)
        out.write(f"  {m['name']}: {shown} ready{note}\n")


def system_stop(o, out):
    o["api"].post("system/stop/", doing="stop serving")
    out.write("llmgw stopped: every model goes to zero replicas and /v1/ answers 503 until `llmgw start`\n")


def system_start(o, out):
    o["api"].post("system/start/", doing="start serving")
    out.write("llmgw started: models are placed again; watch with: llmgw ctl replicas\n")


def system_restart(o, out):
    """Queue the restart on a worker and print its steps (Events) as they happen, until it is done."""
    api = o["api"]
    newest = api.get("events/", limit=1)["results"]
    after = newest[0]["id"] if newest else 0
    api.post("system/restart/", {"timeout": o["timeout"]}, doing="restart the system")
    out.write("restarting llmgw: every agent, then web, beat and worker processes; engines keep serving\n")
    out.flush()
    began, done_at = time.monotonic(), None
    failed: list[str] | None = None  # the processes that did not come back, once the restart said it was done
    started = False
    awaited: set[str] = set()  # processes asked last (the worker running it): their successors say they are back
    while failed is None or awaited:
        time.sleep(0.5)
        try:
            page = api.get("events/", after=after, limit=10_000)["results"]
        except CliError as exc:  # the web process that answered is itself restarting: look again
            if "cannot reach" not in str(exc) and "did not answer" not in str(exc):
                raise
            continue
        for e in sorted(page, key=lambda e: e["id"]):
            after = e["id"]
            if not e["kind"].startswith(RESTART_KINDS) or e["kind"] == "system.restart_queued":
                continue
            out.write(f"  {e['message']}\n")
            started = started or e["kind"] == "system.restart"
            if e["kind"] == "process.restart" and (e.get("data") or {}).get("successor"):
                awaited.add(e["subject"])
            elif e["kind"] == "process.restarted":
                awaited.discard(e["subject"])
            elif e["kind"] == "system.restarted":
                failed, done_at = (e.get("data") or {}).get("failed") or [], time.monotonic()
            elif e["kind"] == "system.restart_interrupted":
                raise CliError("the system restart was cut short (see above); run `llmgw restart` again")
        out.flush()
        if done_at is not None and awaited and time.monotonic() - done_at > o["timeout"]:
            out.write(f"  {', '.join(sorted(awaited))}: not back within {o['timeout']:.0f}s (is it supervised?)\n")
            failed, awaited = [*(failed or []), *sorted(awaited)], set()  # failed: said with done_at
        if not started and time.monotonic() - began > TAKEN_WITHIN:
            raise CliError(f"no worker began the queued restart within {TAKEN_WITHIN:.0f}s: is the worker running? "
                           "(llmgw service status); it begins when one does")
    if failed:
        raise CliError(f"some parts did not come back ({', '.join(failed)}); see above and `llmgw ctl events`")
