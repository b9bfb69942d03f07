"""The reconciler: snapshot the cluster, ask the planner, apply its actions. One run at a time, under a Redis lock."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from datetime import timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cluster import autoscaler, inflight, notify, planner
from cluster.events import RECONCILE_QUEUED, record
from cluster.locks import redis_client
from cluster.memory import estimate, replica_threads
from cluster.models import ClusterSettings, Model, Node, Replica, Rollout
from cluster.planner.scaling import Scaling
from ground.engines import cores_taken

log = logging.getLogger("llmgw.reconciler")
ACTOR = "reconciler"
LOCK_KEY = "llmgw:reconcile:lock"
DIRTY_KEY = "llmgw:reconcile:dirty"
LAST_RUN_KEY = "llmgw:reconcile:last"
# seconds the lock outlives the last pass begun under it: a process killed in the middle of a run (a control plane
# lost) holds the others' reconcilers back this long at most. A run takes well under one; a pass slower than this
# lets another run begin beside it, which each replica change's conditional update makes safe
LOCK_TTL = 10
DEFAULT_PORT_RANGE = (20000, 20999)
WATCH_EVERY = 5  # seconds between a pass's writes of ClusterSettings.watched_at (a pass is every few seconds)


def _int(value) -> int:
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def take_snapshot(now=None) -> planner.Snapshot:
    now = now or timezone.now()
    cluster = ClusterSettings.load()
    nodes = tuple(
        planner.NodeView(
            id=n["id"],
            name=n["name"],
            connected=n["connected"],
            last_seen=n["last_seen"].timestamp() if n["last_seen"] else None,
            schedulable=n["schedulable"],
            draining=n["draining"],
            engines=frozenset((n["facts"] or {}).get("engines") or {}),
            memory_bytes=n["memory_bytes"],
            gpus=tuple(int(g.get("memory_bytes", 0)) for g in (n["facts"] or {}).get("gpus") or []),
            drain_force=n["drain_force"],
            drain_note=n["drain_note"],
            cpus=_int((n["facts"] or {}).get("cpu_count")),
        )
        for n in Node.objects.values(
            "id", "name", "connected", "last_seen", "schedulable", "draining", "facts", "memory_bytes",
            "drain_force", "drain_note",
        )
    )
    models = tuple(
        planner.ModelView(
            id=m["id"],
            name=m["name"],
            # an autoscaled model: what its autoscaler last wanted (cluster.autoscaler decides anew before planning)
            replicas=m["replicas"] if m["min_replicas"] is None else (
                m["demand__replicas"] if m["demand__replicas"] is not None else m["min_replicas"]),
            memory_bytes=m["memory_bytes"]
            or estimate(m["file__size"], m["file__gguf"] or {}, m["profile__context_size"]),
            engine_kind=m["engine__kind"],
            uses_gpu=m["engine__device"] == "gpu",
            nodes=frozenset(m["nodes"] or ()),
            removing=m["removing"],
            failures=m["failures"],
            backoff_until=m["backoff_until"].timestamp() if m["backoff_until"] else None,
            placement_note=m["placement_note"],
            scaling=None if m["min_replicas"] is None else Scaling(
                min=m["min_replicas"], max=max(m["max_replicas"] or 0, m["min_replicas"]), target=m["target_inflight"],
                idle_after=m["idle_after_seconds"], scale_down_delay=m["scale_down_delay_seconds"]),
            threads=cores_taken(m["engine__kind"], m["profile__threads"]),
        )
        for m in Model.objects.values(
            "id",
            "name",
            "replicas",
            "memory_bytes",
            "file__size",
            "file__gguf",
            "profile__context_size",
            "profile__threads",
            "engine__kind",
            "engine__device",
            "nodes",
            "removing",
            "failures",
            "backoff_until",
            "placement_note",
            "min_replicas",
            "max_replicas",
            "target_inflight",
            "idle_after_seconds",
            "scale_down_delay_seconds",
            "demand__replicas",
        )
    )
    models += _canary_views()
    replicas = tuple(
        planner.ReplicaView(
            id=r["id"],
            name=r["name"],
            # a rollout's canaries are a group of their own (cluster.reconciler._canary_views), of their model
            model_id=-r["rollout_id"] if r["rollout_id"] else r["model_id"],
            of_model=r["model_id"] if r["rollout_id"] else None,
            node_id=r["node_id"],
            state=r["state"],
            restart=r["restart"],
            memory_bytes=r["memory_bytes"],
            gpu_index=r["gpu_index"],
            state_changed_at=r["state_changed_at"].timestamp(),
            reason=r["reason"],
            waiting_for_room=r["waiting_for_room"],
            threads=replica_threads(r["snapshot"]) if r["node_id"] is not None else 0,
        )
        for r in Replica.objects.exclude(state__in=Replica.TERMINAL).values(
            "id", "name", "model_id", "node_id", "state", "restart", "memory_bytes", "gpu_index",
            "state_changed_at", "reason", "waiting_for_room", "snapshot", "rollout_id",
        )
    )
    return planner.Snapshot(
        now=now.timestamp(),
        nodes=nodes,
        models=models,
        replicas=replicas,
        serving_stopped=cluster.serving_stopped,
        node_tolerance=settings.LLMGW_NODE_TOLERANCE,
        node_lost_grace=settings.LLMGW_NODE_LOST_GRACE,
        away=(cluster.away_from.timestamp(), cluster.away_until.timestamp())
        if cluster.away_from and cluster.away_until else None,
        drain_grace=cluster.drain_grace_seconds,
        inflight=inflight.totals(redis_client()),
        min_resident=cluster.min_resident_seconds,
    )


def _canary_views() -> tuple[planner.ModelView, ...]:
    """Each rollout's canary replicas as a group the planner places like a model's (id: minus the rollout's):
    its canaries while it watches, none once it does not (they drain and stop). A canary engine that failed
    rolls its rollout back (cluster/operations/rollouts.py): none is placed again meanwhile."""
    alive = Q(canaries__state__in=[*Replica.RUNNING, Replica.State.STOPPING])
    rows = Rollout.objects.filter(Q(state=Rollout.State.WATCHING) | alive).distinct().select_related(
        "model__file", "model__profile", "model__engine", "file", "profile", "engine")
    views = []
    for r in rows:
        m = r.model
        file, profile, engine = r.file or m.file, r.profile or m.profile, r.engine or m.engine
        wanted = r.state == Rollout.State.WATCHING and not r.failures and not m.removing
        views.append(planner.ModelView(
            id=-r.pk,
            name=f"{m.name} (canary)",
            replicas=r.canary if wanted else 0,
            memory_bytes=(r.memory_bytes if "memory" in r.change else m.memory_bytes)
            or estimate(file.size, file.gguf or {}, profile.context_size),
            engine_kind=engine.kind,
            uses_gpu=engine.device == "gpu",
            nodes=frozenset(m.nodes or ()),
            placement_note=r.note,
            threads=cores_taken(engine.kind, profile.threads),
            canary_of=m.name,
        ))
    return tuple(views)


class _Applier:
    """Applies planner actions inside one transaction; remembers which nodes' desired lists changed."""

    def __init__(self, snapshot: planner.Snapshot, now):
        self.now = now
        self.snapshot = snapshot
        self.nodes = {n.id: n for n in snapshot.nodes}
        self.models = {m.id: m for m in snapshot.models}
        self.replicas = {r.id: r for r in snapshot.replicas}
        self.touched_nodes: set[int] = set()
        self._ports: dict[int, set[int]] = {}
        self._port_ranges: dict[int, tuple[int, int]] = {}
        self._cluster: ClusterSettings | None = None
        self._model_rows: dict[int, Model] = {}
        self._rollouts: dict[int, Rollout] = {}

    def cluster(self):
        if self._cluster is None:
            self._cluster = ClusterSettings.load()
        return self._cluster

    def take_port(self, node_id: int) -> int | None:
        """A port of the node's range no live replica of it holds; None when all are taken."""
        used = self._ports.get(node_id)
        if used is None:
            ports = (
                Replica.objects.filter(node_id=node_id, port__isnull=False)
                .exclude(state__in=Replica.TERMINAL)
                .values_list("port", flat=True)
            )
            used = {port for port in ports if port is not None}  # (the query leaves out replicas without a port)
            self._ports[node_id] = used
            node_facts = Node.objects.filter(pk=node_id).values_list("facts", flat=True).first() or {}
            self._port_ranges[node_id] = (node_facts.get("port_range") or DEFAULT_PORT_RANGE)[:2]
        low, high = self._port_ranges[node_id]
        free = [p for p in range(int(low), int(high) + 1) if p not in used]
        if not free:
            return None
        port = random.choice(free)
        used.add(port)
        return port

    def no_port_reason(self, node_id: int) -> str:
        low, high = self._port_ranges[node_id]
        return f"node {self.nodes[node_id].name} has no free port in {low}-{high}"

    def snapshot_of(self, model: Model, rollout: Rollout | None = None) -> dict:
        """What a replica of the model starts with: its settings, or a canary's, its rollout's."""
        cluster = self.cluster()
        profile, engine, file = model.profile, model.engine, model.file
        if rollout is not None:
            profile, engine, file = rollout.profile or profile, rollout.engine or engine, rollout.file or file
        return {
            "profile": profile.name,
            "args": profile.args(),
            "engine": engine.spec(),
            "file": file.sha256,
            "engine_key": ClusterSettings.fingerprint(cluster.engine_key),
        }

    def owner(self, model_id: int) -> tuple[Model, Rollout | None]:
        """The model a replica group is of, and the rollout when the group is its canaries (a negative id)."""
        if model_id > 0:
            return self.model(model_id), None
        if -model_id not in self._rollouts:
            self._rollouts[-model_id] = Rollout.objects.select_related(
                "model__profile", "model__engine", "model__file", "profile", "engine", "file").get(pk=-model_id)
        rollout = self._rollouts[-model_id]
        return rollout.model, rollout

    def set_state(self, replica_id: int, state: str, reason: str, **extra) -> planner.ReplicaView | None:
        """Conditional on the state the plan was made from: a state an agent's report wrote meanwhile (it
        failed, it stopped) is never overwritten; the next run decides again from it."""
        replica = self.replicas[replica_id]
        n = Replica.objects.filter(pk=replica_id, state=replica.state).update(
            state=state, reason=reason[:500], state_changed_at=self.now, **extra
        )
        if not n:
            return None
        self.replicas[replica_id] = dataclasses.replace(replica, state=state)
        if replica.node_id:
            self.touched_nodes.add(replica.node_id)
        return replica

    def apply(self, action) -> None:
        getattr(self, "on_" + type(action).__name__)(action)

    def on_MarkNodeDisconnected(self, a: planner.MarkNodeDisconnected):
        # conditional on the silence the plan saw: a report that came meanwhile (a newer last_seen) keeps it
        silent_since = self.now - timedelta(seconds=self.snapshot.node_tolerance)
        still_silent = Q(last_seen__isnull=True) | Q(last_seen__lt=silent_since)
        if not Node.objects.filter(still_silent, pk=a.node_id, connected=True).update(connected=False):
            return
        name = self.nodes[a.node_id].name
        record("node.disconnected", ACTOR, f"node {name} disconnected: {a.reason}", subject=name)

    def prefetch_models(self, actions) -> None:
        """Load, in one query, the models whose replicas the actions create or place (else a query each)."""
        ids = {a.model_id for a in actions if isinstance(a, (planner.Create, planner.Unplaceable))}
        ids |= {self.replicas[a.replica_id].model_id for a in actions if isinstance(a, planner.Assign)}
        ids -= self._model_rows.keys()
        ids = {i for i in ids if i > 0}  # (a rollout's canaries: cluster.reconciler._canary_views)
        if ids:
            self._model_rows.update(Model.objects.select_related("profile", "engine", "file").in_bulk(ids))

    def model(self, model_id: int) -> Model:
        if model_id not in self._model_rows:
            self._model_rows[model_id] = Model.objects.select_related("profile", "engine", "file").get(pk=model_id)
        return self._model_rows[model_id]

    def on_Create(self, a: planner.Create):
        model, rollout = self.owner(a.model_id)
        node = self.nodes[a.node_id]
        port = self.take_port(a.node_id)
        if port is None:  # the memory fits but every port is taken: wait unplaced, saying why (not fail the run)
            self.on_Unplaceable(planner.Unplaceable(a.model_id, None, self.no_port_reason(a.node_id), a.memory_bytes))
            return
        replica = Replica.objects.create(
            name=Replica.new_name(model.name),
            model=model,
            node_id=a.node_id,
            gpu_index=a.gpu_index,
            port=port,
            memory_bytes=a.memory_bytes,
            snapshot=self.snapshot_of(model, rollout),
            state_changed_at=self.now,
            rollout=rollout,
        )
        self.touched_nodes.add(a.node_id)
        where = f"{node.name}" + (f" GPU {a.gpu_index}" if a.gpu_index is not None else "")
        what = "canary replica" if rollout else "replica"
        record("replica.placed", ACTOR, f"{what} {replica.name} placed on {where}", subject=replica.name)

    def on_Assign(self, a: planner.Assign):
        replica = self.replicas[a.replica_id]
        model, rollout = self.owner(replica.model_id)
        port = self.take_port(a.node_id)
        if port is None:
            reason = self.no_port_reason(a.node_id)
            if reason != replica.reason:
                self.on_Unplaceable(planner.Unplaceable(replica.model_id, a.replica_id, reason))
            return
        n = Replica.objects.filter(pk=a.replica_id, state=Replica.State.PENDING, node__isnull=True).update(
            node_id=a.node_id,
            gpu_index=a.gpu_index,
            port=port,
            memory_bytes=self.models[replica.model_id].memory_bytes,
            reason="",
            waiting_for_room=False,
            snapshot=self.snapshot_of(model, rollout),
            state_changed_at=self.now,
        )
        if n:
            self.touched_nodes.add(a.node_id)
            record(
                "replica.placed", ACTOR, f"replica {replica.name} placed on {self.nodes[a.node_id].name}",
                subject=replica.name,
            )

    def on_Unplaceable(self, a: planner.Unplaceable):
        model, rollout = self.owner(a.model_id)
        if a.replica_id is None:
            replica = Replica.objects.create(
                name=Replica.new_name(model.name),
                model=model,
                rollout=rollout,
                memory_bytes=a.memory_bytes,
                reason=a.reason[:500],
                waiting_for_room=a.waiting_for_room,
                state_changed_at=self.now,
            )
            name = replica.name
        else:
            Replica.objects.filter(pk=a.replica_id).update(reason=a.reason[:500], waiting_for_room=a.waiting_for_room)
            name = self.replicas[a.replica_id].name
        if a.waiting_for_room:
            record("replica.waiting", ACTOR, f"replica {name} waits for room: {a.reason}", subject=name)
        else:
            record("replica.unplaceable", ACTOR, f"replica {name} cannot be placed: {a.reason}", subject=name)

    def on_Evict(self, a: planner.Evict):
        replica = self.set_state(a.replica_id, Replica.State.DRAINING, a.reason)
        if replica:
            model = self.models[replica.model_id]
            record("replica.evicted", ACTOR, f"replica {replica.name} evicted: {a.reason}", subject=replica.name,
                   model=model.name, for_model=a.for_model, inflight=a.inflight)
            autoscaler.evicted(model.id, model.name, f"evicted to make room for model {a.for_model}")

    def on_Drain(self, a: planner.Drain):
        replica = self.set_state(a.replica_id, Replica.State.DRAINING, a.reason)
        if replica:
            if a.outage:  # the one case where the system chooses an outage: the log says so plainly
                record(
                    "replica.draining", ACTOR, f"replica {replica.name} draining, an outage chosen: {a.reason}",
                    subject=replica.name, outage=True,
                )
            else:
                record("replica.draining", ACTOR, f"replica {replica.name} draining: {a.reason}", subject=replica.name)

    def on_Stop(self, a: planner.Stop):
        replica = self.replicas[a.replica_id]
        state = Replica.State.STOPPING if replica.node_id else Replica.State.STOPPED
        if self.set_state(a.replica_id, state, a.reason):
            record(f"replica.{state}", ACTOR, f"replica {replica.name} {state}: {a.reason}", subject=replica.name)

    def still_lost(self, replica_id: int) -> bool:
        """Is the replica's node still gone (removed, or silent past the lost grace) as the plan saw it? A report
        that landed meanwhile (one that waited on a lock) keeps its node, and its replicas, as they are."""
        node_id = self.replicas[replica_id].node_id
        if node_id is None:
            return True
        lost_since = self.now - timedelta(seconds=self.snapshot.node_lost_grace)
        return not Node.objects.filter(pk=node_id, connected=True, last_seen__gte=lost_since).exists()

    def on_Fail(self, a: planner.Fail):
        if not self.still_lost(a.replica_id):
            return
        replica = self.set_state(a.replica_id, Replica.State.FAILED, a.reason)
        if replica:
            record("replica.failed", ACTOR, f"replica {replica.name} failed: {a.reason}", subject=replica.name)

    def on_MarkStopped(self, a: planner.MarkStopped):
        if not self.still_lost(a.replica_id):
            return
        replica = self.set_state(a.replica_id, Replica.State.STOPPED, a.reason)
        if replica:
            record("replica.stopped", ACTOR, f"replica {replica.name} stopped: {a.reason}", subject=replica.name)

    def on_SetModelNote(self, a: planner.SetModelNote):
        if a.model_id < 0:  # a rollout's canaries (why they are not placed)
            Rollout.objects.filter(pk=-a.model_id).update(note=a.note[:500])
            return
        Model.objects.filter(pk=a.model_id).update(placement_note=a.note[:500])

    def on_MarkReplacing(self, a: planner.MarkReplacing):
        replica = self.replicas[a.replica_id]
        n = Replica.objects.filter(
            pk=a.replica_id,
            restart__in=(Replica.Restart.NONE, Replica.Restart.QUEUED),
            state__in=Replica.COUNTING,
        ).update(restart=Replica.Restart.REPLACING)
        if not n:
            return  # it changed meanwhile (failed, stopped): the next run sees it as it is
        if a.room:
            assert replica.node_id is not None  # the planner replaces placed replicas only
            where = "elsewhere" if self.nodes[replica.node_id].draining else "beside it"
            then = f"a new replica starts {where}; it keeps serving until that one is ready"
        else:
            then = "no room for a second copy: it stops first and the new one starts in its place"
        record("replica.replacing", ACTOR, f"replica {replica.name} being replaced ({a.reason}): {then}",
               subject=replica.name)

    def on_SetNodeNote(self, a: planner.SetNodeNote):
        Node.objects.filter(pk=a.node_id).update(drain_note=a.note[: planner.NOTE_MAX])
        name = self.nodes[a.node_id].name
        if a.note:
            record("node.drain_blocked", ACTOR, f"drain of node {name} blocked: {a.note}", subject=name)
        elif self.nodes[a.node_id].draining:
            record("node.drain_unblocked", ACTOR, f"drain of node {name} goes on", subject=name)

    def on_DeleteModel(self, a: planner.DeleteModel):
        name = self.models[a.model_id].name
        Model.objects.filter(pk=a.model_id, removing=True).delete()
        record("model.removed", ACTOR, f"model {name} removed: all its replicas stopped", subject=name)


def watch(now) -> None:
    """This pass watches the nodes: said in the database every WATCH_EVERY seconds. The last pass longer ago than
    the interval, the node tolerance and that allow means no control plane ran meanwhile (all were stopped): the
    stretch is kept (`away_from`, `away_until`), and the planner does not count it as any node's silence, so
    after a restart every agent has its tolerance and lost grace to reconnect, and its node's replicas are not
    failed (nor requests for them refused) while it does."""
    cluster = ClusterSettings.load()
    last = cluster.watched_at
    gap = None if last is None else (now - last).total_seconds()
    if gap is not None and gap < WATCH_EVERY:
        return
    rows = ClusterSettings.objects.filter(pk=cluster.pk, watched_at=last)  # one pass says it, should two race
    if gap is None or gap <= cluster.reconcile_interval_seconds + settings.LLMGW_NODE_TOLERANCE + WATCH_EVERY:
        rows.update(watched_at=now)
        return
    with transaction.atomic():
        if rows.update(watched_at=now, away_from=last, away_until=now):
            record("control_plane.away", ACTOR, f"the reconciler runs again after {int(gap)}s with none: the nodes' "
                   "silence meanwhile is not counted (their agents reconnect within the node tolerance, "
                   f"{settings.LLMGW_NODE_TOLERANCE}s, and their replicas count for the lost grace, "
                   f"{settings.LLMGW_NODE_LOST_GRACE}s)", away_seconds=int(gap))


def reconcile_once() -> int:
    """One pass: snapshot, autoscale, plan, apply. Returns how many actions were applied."""
    now = timezone.now()
    watch(now)
    snapshot, scaled = autoscaler.scale(take_snapshot(now), redis_client())
    actions = planner.plan(snapshot)
    if not actions:
        if scaled.states:
            with transaction.atomic():
                autoscaler.save(scaled)
        return 0
    with transaction.atomic():
        autoscaler.save(scaled)
        applier = _Applier(snapshot, now)
        applier.prefetch_models(actions)
        for action in actions:
            applier.apply(action)
        notify.desired_changed(applier.touched_nodes)
        notify.routing_changed()
    return len(actions)


def reconcile(max_passes: int = 5) -> int | None:
    """Run under the lock; if someone asked again meanwhile (dirty), run again. None if another run holds it."""
    r = redis_client()
    r.delete(RECONCILE_QUEUED)  # begun: a change from now on queues the next run
    r.set(DIRTY_KEY, 1, ex=60)
    lock = r.lock(LOCK_KEY, timeout=LOCK_TTL, blocking=False)
    if not lock.acquire():
        return None  # the holder will see the dirty flag and go round again
    applied = 0
    try:
        for i in range(max_passes):
            if not r.delete(DIRTY_KEY):
                break
            if i:
                try:
                    lock.reacquire()  # LOCK_TTL from now, for this pass
                except redis.exceptions.LockError:  # lapsed under a slow pass: the run holding it now goes round
                    r.set(DIRTY_KEY, 1, ex=60)
                    break
            applied += reconcile_once()
            r.set(LAST_RUN_KEY, time.time(), ex=3600)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # it expired under a very slow run; nothing of ours to release
            pass
    return applied


def due() -> bool:
    """Beat ticks every second; run when the cluster's interval has passed since the last run."""
    last = redis_client().get(LAST_RUN_KEY)
    interval = ClusterSettings.load().reconcile_interval_seconds
    # less half a tick: beat's one-second ticks come a little early or late, and a run due in 0.99 s should not
    # wait a whole tick more
    return last is None or time.time() - float(last) >= interval - 0.5
