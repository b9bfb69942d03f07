"""`ctl settings` and `ctl engine-key show|rotate`: the cluster settings and the key every engine requires."""

from __future__ import annotations

import json

from cluster import operations, queries
from cluster.models import ClusterSettings
from llmgw.cli.args import CLI_ACTOR

def engine_key_show(o, out):
    out.write(ClusterSettings.load().engine_key + "\n")


def engine_key_rotate(o, out):
    cluster = operations.rotate_engine_key(CLI_ACTOR)
    fingerprint = ClusterSettings.fingerprint(cluster.engine_key)
    out.write(
        f"engine key rotated (fingerprint {fingerprint}); running replicas keep the old key until restarted: "
        "llmgw ctl restart --stale\n"
    )


# ctl: settings


def settings_show_or_set(o, out):
    if o["drain_grace"] is not None or o["reconcile_interval"] is not None or o.get("min_resident") is not None:
        cluster = operations.set_settings(
            CLI_ACTOR, drain_grace_seconds=o["drain_grace"], reconcile_interval_seconds=o["reconcile_interval"],
            min_resident_seconds=o.get("min_resident"),
        )
    else:
        cluster = ClusterSettings.load()
    shown = queries.cluster_settings_shown(cluster)
    if o["json"]:
        out.write(json.dumps(shown) + "\n")
        return
    for key, value in shown.items():
        out.write(f"{key.replace('_', ' ')}: {value}\n")
