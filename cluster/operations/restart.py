"""Restarts and node drains: replicas replaced without leaving service first, one at a time per model."""

from __future__ import annotations

from django.db import transaction

from cluster.errors import Conflict, NotFound, OperationError
from cluster.events import kick_reconciler, record
from cluster.models import ClusterSettings, Model, Node, Replica


class RestartQueued(list):
    """The names of the replicas queued for restart, with `skipped`: name -> why nothing was done for it
    (already queued, being replaced, not stale, ...). Replicas picked by --model, --all or --stale that are
    not running (draining, stopping, unplaced) are left out silently; ones named are always accounted for."""

    def __init__(self, queued=(), skipped: dict[str, str] | None = None):
        super().__init__(queued)
        self.skipped = dict(skipped or {})


def staleness(replica: Replica, model: Model, cluster_settings: ClusterSettings) -> str | None:
    """Why a running replica no longer matches what it would start with now, or None.

    "profile edited", "engine version", "engine key", "model file" (comma-separated when several): its
    start-time snapshot against the model's profile arguments, engine, file and the current engine key.
    Only placed replicas that count (pending to ready) can be stale; a restart is what makes them current.
    """
    snap = replica.snapshot or {}
    if not snap or replica.node_id is None or replica.state not in Replica.COUNTING or replica.rollout_id is not None:
        return None  # (a rollout's canary runs the rollout's settings, not its model's)
    why = []
    if "args" in snap and snap["args"] != model.profile.args():
        why.append("profile edited")
    if "engine" in snap and snap["engine"] != model.engine.spec():
        why.append("engine version")
    if "engine_key" in snap and snap["engine_key"] != ClusterSettings.fingerprint(cluster_settings.engine_key):
        why.append("engine key")
    if "file" in snap and snap["file"] != model.file.sha256:
        why.append("model file")
    return ", ".join(why) or None


def _not_restartable(replica: Replica) -> str:
    """Why queuing this replica for restart would do nothing ('' if it would not)."""
    if replica.restart == Replica.Restart.QUEUED:
        return "already queued for restart"
    if replica.restart == Replica.Restart.REPLACING:
        return "already being replaced"
    if replica.model.removing:
        return "its model is being removed"
    if replica.state in (Replica.State.DRAINING, Replica.State.STOPPING):
        return f"already {replica.state}"
    if replica.node_id is None:
        return "not placed yet: it starts with the current settings when it is"
    return ""


def _names_list(label: str, value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise OperationError(f"{label} must be a list of names")
    return list(dict.fromkeys(value))


def restart_replicas(
    actor: str, replicas=(), models=(), all: bool = False, stale: bool = False  # noqa: A002 (the CLI's --all)
) -> RestartQueued:
    """Queue replicas for restart: each is replaced without leaving service first (the reconciler places a
    replacement beside it, then drains it), one at a time per model.

    `replicas` by name, every replica of `models`, `all` of them, or with `stale` only the stale ones (of
    those named, or of all when none is named). An unknown name is an error and queues nothing; a replica
    already queued or being replaced is a no-op, reported in `skipped`."""
    replicas = _names_list("replicas", replicas)
    models = _names_list("models", models)
    if not (replicas or models or all or stale):
        raise OperationError("name replicas, --model, --all or --stale")
    with transaction.atomic():
        if ClusterSettings.load().serving_stopped:
            raise Conflict(
                "llmgw is stopped: nothing runs to restart (on start, replicas use the current settings)"
            )
        rows = Replica.objects.select_related("model__profile", "model__engine", "model__file").exclude(
            state__in=Replica.TERMINAL
        )
        chosen: dict[int, Replica] = {}
        if replicas:
            found = {r.name: r for r in Replica.objects.filter(name__in=replicas).select_related(
                "model__profile", "model__engine", "model__file"
            )}
            unknown = [name for name in replicas if name not in found]
            if unknown:
                raise NotFound(f"no replica named {', '.join(repr(n) for n in unknown)}; nothing queued")
            over = [found[name] for name in replicas if found[name].state in Replica.TERMINAL]
            if over:
                shown = ", ".join(f"{r.name} is {r.state}" for r in over)
                raise Conflict(f"only running replicas can be restarted: {shown}; nothing queued")
            chosen.update((r.pk, r) for r in found.values())
        if models:
            known = set(Model.objects.filter(name__in=models).values_list("name", flat=True))
            unknown = [name for name in models if name not in known]
            if unknown:
                raise NotFound(f"no model named {', '.join(repr(n) for n in unknown)}; nothing queued")
            chosen.update((r.pk, r) for r in rows.filter(model__name__in=models))
        if all or (stale and not replicas and not models):
            chosen.update((r.pk, r) for r in rows)
        cluster = ClusterSettings.load()
        named = set(replicas)
        queued: list[str] = []
        skipped: dict[str, str] = {}
        for r in sorted(chosen.values(), key=lambda r: (r.model.name, r.name)):
            why_not = _not_restartable(r)
            if why_not:
                if r.name in named or r.restart != Replica.Restart.NONE:
                    skipped[r.name] = why_not
                continue
            why_stale = staleness(r, r.model, cluster)
            if stale and why_stale is None:
                if r.name in named:
                    skipped[r.name] = "not stale"
                continue
            claimed = Replica.objects.filter(
                pk=r.pk, restart=Replica.Restart.NONE, state__in=Replica.COUNTING, node__isnull=False
            ).update(restart=Replica.Restart.QUEUED)
            if not claimed:
                skipped[r.name] = "changed meanwhile; look again with: llmgw ctl replicas"
                continue
            queued.append(r.name)
            stale_note = f" (stale: {why_stale})" if why_stale else ""
            record(
                "replica.restart_queued", actor, f"replica {r.name} queued for restart{stale_note}", subject=r.name
            )
        if queued:
            kick_reconciler()
    return RestartQueued(queued, skipped)


def drain_node(name: str, actor: str, force: bool = False) -> Node:
    """The node takes no new replicas; its replicas are replaced elsewhere like a restart (one at a time per
    model, the replacement first). One with nowhere else to go keeps serving and the drain says it is
    blocked, unless `force`: then it drains (in-flight requests finish, up to the grace) and stops."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            raise NotFound(f"no node named {name!r}")
        if node.draining:
            if force and not node.drain_force:
                node.drain_force = True
                node.save(update_fields=["drain_force"])
                record(
                    "node.drain_forced", actor,
                    f"node {name} drain forced: a replica with nowhere else to go drains and stops", subject=name,
                )
                kick_reconciler()
                return node
            hint = "" if node.drain_force else "; --force stops the replicas that have nowhere else to go"
            raise Conflict(f"node {name} is already draining{hint}")
        count = node.replicas.filter(state__in=Replica.COUNTING).count()
        node.draining, node.drain_force, node.drain_note = True, force, ""
        node.save(update_fields=["draining", "drain_force", "drain_note"])
        message = (
            f"node {name} draining: it takes no new replicas; its {count} replica(s) are replaced elsewhere, "
            "one at a time per model, each serving until its replacement is ready"
        )
        if force:
            message += "; forced: a replica with nowhere else to go drains and stops"
        record("node.draining", actor, message, subject=name, force=force)
        kick_reconciler()
    return node


def undrain_node(name: str, actor: str) -> Node:
    """The node takes replicas again. Replicas still waiting to be moved off it stay where they are."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            raise NotFound(f"no node named {name!r}")
        if not node.draining:
            raise Conflict(f"node {name} is not draining")
        moving = node.replicas.filter(restart=Replica.Restart.REPLACING, state__in=Replica.COUNTING)
        kept = sorted(moving.values_list("name", flat=True))
        # Being replaced only because of the drain: they stay (a replacement already placed is then surplus).
        moving.update(restart=Replica.Restart.NONE)
        node.draining, node.drain_force, node.drain_note = False, False, ""
        node.save(update_fields=["draining", "drain_force", "drain_note"])
        message = f"node {name} undrained: it takes new replicas again"
        if kept:
            message += f"; {', '.join(kept)} stay(s) on it instead of moving"
        record("node.undrained", actor, message, subject=name)
        kick_reconciler()
    return node

