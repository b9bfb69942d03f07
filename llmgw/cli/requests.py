"""`ctl requests` and `ctl requests show ID`: the records of the requests through /v1/, newest first, and one of
them with its figures."""

from __future__ import annotations

from urllib.parse import quote

from llmgw.cli.args import parse_when
from llmgw.cli.client import CliError
from llmgw.cli.output import as_json, moment, table


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f}s" if value >= 1000 else f"{value:.0f}ms"


def requests_cmd(o, out):
    words = o["show"]
    if words:
        if len(words) != 2 or words[0] != "show":
            raise CliError("ctl requests takes filters, or `show ID`")
        return _show(o, words[1], out)
    page = o["api"].get("requests/", key=o["key"], model=o["model"], status=o["status"],
                        slower_than=o["slower_than"], since=parse_when(o["since"], "--since"), replica=o["replica"],
                        event=o["event"], resumed="true" if o.get("resumed") else None, limit=o["limit"])
    rows = page["results"]
    if o.get("json"):
        return as_json(rows, out)
    table(
        ["TIME", "ID", "KEY", "MODEL", "API", "STATUS", "REPLICA", "WAITED", "FIRST TOKEN", "TOTAL", "TOKENS"],
        [[f"{moment(r['at']):%Y-%m-%d %H:%M:%S}", r["request_id"], r["key"] or "-", r["model"] or "-",
          r["surface"] + (" (stream)" if r["streamed"] else ""), f"{r['status']} {r['error']}".strip(),
          (r["replica"] or "-") + (f" ({r['resumes']} resumed)" if r.get("resumes") else ""), _ms(r["waited_ms"]),
          _ms(r["ttft_ms"]), _ms(r["total_ms"]),
          f"{r['prompt_tokens']}+{r['completion_tokens']}"] for r in rows],
        out,
    )


def _show(o, request_id: str, out):
    r = o["api"].get(f"requests/{quote(request_id, safe='')}/")
    if o.get("json"):
        return as_json(r, out)
    asked = f" (asked as {r['asked']})" if r["asked"] and r["asked"] != r["model"] else ""
    route = r.get("route") or {}
    lines = [
        f"request {r['request_id']}  trace {r['trace_id'] or '-'}  span {r.get('span_id') or '-'}"
        + (f" (parent {r['parent_id']})" if r.get("parent_id") else ""),
        f"  at        {moment(r['at']):%Y-%m-%d %H:%M:%S.%f} UTC from {r['client'] or '-'}",
        f"  key       {r['key'] or '-'} ({r['priority'] or '-'})",
        f"  model     {r['model'] or '-'}{asked}, /v1/{r['surface']}{' streamed' if r['streamed'] else ''}",
        f"  answer    {r['status']}{' ' + r['error'] if r['error'] else ''}",
        f"  replica   {r['replica'] or '-'} after {r['attempts']} attempt(s)"
        + (f": {route['policy']}" + (f", its {route['hit']}'s replica" if route.get("hit") else "") if route else ""),
        f"  waited    {_ms(r['waited_ms'])} for a replica and a slot"
        + (f" (queued at position {r['position']})" if r.get("position") is not None else ""),
        f"  first     {_ms(r['ttft_ms'])}",
        f"  total     {_ms(r['total_ms'])}",
        f"  tokens    {r['prompt_tokens']} prompt ({r.get('cached_tokens', 0)} cached), {r['completion_tokens']} "
        f"completion",
    ]
    if r.get("resumes"):
        lines.append(f"  resumed: {r['resumes']} (prompt tokens the fleet paid: {r.get('resumed_prompt_tokens', 0)})")
    if r.get("prompt_ms") is not None or r.get("generation_ms") is not None:
        lines.append(f"  engine    prompt {_ms(r.get('prompt_ms'))}, generation {_ms(r.get('generation_ms'))}")
    steps = r.get("timeline") or []
    if steps:
        lines.append("timeline")
        lines += [f"  {_ms(step['at_ms']):>8}  {step['what']}" for step in steps]
    for name in ("request_body", "response_body"):  # an admin's, for a key that logs bodies
        if r.get(name):
            lines += [name.replace("_", " "), *("  " + line for line in r[name].splitlines())]
    out.write("\n".join(lines) + "\n")
