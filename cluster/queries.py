"""The questions every front door asks of the cluster, each answered once: the CLI, the REST API and the
dashboard show the same figures because they ask here."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from cluster.models import ClusterSettings, Demand, EngineVersion, Model, Node, Replica
from cluster.planner.capacity import HOLDS_MEMORY, MemoryInUse


def nodes_with_counts() -> QuerySet[Node]:
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


def scaling_shown(model: Model) -> dict:
    """How a model scales and where it stands, as `ctl models`, `GET /api/v1/models/` and the Models page show it:
    its mode (fixed, autoscaled, on-demand), the replicas it wants now, its range and knobs, its last request and,
    on demand and loaded, when it goes idle."""
    demand = _demand(model)
    shown = {"mode": model.mode, "wanted": model.replicas, "min_replicas": model.min_replicas,
             "max_replicas": model.max_replicas, "target_inflight": None, "idle_after_seconds": None,
             "scale_down_delay_seconds": None, "last_request_at": None, "idle_at": None}
    if not model.autoscaled:
        return shown
    last = demand.last_request_at if demand else None
    wanted = demand.replicas if demand else model.min_replicas
    shown.update(wanted=wanted, target_inflight=model.target_inflight, idle_after_seconds=model.idle_after_seconds,
                 scale_down_delay_seconds=model.scale_down_delay_seconds, last_request_at=last)
    if model.on_demand and wanted and last:
        shown["idle_at"] = last + timedelta(seconds=model.idle_after_seconds)
    return shown


def _demand(model: Model) -> Demand | None:
    try:
        return model.demand
    except Demand.DoesNotExist:
        return None


def memory_in_use(nodes=None) -> MemoryInUse:
    """Memory the replicas hold on each node (RAM, and each GPU's by index), counted by the rule placement
    counts it with (cluster.planner.capacity). `nodes`: the Node rows already at hand (else read)."""
    rows = nodes if nodes is not None else Node.objects.only("pk", "facts")
    gpu_counts = {n.pk: len(n.gpus) for n in rows}
    used = MemoryInUse()
    held = Replica.objects.filter(node__isnull=False, state__in=HOLDS_MEMORY)
    for node_id, state, gpu_index, memory_bytes in held.values_list("node_id", "state", "gpu_index", "memory_bytes"):
        used.add(node_id, gpu_counts.get(node_id, 0), state, gpu_index, memory_bytes)
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


def cluster_settings_shown(cluster: ClusterSettings | None = None) -> dict:
    """The cluster settings as `ctl settings` and `GET /api/v1/settings/` show them (never the engine key)."""
    cluster = cluster or ClusterSettings.load()
    return {
        "drain_grace_seconds": cluster.drain_grace_seconds,
        "reconcile_interval_seconds": cluster.reconcile_interval_seconds,
        "min_resident_seconds": cluster.min_resident_seconds,
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
