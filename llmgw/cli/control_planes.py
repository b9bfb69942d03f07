"""`llmgw control-plane …`: the control planes, each with its own mirror of model files, and their tokens."""

from __future__ import annotations

from llmgw.cli.output import age, as_json, now, table


def control_plane_list(o, out):
    planes = o["api"].rows("control-planes/")
    if o.get("json"):
        return as_json(planes, out)
    at = now()
    rows = []
    for p in planes:
        flags = [f for f, on in (("this one", p["this"]),
                                 (f"new token asked {age(p['rotation_asked_at'], at)} ago", p["rotation_asked_at"]))
                 if on]
        rows.append([p["name"], p["url"] or "- (the others cannot fetch from it)",
                     "alive" if p["alive"] else "not heard from lately", age(p["seen_at"], at), p["files"],
                     ", ".join(flags)])
    table(["NAME", "URL", "STATUS", "SEEN", "FILES", "FLAGS"], rows, out)


def control_plane_remove(o, out):
    name = o["name"]
    removed = o["api"].delete(f"control-planes/{name}/", force="true" if o["force"] else None,
                              doing="remove control planes")
    said = (f"control plane {name} removed: its token no longer opens /mirror; the {removed['files']} file(s) it "
            "held forgotten")
    if removed["orphaned"]:
        said += f"; on no control plane now: {', '.join(removed['orphaned'])} (import them again)"
    if removed["alive"]:
        said += (f"; it still runs: stop it, or run `llmgw control-plane token {name}` on it to join again under a "
                 "new token")
    out.write(said + "\n")


def control_plane_token(o, out):
    name = o["name"]
    plane = o["api"].post(f"control-planes/{name}/token/", doing="give control planes new tokens")
    if plane["rotated"]:
        out.write(f"control plane {name}: a new token, written to its LLMGW_HOME; the old one no longer opens "
                  "/mirror\n")
        return
    when = ("at its worker's next heartbeat (within seconds)" if plane["alive"] else
            f"when its worker runs again (not heard from for {age(plane['seen_at'])})")
    out.write(f"control plane {name} makes itself a new token {when}; its old token works until then "
              f"(`llmgw control-plane remove {name}` cuts it off at once)\n")
