"""`ctl settings` and `ctl engine-key show|rotate`: the cluster settings and the key every engine requires."""

from __future__ import annotations

import json


def engine_key_show(o, out):
    out.write(o["api"].get("engine-key/")["engine_key"] + "\n")


def engine_key_rotate(o, out):
    rotated = o["api"].post("engine-key/rotate/", doing="rotate the engine key")
    out.write(
        f"engine key rotated (fingerprint {rotated['fingerprint']}); running replicas keep the old key until "
        "restarted: llmgw ctl restart --stale\n"
    )


def settings_show_or_set(o, out):
    changes = {field: o.get(option) for option, field in (
        ("drain_grace", "drain_grace_seconds"), ("reconcile_interval", "reconcile_interval_seconds"),
        ("min_resident", "min_resident_seconds"), ("queue_limit", "queue_limit"), ("max_wait", "max_wait_seconds"))
        if o.get(option) is not None}
    api = o["api"]
    shown = api.patch("settings/", changes, doing="change the cluster settings") if changes else api.get("settings/")
    if o["json"]:
        out.write(json.dumps(shown) + "\n")
        return
    for key, value in shown.items():
        out.write(f"{key.replace('_', ' ')}: {value}\n")
