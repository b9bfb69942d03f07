"""The questions every front door asks of the cluster, each answered once: the CLI, the REST API and the
dashboard show the same figures because they ask here."""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, TypedDict

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from cluster.memory import replica_threads
from cluster.models import ClusterSettings, Demand, EngineVersion, Model, Node, Replica, Rollout
from cluster.planner.capacity import HOLDS_MEMORY, MemoryInUse

log = logging.getLogger("llmgw.queries")


class ReplicaCount(TypedDict):
    replica_count: int


if TYPE_CHECKING:  # at run time django_stubs_ext's alias takes the model alone; the stubs' take both
    from django_stubs_ext import WithAnnotations

    NodeWithCount = WithAnnotations[Node, ReplicaCount]


def nodes_with_counts() -> QuerySet[NodeWithCount]:
    """Nodes by name, each with `replica_count`: its replicas that are not over (stopped or failed)."""
    over = Q(replicas__state__in=Replica.TERMINAL)
    return Node.objects.annotate(replica_count=Count("replicas", filter=~over)).order_by("name")


def default_engine(now=None) -> EngineVersion | None:
    """The engine a new model gets unless told otherwise (the dashboard's Add a model form): one the fleet's nodes
    can run, so that a model added as shown is placed. The engine whose kind the most nodes here now report (a GPU
    engine counting only nodes with a GPU), then the most nodes that have reported it at all, then the most models
    using it, then by name; None when no engine is defined."""
    engines = list(EngineVersion.objects.annotate(n_models=Count("models")).order_by("name"))
    if not engines:
        return None
    now = now or timezone.now()
    here: Counter = Counter()
    ever: Counter = Counter()
    for node in Node.objects.only("facts", "connected", "last_seen"):
        runs = {(kind, EngineVersion.Device.CPU) for kind in node.engines}
        if node.gpus:
            runs |= {(kind, EngineVersion.Device.GPU) for kind in node.engines}
        ever.update(runs)
        if node.is_alive(now):
            here.update(runs)
    return max(engines, key=lambda e: (here[e.kind, e.device], ever[e.kind, e.device], e.n_models))


def models_with_counts() -> QuerySet[Model]:
    """Models by name, with their file, engine and profile, each with `n_<state>` (its replicas in each state)
    and `n_counting` (those counting toward `replicas` now: pending to ready, not being replaced)."""
    not_replacing = ~Q(replica_set__restart=Replica.Restart.REPLACING)
    counts = {f"n_{s}": Count("replica_set", filter=Q(replica_set__state=s)) for s in Replica.State.values}
    counting = Count("replica_set", filter=Q(replica_set__state__in=Replica.COUNTING) & not_replacing)
    return (
        Model.objects.select_related("file", "engine", "profile", "demand")
        .annotate(n_counting=counting, **counts)
        .order_by("name")
    )


def last_requests() -> dict[str, datetime]:
    """When each model was last asked for through the gateway (every web process sets it: cluster.inflight), fixed
    or autoscaled; {} when Redis cannot be read (the doors then show no last request, not an error)."""
    from cluster.inflight import last_requests as read
    from cluster.locks import redis_client

    try:
        return {name: datetime.fromtimestamp(t, tz=UTC) for name, t in read(redis_client()).items()}
    except Exception as exc:  # Redis away
        log.warning("could not read the models' last requests (%s)", exc)
        return {}


def scaling_shown(model: Model, asked: dict[str, datetime] | None = None) -> dict:
    """A model's figures as every door shows them (`status`, `ctl models`, the Overview and Models pages, the REST
    API): its mode (fixed, autoscaled, on-demand), its ready replicas, the replicas it wants now (its fixed count,
    or the autoscaler's number; what the planner places), its range and knobs, `replicas_text` (READY/WANT, with
    the range when autoscaled), its last request (one the gateway saw, whatever its mode; `asked`: the
    models' last requests already read, else read) and, on demand and loaded, when it goes idle."""
    demand = _demand(model) if model.autoscaled else None
    asked = last_requests() if asked is None else asked
    ready = getattr(model, "n_ready", None)
    if ready is None:
        ready = model.replica_set.filter(state=Replica.State.READY).count()
    wanted: int | None = model.replicas
    if model.autoscaled:
        wanted = demand.replicas if demand else model.min_replicas
    text = f"{ready}/{wanted}" + (f" ({model.min_replicas}-{model.max_replicas})" if model.autoscaled else "")
    shown = {"mode": model.mode, "ready": ready, "wanted": wanted, "replicas_text": text,
             "min_replicas": model.min_replicas, "max_replicas": model.max_replicas, "target_inflight": None,
             "idle_after_seconds": None, "scale_down_delay_seconds": None,
             "last_request_at": asked.get(model.name), "idle_at": None}
    if not model.autoscaled:
        return shown
    shown.update(target_inflight=model.target_inflight, idle_after_seconds=model.idle_after_seconds,
                 scale_down_delay_seconds=model.scale_down_delay_seconds)
    if demand and demand.last_request_at:  # the autoscaler keeps the last it saw (Redis may have restarted since)
        seen = shown["last_request_at"]
        shown["last_request_at"] = max(seen, demand.last_request_at) if seen else demand.last_request_at
    # the autoscaler's idle clock: its last request, else when it last scaled (cluster.planner.scaling)
    idle_from = (demand.last_request_at or demand.last_scaled_at) if demand else None
    if model.on_demand and wanted and idle_from:
        shown["idle_at"] = idle_from + timedelta(seconds=model.idle_after_seconds)
    return shown


def read_settings() -> ClusterSettings:
    """The cluster settings to read a default from, never creating the row (ClusterSettings.load makes the engine
    key, with an Event: a change no look should make); its defaults when it does not exist yet."""
    return ClusterSettings.objects.filter(pk=1).first() or ClusterSettings()


def queues(names) -> dict[str, tuple[int, float | None]] | None:
    """Requests waiting in each named model's admission queue, and since when (epoch seconds) the oldest has
    waited, read from Redis in one round trip for them all; None when Redis cannot be read (the doors then show
    the waiting as unknown, not an error)."""
    from cluster.inflight import queued
    from cluster.locks import redis_client

    try:
        return queued(redis_client(), names)
    except Exception as exc:  # Redis away
        log.warning("could not read the models' queues (%s)", exc)
        return None


def queue_shown(model: Model, waiting: dict[str, tuple[int, float | None]] | None,
                cluster: ClusterSettings | None = None, now: float | None = None) -> dict:
    """A model's admission queue as every door shows it: the requests waiting (None: unknown, Redis away), how
    long the oldest has waited (seconds; None: none waits), and its effective bounds (its own, else the cluster's
    defaults). `waiting`: what queues() read for a page of models."""
    cluster = cluster or ClusterSettings.load()
    n, since = (None, None) if waiting is None else waiting.get(model.name, (0, None))
    longest = None
    if n and since is not None:
        longest = round(max(0.0, (time.time() if now is None else now) - since), 1)
    return {
        "waiting": n,
        "longest_wait_seconds": longest,
        "queue_limit": model.queue_limit if model.queue_limit is not None else cluster.queue_limit,
        "max_wait_seconds": model.max_wait_seconds if model.max_wait_seconds is not None else cluster.max_wait_seconds,
    }


def _demand(model: Model) -> Demand | None:
    try:
        return model.demand
    except Demand.DoesNotExist:
        return None


def memory_in_use(nodes=None) -> MemoryInUse:
    """Memory the replicas hold on each node (RAM, and each GPU's by index) and the CPU cores their threads take,
    counted by the rule placement counts them with (cluster.planner.capacity). `nodes`: the Node rows already at hand
    (else read)."""
    rows = nodes if nodes is not None else Node.objects.only("pk", "facts")
    gpu_counts = {n.pk: len(n.gpus) for n in rows}
    used = MemoryInUse()
    held = Replica.objects.filter(node__isnull=False, state__in=HOLDS_MEMORY)
    for node_id, state, gpu_index, memory_bytes, snapshot in held.values_list(
            "node_id", "state", "gpu_index", "memory_bytes", "snapshot"):
        used.add(node_id, gpu_counts.get(node_id, 0), state, gpu_index, memory_bytes, replica_threads(snapshot))
    return used


RECENT_FAILURES = timedelta(minutes=10)  # how long a failed replica stays in the lists of current replicas


def replicas_listed(include_over: bool = False) -> QuerySet[Replica]:
    """Replicas as `ctl replicas`, the Replicas page and `GET /api/v1/replicas/?current=true` list them: every
    one that is not over, and those that failed in the last RECENT_FAILURES (a crash stays in sight a while);
    with `include_over`, every one. With their model (file, engine, profile) and node."""
    rows = Replica.objects.select_related("model__profile", "model__engine", "model__file", "node")
    if include_over:
        return rows
    since = timezone.now() - RECENT_FAILURES
    return rows.filter(~Q(state__in=Replica.TERMINAL) | Q(state=Replica.State.FAILED, state_changed_at__gte=since))


def replicas_by_state() -> dict[str, dict[str, int]]:
    """Every model's replicas in each state, every state named (0: none), counted over the replicas
    `replicas_listed()` lists: those not over, and the recent failures. For `/metrics`' `llmgw_replicas`."""
    rows = replicas_listed().order_by().values_list("model__name", "state").annotate(n=Count("id"))
    counted = {(name, state): n for name, state, n in rows.values_list("model__name", "state", "n")}
    return {name: {state: counted.get((name, state), 0) for state in Replica.State.values}
            for name in Model.objects.order_by("name").values_list("name", flat=True)}


def cluster_settings_shown(cluster: ClusterSettings | None = None) -> dict:
    """The cluster settings as `ctl settings` and `GET /api/v1/settings/` show them (never the engine key)."""
    cluster = cluster or ClusterSettings.load()
    return {
        "drain_grace_seconds": cluster.drain_grace_seconds,
        "reconcile_interval_seconds": cluster.reconcile_interval_seconds,
        "min_resident_seconds": cluster.min_resident_seconds,
        "queue_limit": cluster.queue_limit,
        "max_wait_seconds": cluster.max_wait_seconds,
        "serving_stopped": cluster.serving_stopped,
        "engine_key_fingerprint": ClusterSettings.fingerprint(cluster.engine_key),
    }


def users_listed() -> list[dict]:
    """Every user by name, with its role and whether it has a password (the dashboard; without one, the API token
    alone), as `llmgw user list`, `GET /api/v1/users/` and the Users page show them. Never a token."""
    from django.contrib.auth.models import User

    from cluster.roles import role_of

    return [{"name": u.username, "role": role_of(u), "password": u.has_usable_password(), "active": u.is_active,
             "joined_at": u.date_joined, "last_login_at": u.last_login}
            for u in User.objects.prefetch_related("groups").order_by("username")]


def cluster_status() -> dict:
    """The cluster in brief, as `status`, `GET /api/v1/status/` and the Overview show it: serving or stopped, the
    nodes connected, each model's figures (scaling_shown) and the replicas by state."""
    settings_row = ClusterSettings.load()
    now = timezone.now()
    nodes = list(Node.objects.all())
    alive = [n for n in nodes if n.is_alive(now)]
    counted = dict(
        Replica.objects.exclude(state__in=Replica.TERMINAL)
        .values_list("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    by_state = {state: counted[state] for state in Replica.State.values if state in counted}  # in the states' order
    asked = last_requests()
    models = []
    for m in models_with_counts():
        shown = scaling_shown(m, asked)
        # `replicas`: the replicas it wants now (as `wanted`), kept for clients of before `wanted`
        models.append({"name": m.name, "mode": shown["mode"], "ready": shown["ready"], "wanted": shown["wanted"],
                       "replicas": shown["wanted"], "min_replicas": m.min_replicas, "max_replicas": m.max_replicas,
                       "replicas_text": shown["replicas_text"], "last_request_at": shown["last_request_at"],
                       "removing": m.removing, "placement_note": m.placement_note})
    return {
        "serving": "stopped" if settings_row.serving_stopped else "serving",
        "nodes": {"total": len(nodes), "connected": len(alive)},
        "models": list(models),
        "replicas": by_state,
    }


def rollout_shown(rollout: Rollout) -> dict:
    """A rollout as every front door shows it: its state in words, the change, its bounds, its replicas on each
    side, the window, and both sides' figures as last judged (cluster/rollouts.py) with the verdict so far."""
    model = rollout.model
    sides: dict[str, list[dict]] = {"canary": [], "current": []}
    for r in (Replica.objects.filter(model=model).exclude(state__in=Replica.TERMINAL)
              .select_related("node").order_by("name")):
        side = "canary" if r.rollout_id == rollout.pk else "current"
        sides[side].append({"name": r.name, "state": r.state, "node": r.node.name if r.node else None})
    left = None
    if rollout.watching_since is not None and rollout.state == Rollout.State.WATCHING:
        left = max(0, rollout.watch_seconds - int((timezone.now() - rollout.watching_since).total_seconds()))
    figures = rollout.figures or {}
    return {
        "model": model.name,
        "state": rollout.state,
        "state_text": rollout.get_state_display(),
        "change": rollout.change,
        "change_text": rollout.change_text(),
        "canary": rollout.canary,
        "traffic": rollout.traffic,
        "shadow": rollout.shadow,
        "watch_seconds": rollout.watch_seconds,
        "min_requests": rollout.min_requests,
        "max_error_rate": rollout.max_error_rate,
        "max_ttft_ratio": rollout.max_ttft_ratio,
        "max_tpot_ratio": rollout.max_tpot_ratio,
        "actor": rollout.actor,
        "started_at": rollout.started_at,
        "watching_since": rollout.watching_since,
        "window_left_seconds": left,
        "ended_at": rollout.ended_at,
        "reason": rollout.reason,
        "note": rollout.note,
        "verdict": figures.get("verdict", ""),
        "replicas": sides,
        "figures": {"canary": figures.get("canary"), "current": figures.get("current")},
    }
