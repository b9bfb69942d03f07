"""`ctl keys create|list|revoke` and `ctl usage`: client keys for /v1/ and what they used."""

from __future__ import annotations

from llmgw.cli.args import parse_when
from llmgw.cli.output import age, as_json, moment, now, table


def keys_create(o, out):
    body = {"name": o["name"], "models": o["models"] or [], "rpm": o["rpm"], "tpm": o["tpm"],
            "expires_at": parse_when(o["expires"], "--expires"), "max_tokens": o["max_tokens"]}
    key = o["api"].post("keys/", body, doing="create keys")
    out.write(f"key {key['name']} created; the key (shown once, keep it): {key['key']}\n")


def keys_list(o, out):
    keys = o["api"].rows("keys/")
    if o.get("json"):
        return as_json(keys, out)
    at = now()
    rows = []
    for k in keys:
        expires = moment(k["expires_at"])
        rows.append([k["name"], k["prefix"] + "…", ", ".join(k["models"]) or "all", k["rpm"] or "-", k["tpm"] or "-",
                     k["max_tokens"] or "-", f"{expires:%Y-%m-%d %H:%M}" if expires else "never", k["state"],
                     age(k["last_used_at"], at) + (" ago" if k["last_used_at"] else "")])
    table(["NAME", "PREFIX", "MODELS", "RPM", "TPM", "MAX TOKENS", "EXPIRES", "STATE", "LAST USED"], rows, out)


def keys_revoke(o, out):
    o["api"].post(f"keys/{o['name']}/revoke/", doing="revoke keys")
    out.write(f"key {o['name']} revoked\n")


def usage_list(o, out):
    rows = o["api"].rows("usage/", key=o["key"], model=o["model"], since=parse_when(o["since"], "--since"))
    if o.get("json"):
        return as_json(rows, out)
    table(
        ["HOUR", "KEY", "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"],
        [[f"{moment(r['hour']):%Y-%m-%d %H:00}", r["key"], r["model"], r["requests"], r["prompt_tokens"],
          r["completion_tokens"]] for r in rows],
        out,
    )
