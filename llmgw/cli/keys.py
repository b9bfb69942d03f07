"""`ctl keys create|list|revoke` and `ctl usage`: client keys for /v1/ and what they used."""

from __future__ import annotations

from django.utils import timezone

from gateway import operations
from gateway.models import ApiKey
from llmgw.cli.args import CLI_ACTOR, parse_when
from llmgw.cli.output import age, as_json, table

def keys_create(o, out):
    key, secret = operations.create_key(
        o["name"], CLI_ACTOR, models=o["models"] or [], rpm=o["rpm"], tpm=o["tpm"],
        expires_at=parse_when(o["expires"], "--expires"), max_tokens=o["max_tokens"],
    )
    out.write(f"key {key.name} created; the key (shown once, keep it): {secret}\n")


def keys_list(o, out):
    keys = ApiKey.objects.all()
    now = timezone.now()
    data = [
        {
            "name": k.name, "prefix": k.prefix, "models": k.allowed_models, "rpm": k.rpm, "tpm": k.tpm,
            "max_tokens": k.max_tokens, "expires_at": k.expires_at, "revoked_at": k.revoked_at, "last_used_at": k.last_used_at,
        }
        for k in keys
    ]
    if o.get("json"):
        return as_json(data, out)
    rows = [
        [k.name, k.prefix + "…", ", ".join(k.allowed_models) or "all", k.rpm or "-", k.tpm or "-", k.max_tokens or "-",
         f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else "never",
         "revoked" if k.revoked_at else ("expired" if k.expires_at and k.expires_at <= now else "active"),
         age(k.last_used_at, now) + (" ago" if k.last_used_at else "")]
        for k in keys
    ]
    table(["NAME", "PREFIX", "MODELS", "RPM", "TPM", "MAX TOKENS", "EXPIRES", "STATE", "LAST USED"], rows, out)


def keys_revoke(o, out):
    operations.revoke_key(o["name"], CLI_ACTOR)
    out.write(f"key {o['name']} revoked\n")


def usage_list(o, out):
    rows = operations.usage_report(key=o["key"], model=o["model"], since=parse_when(o["since"], "--since"))
    if o.get("json"):
        return as_json(rows, out)
    table(
        ["HOUR", "KEY", "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"],
        [[f"{r['hour']:%Y-%m-%d %H:00}", r["key"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in rows],
        out,
    )
