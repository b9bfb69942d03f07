"""The whole system: serving stopped and started, the cluster's summary, its settings and the engine key."""

from __future__ import annotations

from django.db import transaction

from cluster.errors import Conflict, OperationError
from cluster.events import kick_reconciler, record
from cluster.models import ClusterSettings, Replica
from cluster.operations.validation import DRAIN_GRACE, MAX_WAIT, MIN_RESIDENT, QUEUE_LIMIT, RECONCILE_INTERVAL


def stop_serving(actor: str) -> ClusterSettings:
    """Every model to zero replicas, /v1/ answers 503 system_stopped; no model's definition changes."""
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        if cluster.serving_stopped:
            raise Conflict("llmgw is already stopped")
        cluster.serving_stopped = True
        cluster.save(update_fields=["serving_stopped", "updated_at"])
        record("system.stopped", actor, "serving stopped: every model goes to zero replicas; /v1/ answers 503")
        kick_reconciler()
    return cluster


def start_serving(actor: str) -> ClusterSettings:
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        if not cluster.serving_stopped:
            raise Conflict("llmgw is already serving")
        cluster.serving_stopped = False
        cluster.save(update_fields=["serving_stopped", "updated_at"])
        record("system.started", actor, "serving started: every model is placed again as it asks")
        kick_reconciler()
    return cluster


def set_settings(actor: str, drain_grace_seconds: int | None = None, reconcile_interval_seconds: int | None = None,
                 min_resident_seconds: int | None = None, queue_limit: int | None = None,
                 max_wait_seconds: int | None = None) -> ClusterSettings:
    """Change the cluster settings given (None: leave as is): how long a drain waits for requests in flight,
    how often the reconciler runs, how long an autoscaled model's replica serves before it may be evicted
    for another model, and the default bounds of a model's admission queue (requests waiting, seconds each may
    wait) for the models that set none of their own."""
    values = {}
    if drain_grace_seconds is not None:
        values["drain_grace_seconds"] = DRAIN_GRACE.check("drain grace (seconds)", drain_grace_seconds)
    if reconcile_interval_seconds is not None:
        values["reconcile_interval_seconds"] = RECONCILE_INTERVAL.check("reconcile interval (seconds)",
                                                                          reconcile_interval_seconds)
    if min_resident_seconds is not None:
        values["min_resident_seconds"] = MIN_RESIDENT.check("minimum residency (seconds)", min_resident_seconds)
    if queue_limit is not None:
        values["queue_limit"] = QUEUE_LIMIT.check("queue limit", queue_limit)
    if max_wait_seconds is not None:
        values["max_wait_seconds"] = MAX_WAIT.check("max wait (seconds)", max_wait_seconds)
    if not values:
        raise OperationError("name a setting to change: drain grace, reconcile interval, minimum residency, queue "
                             "limit or max wait")
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        changed = {k: v for k, v in values.items() if getattr(cluster, k) != v}
        for k, v in changed.items():
            setattr(cluster, k, v)
        if changed:
            cluster.save(update_fields=[*changed, "updated_at"])
            said = ", ".join(f"{k.replace('_seconds', '').replace('_', ' ')} {v}{'s' if k.endswith('_seconds') else ''}"
                             for k, v in changed.items())
            record("settings.changed", actor, f"settings changed: {said}", subject="", **changed)
            kick_reconciler()
    return cluster


def rotate_engine_key(actor: str) -> ClusterSettings:
    """A new engine key for replicas started from now on. Running replicas keep the old one until they are
    restarted (`restart --stale`); the gateway and the agents use each replica's own key meanwhile, so only
    one rotation at a time: refused while a replica still runs with the key before the current one."""
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        running = Replica.objects.exclude(state__in=Replica.TERMINAL)
        if cluster.previous_engine_key:
            older = list(
                running.filter(snapshot__engine_key=ClusterSettings.fingerprint(cluster.previous_engine_key))
                .order_by("name")
                .values_list("name", flat=True)
            )
            if older:
                shown = ", ".join(older[:5]) + (", …" if len(older) > 5 else "")
                raise Conflict(
                    f"{len(older)} replica(s) still use the engine key before the current one ({shown}); "
                    "restart them first: llmgw ctl restart --stale"
                )
        keeping = running.filter(snapshot__engine_key=ClusterSettings.fingerprint(cluster.engine_key)).count()
        cluster.previous_engine_key = cluster.engine_key
        cluster.engine_key = ClusterSettings.new_engine_key()
        cluster.save(update_fields=["engine_key", "previous_engine_key", "updated_at"])
        record(
            "engine_key.rotated",
            actor,
            f"engine key rotated: new replicas get the new key; {keeping} running replica(s) keep the old one "
            "until restarted (the gateway uses it for them meanwhile); restart them with: llmgw ctl restart --stale",
            stale=keeping,
        )
        kick_reconciler()
    return cluster
