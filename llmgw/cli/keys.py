"""`ctl keys create|set|list|revoke` and `ctl usage`: client keys for /v1/ and what they used."""

from __future__ import annotations

from llmgw.cli.args import DEFAULT_PRIORITY, UNSET, parse_when
from llmgw.cli.client import CliError
from llmgw.cli.output import age, as_json, moment, now, table


def _budget(budget: tuple[int, str] | None) -> dict:
    """`--budget`'s value as the API's fields: (tokens, period), or None for no budget."""
    tokens, period = budget or (None, "")
    return {"budget_tokens": tokens, "budget_period": period}


def _budget_shown(budget: dict | None, spent: bool = False) -> str:
    """A key's budget as the API shows it: `2M/day`, with `spent`: `120K/2M day`; `none` (or `-` in a table)."""
    from ground.units import about
    from ground.units import shown_tokens as shown

    if not budget:
        return "-" if spent else "none"
    if spent:
        return f"{about(budget['spent'])}/{shown(budget['tokens'])} {budget['period']}"
    return f"{shown(budget['tokens'])}/{budget['period']}"


def keys_create(o, out):
    body = {"name": o["name"], "models": o["models"] or [], "rpm": o["rpm"], "tpm": o["tpm"],
            "expires_at": parse_when(o["expires"], "--expires"), "max_tokens": o["max_tokens"],
            "priority": o.get("priority") or DEFAULT_PRIORITY, **_budget(o.get("budget")),
            "max_concurrency": o.get("max_concurrency"), "log_bodies": bool(o.get("log_bodies"))}
    key = o["api"].post("keys/", body, doing="create keys")
    parts = [f"priority {key['priority']}" if key["priority"] != DEFAULT_PRIORITY else "",
             f"budget {_budget_shown(key['budget'])}" if key["budget"] else "",
             f"max concurrency {key['max_concurrency']}" if key["max_concurrency"] else "",
             "bodies logged" if key["log_bodies"] else ""]
    said = f" ({', '.join(part for part in parts if part)})" if any(parts) else ""
    out.write(f"key {key['name']} created{said}; the key (shown once, keep it): {key['key']}\n")


def _expires(text: str) -> str | None:
    if text.strip().lower() == "never":
        return None
    if not text.strip():  # not "never" by accident
        raise CliError("--expires wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, or never")
    return parse_when(text, "--expires")


def _shown(field: str, key: dict) -> str:
    """A setting as `ctl keys set` prints it changed: `rpm 60`, `rpm none`, `models all`, `expires never`."""
    if field == "models":
        return f"models {','.join(key['models']) or 'all'}"
    if field == "expires_at":
        expires = moment(key["expires_at"])
        return f"expires {expires:%Y-%m-%d %H:%M}" if expires else "expires never"
    if field == "budget":
        return f"budget {_budget_shown(key['budget'])}"
    if field == "log_bodies":
        return "bodies logged" if key["log_bodies"] else "bodies not logged"
    value = key[field]
    return f"{field.replace('_', ' ')} {'none' if value is None else value}"


def keys_set(o, out):
    values = {field: o[field] for field in ("priority", "models", "log_bodies") if o.get(field) is not None}
    for limit in ("rpm", "tpm", "max_tokens", "max_concurrency"):  # None is a value here: no limit
        if o.get(limit, UNSET) is not UNSET:
            values[limit] = o[limit]
    if o.get("expires") is not None:
        values["expires_at"] = _expires(o["expires"])
    shown = list(values)
    if o.get("budget", UNSET) is not UNSET:
        values.update(_budget(o["budget"]) if o["budget"] else {"budget_tokens": None})  # null: no budget
        shown.append("budget")
    if not values:
        raise CliError("nothing to change: give --priority, --rpm, --tpm, --max-tokens, --models, --expires, "
                       "--budget, --max-concurrency or --[no-]log-bodies")
    key = o["api"].patch(f"keys/{o['name']}/", values, doing="change keys")
    out.write(f"key {key['name']} changed: {', '.join(_shown(field, key) for field in shown)}\n")


def keys_list(o, out):
    keys = o["api"].rows("keys/")
    if o.get("json"):
        return as_json(keys, out)
    at = now()
    rows = []
    for k in keys:
        expires = moment(k["expires_at"])
        rows.append([k["name"], k["prefix"] + "…", ", ".join(k["models"]) or "all", k["priority"], k["rpm"] or "-",
                     k["tpm"] or "-", k["max_tokens"] or "-", _budget_shown(k["budget"], spent=True),
                     k["max_concurrency"] or "-", "logged" if k.get("log_bodies") else "-",
                     f"{expires:%Y-%m-%d %H:%M}" if expires else "never",
                     k["state"], age(k["last_used_at"], at) + (" ago" if k["last_used_at"] else "")])
    table(["NAME", "PREFIX", "MODELS", "PRIORITY", "RPM", "TPM", "MAX TOKENS", "BUDGET", "CONCURRENCY", "BODIES",
           "EXPIRES", "STATE", "LAST USED"], rows, out)


def keys_revoke(o, out):
    o["api"].post(f"keys/{o['name']}/revoke/", doing="revoke keys")
    out.write(f"key {o['name']} revoked\n")


def usage_list(o, out):
    query = {"key": o["key"], "model": o["model"], "since": parse_when(o["since"], "--since"), "by": o.get("by")}
    if o.get("csv"):  # the server's CSV as it writes it, header row first
        return out.write(o["api"].text("usage/", "text/csv", **query))
    rows = o["api"].rows("usage/", **query)
    if o.get("json"):
        return as_json(rows, out)
    daily = o.get("by") == "day"
    table(
        ["DAY" if daily else "HOUR", "KEY", "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS",
         "RESUMED (FLEET'S)"],
        [[f"{moment(r['hour']):%Y-%m-%d}" if daily else f"{moment(r['hour']):%Y-%m-%d %H:00}", r["key"], r["model"],
          r["requests"], r["prompt_tokens"], r["completion_tokens"], r.get("resumed_prompt_tokens", 0)] for r in rows],
        out,
    )
