"""The reconciler's decision, as a pure function: a snapshot of the cluster in, a list of actions out.

No database, no network, no clock of its own: `Snapshot.now` is the time. Tested on plain data
(tests/cluster/test_planner.py) and benchmarked at fleet sizes (bench/reconcile.py).
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_left, insort
from collections.abc import Mapping
from dataclasses import dataclass, field

# Replica states, as plain strings (cluster.models.Replica.State holds the same values).
PENDING, DOWNLOADING, STARTING, READY = "pending", "downloading", "starting", "ready"
DRAINING, STOPPING, STOPPED, FAILED = "draining", "stopping", "stopped", "failed"
COUNTING = frozenset({PENDING, DOWNLOADING, STARTING, READY})
RUNNING = frozenset({PENDING, DOWNLOADING, STARTING, READY, DRAINING})  # hold memory, in the node's desired list
TERMINAL = frozenset({STOPPED, FAILED})
RESTART_NONE, RESTART_QUEUED, RESTART_REPLACING = "none", "queued", "replacing"
NOTE_MAX = 500  # the longest note a model or node keeps


@dataclass(frozen=True)
class NodeView:
    id: int
    name: str
    connected: bool
    last_seen: float | None  # epoch seconds
    schedulable: bool
    draining: bool
    engines: frozenset[str]  # driver kinds installed
    memory_bytes: int  # RAM offered for replicas
    gpus: tuple[int, ...] = ()  # memory of each GPU, by index
    drain_force: bool = False  # draining with --force: a replica with nowhere else to go is stopped anyway
    drain_note: str = ""  # why the drain is blocked, as last written


@dataclass(frozen=True)
class ModelView:
    id: int
    name: str
    replicas: int
    memory_bytes: int  # per replica
    engine_kind: str
    uses_gpu: bool
    nodes: frozenset[str] = frozenset()  # allowed node names; empty: any
    removing: bool = False
    failures: int = 0
    backoff_until: float | None = None
    placement_note: str = ""


@dataclass(frozen=True)
class ReplicaView:
    id: int
    name: str
    model_id: int
    node_id: int | None  # None: not placed yet (pending, with `reason`)
    state: str
    restart: str = RESTART_NONE
    memory_bytes: int = 0
    gpu_index: int | None = None
    state_changed_at: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[NodeView, ...]
    models: tuple[ModelView, ...]
    replicas: tuple[ReplicaView, ...]  # non-terminal ones; terminal replicas need not be passed
    serving_stopped: bool = False
    node_tolerance: float = 15.0  # a connected node silent this long is disconnected
    node_lost_grace: float = 60.0  # a disconnected node's replicas stop counting after this long
    drain_grace: float = 300.0
    inflight: Mapping[str, int] = field(default_factory=dict)  # replica name -> requests in flight


# Actions. The reconciler applies them in order, in one transaction, and writes an Event for each.


@dataclass(frozen=True)
class MarkNodeDisconnected:
    node_id: int
    reason: str


@dataclass(frozen=True)
class Create:
    """A new replica of the model, pending on the node (and GPU, for GPU engines)."""

    model_id: int
    node_id: int
    gpu_index: int | None
    memory_bytes: int


@dataclass(frozen=True)
class Assign:
    """An unplaced pending replica found a node."""

    replica_id: int
    node_id: int
    gpu_index: int | None


@dataclass(frozen=True)
class Unplaceable:
    """A replica that cannot be placed now, and why. replica_id None: create a pending, unplaced one."""

    model_id: int
    replica_id: int | None
    reason: str
    memory_bytes: int = 0


@dataclass(frozen=True)
class Drain:
    """No new requests; stopped once idle or after the drain grace. `outage`: no copy of it serves meanwhile."""

    replica_id: int
    reason: str
    outage: bool = False


@dataclass(frozen=True)
class Stop:
    """Ask the agent to stop it (state stopping), or, when it is on no node, mark it stopped."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class Fail:
    """The replica is gone with its node (lost longer than the grace period)."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class MarkStopped:
    """A stopping replica whose node is gone: nothing is left to stop."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class SetModelNote:
    model_id: int
    note: str


@dataclass(frozen=True)
class DeleteModel:
    model_id: int


@dataclass(frozen=True)
class MarkReplacing:
    """A restart (or a node drain) begins for this replica: it keeps serving but stops counting, so a
    replacement is placed. `room` False: no second copy fits anywhere, so it stops first (an outage)."""

    replica_id: int
    reason: str  # "restart queued", "node n1 is draining"
    room: bool = True


@dataclass(frozen=True)
class SetNodeNote:
    """Why a draining node's drain is blocked ("" once it is not)."""

    node_id: int
    note: str


Action = (
    MarkNodeDisconnected
    | Create
    | Assign
    | Unplaceable
    | Drain
    | Stop
    | Fail
    | MarkStopped
    | SetModelNote
    | DeleteModel
    | MarkReplacing
    | SetNodeNote
)


def plan(snapshot: Snapshot) -> list[Action]:
    """Everything the reconciler should do now to move the cluster one step toward what the models ask.

    The order of the actions is the order of concern: nodes first (disconnects, lost nodes' replicas),
    then each model by name (surplus, finished drains, deletion, restarts, placement, hand-overs, its
    note), then replicas of models that are gone, then the notes of draining nodes. The same snapshot
    always gives the same list.

    Restarts and node drains replace one replica of a model at a time, different models in parallel.
    A replica to replace (restart `queued`, or on a draining node) is marked `replacing` only while no
    other replica of its model is being replaced and the model is whole (as many counting replicas as it
    wants, all placed and ready). Marked, it keeps serving but stops counting, so a replacement is placed;
    once the model is whole again, it drains and stops. Where the replacement fits nowhere:
    - if freeing the replica's own memory makes room (a restart on a full fleet), it drains now and the
      new one starts in its place: the one case with an outage, and the Drain says so;
    - else (its node drains, or it no longer fits where it is) it keeps serving, and the model's note
      and the draining node's note say the drain or restart is blocked; a node drained with force stops
      it anyway (drain, then stop once idle or after the grace).
    """
    return _Planner(snapshot).run()


# --- formatting -------------------------------------------------------------------------------------

_GIB = 1024**3
_MIB = 1024**2


def format_bytes(n: int) -> str:
    """GiB with one decimal; MiB (one decimal) below 1 GiB."""
    if abs(n) >= _GIB:
        return f"{n / _GIB:.1f} GiB"
    return f"{n / _MIB:.1f} MiB"


def _seconds(x: float) -> str:
    """A configured duration: 300.0 -> '300s', 2.5 -> '2.5s'."""
    return f"{x:g}s"


def _names(names) -> str:
    return ", ".join(sorted(names))


# --- placement ----------------------------------------------------------------------------------------


class _NodeState:
    """A candidate node (alive, schedulable, not draining) and what is free on it, updated as we place."""

    __slots__ = ("node", "id", "name", "free_ram", "free_gpu")

    def __init__(self, node: NodeView, used_ram: int, used_gpu: list[int] | None):
        self.node = node
        self.id = node.id
        self.name = node.name
        self.free_ram = node.memory_bytes - used_ram
        self.free_gpu = [mem - (used_gpu[i] if used_gpu else 0) for i, mem in enumerate(node.gpus)]


class _Fleet:
    """The candidate nodes, with sorted free-memory indexes per engine kind (built on first use).

    A CPU index holds (free RAM, name, node id) for every candidate with the engine; a GPU index holds
    (free memory, name, GPU index, node id) for every GPU of those candidates. Both ascend, so the
    first entry at or above a model's memory is the fullest place that fits (bin-packing).
    """

    def __init__(self, candidates: list[_NodeState]):
        self.by_id = {ns.id: ns for ns in candidates}
        self.by_name = {ns.name: ns for ns in candidates}
        self.by_engine: dict[str, list[_NodeState]] = {}
        for ns in sorted(candidates, key=lambda ns: (ns.name, ns.id)):
            for kind in ns.node.engines:
                self.by_engine.setdefault(kind, []).append(ns)
        self._cpu: dict[str, list[tuple]] = {}
        self._gpu: dict[str, list[tuple]] = {}

    def cpu_index(self, kind: str) -> list[tuple]:
        idx = self._cpu.get(kind)
        if idx is None:
            idx = sorted((ns.free_ram, ns.name, ns.id) for ns in self.by_engine.get(kind, ()))
            self._cpu[kind] = idx
        return idx

    def gpu_index(self, kind: str) -> list[tuple]:
        idx = self._gpu.get(kind)
        if idx is None:
            idx = sorted(
                (free, ns.name, i, ns.id) for ns in self.by_engine.get(kind, ()) for i, free in enumerate(ns.free_gpu)
            )
            self._gpu[kind] = idx
        return idx

    def commit(self, ns: _NodeState, gpu: int | None, memory: int) -> None:
        """Account a placement: the node (or its GPU) has `memory` less free, in every built index."""
        if gpu is None:
            old = (ns.free_ram, ns.name, ns.id)
            ns.free_ram -= memory
            new = (ns.free_ram, ns.name, ns.id)
            indexes = self._cpu
        else:
            old = (ns.free_gpu[gpu], ns.name, gpu, ns.id)
            ns.free_gpu[gpu] -= memory
            new = (ns.free_gpu[gpu], ns.name, gpu, ns.id)
            indexes = self._gpu
        for kind in ns.node.engines:
            idx = indexes.get(kind)
            if idx is not None:
                _replace(idx, old, new)


def _replace(idx: list, old: tuple, new: tuple) -> None:
    i = bisect_left(idx, old)
    del idx[i]
    insort(idx, new)


def _best_gpu(ns: _NodeState, memory: int) -> tuple[int, int] | None:
    """(free, index) of the fullest GPU of the node that still fits `memory`; lowest index on a tie."""
    best = None
    for i, free in enumerate(ns.free_gpu):
        if free >= memory and (best is None or free < best[0]):
            best = (free, i)
    return best


class _ModelPlacer:
    """Places replicas of one model, one at a time, and says why when it cannot.

    Choice among the nodes that fit: fewest running replicas of this model (spread before stacking),
    then least memory left after placing (on the chosen GPU for GPU engines), then name.

    Two ways to find it, the same answer:
    - shared: walk the fleet's sorted index from the model's memory up; the first (allowed) node
      holding none of this model wins. Only when there is none, look at the (few) nodes that hold
      some. Cheap for a model placing a few replicas on most of the fleet, the common case.
    - private: sorted lists per level (replicas of this model already on the node), built from this
      model's candidates once. Used for a model allowed on few nodes, one placing many replicas, or
      one already on many nodes, where walking the shared index would skip too much.
    """

    SHARED_MAX_BATCH = 16
    SHARED_MAX_HOLDERS = 64

    def __init__(self, fleet: _Fleet, model: ModelView, counts: dict[int, int], batch: int):
        self.fleet = fleet
        self.model = model
        self.counts = counts  # node id -> running replicas of this model; updated as we place
        self.memory = model.memory_bytes
        self.gpu = model.uses_gpu
        self.allowed = model.nodes
        kind = model.engine_kind
        self.levels: dict[int, list[tuple]] | None = None
        private = batch > self.SHARED_MAX_BATCH or len(counts) > self.SHARED_MAX_HOLDERS
        if model.nodes and not private:
            # Walking the shared index skips about (nodes / allowed) nodes per replica placed; private
            # lists cost about (allowed) to build.
            private = len(model.nodes) ** 2 <= max(1, batch) * len(fleet.by_engine.get(kind, ()))
        if private:
            if model.nodes:
                nodes = sorted(
                    (ns for name in model.nodes if (ns := fleet.by_name.get(name)) and kind in ns.node.engines),
                    key=lambda ns: (ns.name, ns.id),
                )
            else:
                nodes = fleet.by_engine.get(kind, ())
            self._build_levels(nodes)

    # private levels

    def _entries(self, ns: _NodeState) -> list[tuple]:
        if self.gpu:
            return [(free, ns.name, i, ns.id) for i, free in enumerate(ns.free_gpu)]
        return [(ns.free_ram, ns.name, None, ns.id)]

    def _build_levels(self, nodes) -> None:
        levels: dict[int, list[tuple]] = {}
        for ns in nodes:
            levels.setdefault(self.counts.get(ns.id, 0), []).extend(self._entries(ns))
        for entries in levels.values():
            entries.sort()
        self.levels = levels

    def _place_private(self) -> tuple[_NodeState, int | None] | None:
        key = (self.memory,)
        for level in sorted(self.levels):
            entries = self.levels[level]
            i = bisect_left(entries, key)
            if i < len(entries):
                _, _, gpu, node_id = entries[i]
                ns = self.fleet.by_id[node_id]
                for entry in self._entries(ns):  # the node moves up a level, with its new free memory
                    del entries[bisect_left(entries, entry)]
                if not entries:
                    del self.levels[level]
                return ns, gpu
        return None

    def _after_private(self, ns: _NodeState) -> None:
        entries = self.levels.setdefault(self.counts[ns.id], [])
        for entry in self._entries(ns):
            insort(entries, entry)

    # shared index

    def _place_shared(self) -> tuple[_NodeState, int | None] | None:
        fleet, counts, memory = self.fleet, self.counts, self.memory
        kind = self.model.engine_kind
        idx = fleet.gpu_index(kind) if self.gpu else fleet.cpu_index(kind)
        allowed = self.allowed
        for j in range(bisect_left(idx, (memory,)), len(idx)):
            entry = idx[j]
            node_id = entry[-1]
            if node_id not in counts and (not allowed or entry[1] in allowed):
                return fleet.by_id[node_id], (entry[2] if self.gpu else None)
        # Every node that fits holds some already: the fewest, then the fullest that fits, then name.
        best = None
        for node_id, count in counts.items():
            ns = fleet.by_id.get(node_id)
            if ns is None or kind not in ns.node.engines or (allowed and ns.name not in allowed):
                continue
            if self.gpu:
                fit = _best_gpu(ns, memory)
                if fit is None:
                    continue
                key = (count, fit[0] - memory, ns.name, fit[1])
            else:
                if ns.free_ram < memory:
                    continue
                key = (count, ns.free_ram - memory, ns.name, None)
            if best is None or key < best[0]:
                best = (key, ns)
        if best is None:
            return None
        return best[1], best[0][3]

    def place(self) -> tuple[_NodeState, int | None] | None:
        found = self._place_private() if self.levels is not None else self._place_shared()
        if found is None:
            return None
        ns, gpu = found
        self.fleet.commit(ns, gpu, self.memory)
        self.counts[ns.id] = self.counts.get(ns.id, 0) + 1
        if self.levels is not None:
            self._after_private(ns)
        return found


# --- the planner ----------------------------------------------------------------------------------------


class _Planner:
    def __init__(self, snapshot: Snapshot):
        self.s = snapshot
        self.actions: list[Action] = []
        self.blocked: dict[int, list[str]] = {}  # draining node id -> why its drain is blocked

    def run(self) -> list[Action]:
        s = self.s
        self._nodes()
        by_model = self._replicas()
        models = sorted(s.models, key=lambda m: (m.name, m.id))
        known = set()
        for m in models:
            known.add(m.id)
            self._model(m, by_model.get(m.id, []))
        for model_id in sorted(set(by_model) - known):
            self._orphans(by_model[model_id])
        self._node_notes()
        return self.actions

    # 1. nodes

    def _nodes(self) -> None:
        s, now = self.s, self.s.now
        self.nodes = {n.id: n for n in s.nodes}
        self.nodes_by_name = {n.name: n for n in s.nodes}
        self.alive: set[int] = set()
        self.lost: set[int] = set()
        for n in sorted(s.nodes, key=lambda n: (n.name, n.id)):
            silent = None if n.last_seen is None else now - n.last_seen
            alive = n.connected and silent is not None and silent <= s.node_tolerance
            if alive:
                self.alive.add(n.id)
                continue
            if n.connected:
                reason = (
                    "the agent has never reported" if silent is None else f"no word from the agent for {int(silent)}s"
                )
                self.actions.append(MarkNodeDisconnected(n.id, reason))
            if silent is None or silent > s.node_lost_grace:
                self.lost.add(n.id)

    def _replicas(self) -> dict[int, list[ReplicaView]]:
        """Fail what went with a lost node; group the rest by model; account memory and spread."""
        used_ram: dict[int, int] = {}
        used_gpu: dict[int, list[int]] = {}
        self.holders: dict[int, dict[int, int]] = {}  # model id -> node id -> running replicas there
        self.live_models: set[int] = set()  # models with a non-terminal replica in the snapshot
        by_model: dict[int, list[ReplicaView]] = {}
        nodes, lost = self.nodes, self.lost
        for r in sorted(self.s.replicas, key=lambda r: r.id):
            if r.state in TERMINAL:
                continue
            self.live_models.add(r.model_id)
            node_id = r.node_id
            if node_id is not None:
                node = nodes.get(node_id)
                if node is None or node_id in lost:
                    why = f"node {node.name} lost" if node is not None else f"node #{node_id} is gone"
                    if r.state in RUNNING:
                        self.actions.append(Fail(r.id, why))
                        continue
                    if r.state == STOPPING:
                        self.actions.append(MarkStopped(r.id, why))
                        continue
                elif r.state in RUNNING or r.state == STOPPING:
                    if r.gpu_index is None:
                        used_ram[node_id] = used_ram.get(node_id, 0) + r.memory_bytes
                    elif 0 <= r.gpu_index < len(node.gpus):
                        per_gpu = used_gpu.get(node_id)
                        if per_gpu is None:
                            per_gpu = used_gpu[node_id] = [0] * len(node.gpus)
                        per_gpu[r.gpu_index] += r.memory_bytes
                if r.state in RUNNING:
                    held = self.holders.setdefault(r.model_id, {})
                    held[node_id] = held.get(node_id, 0) + 1
            by_model.setdefault(r.model_id, []).append(r)
        self._used = (used_ram, used_gpu)
        self._fleet: _Fleet | None = None
        return by_model

    @property
    def fleet(self) -> _Fleet:
        if self._fleet is None:  # built only when something is to be placed
            used_ram, used_gpu = self._used
            self._fleet = _Fleet(
                [
                    _NodeState(n, used_ram.get(n.id, 0), used_gpu.get(n.id))
                    for n in self.s.nodes
                    if n.id in self.alive and n.schedulable and not n.draining
                ]
            )
        return self._fleet

    # 2.-6. models

    def _model(self, m: ModelView, replicas: list[ReplicaView]) -> None:
        s, act = self.s, self.actions.append
        desired = 0 if (s.serving_stopped or m.removing) else max(0, m.replicas)
        counting = [r for r in replicas if r.state in COUNTING and r.restart != RESTART_REPLACING]

        # 3. surplus
        removed: list[ReplicaView] = []
        if len(counting) > desired:
            leaving = {r.id for r in counting if self._to_replace(r)}  # going anyway: they go first
            removed = _choose_surplus(counting, len(counting) - desired, leaving)
            gone = {r.id for r in removed}
            counting = [r for r in counting if r.id not in gone]
        if desired == 0:  # nothing stays, not even a replica being replaced: nothing will replace it
            removed += [r for r in replicas if r.state in COUNTING and r.restart == RESTART_REPLACING]
        why = f"surplus: model wants {desired}"
        for r in removed:
            act(Drain(r.id, why) if r.state == READY and r.node_id is not None else Stop(r.id, why))

        # 4. drains that are done
        self._drains(replicas)

        # 5. a removed model goes once nothing of it is left
        if m.removing:
            if m.id not in self.live_models:
                act(DeleteModel(m.id))
            return

        # 6. restarts and node drains: one replica of the model at a time is marked replacing
        # (Not in a run that removes surplus: one step at a time.)
        marked, waiting = (None, [])
        if desired > 0 and not removed:
            marked, waiting = self._start_replacement(m, replicas, counting, desired)
        if marked is not None:
            counting = [r for r in counting if r.id != marked.id]

        # 7. missing and unplaced replicas
        note = unplaceable = ""
        unplaced = [r for r in counting if r.node_id is None]
        missing = desired - len(counting)
        if desired > 0 and (unplaced or missing > 0):
            if m.backoff_until is not None and s.now < m.backoff_until:
                # An absolute time, so the note does not change (and get rewritten) on every run.
                until = time.strftime("%H:%M:%S", time.gmtime(math.ceil(m.backoff_until)))
                plural = "failure" if m.failures == 1 else "failures"
                note = f"backing off after {m.failures} {plural}; next try at {until} UTC"
            else:
                note = unplaceable = self._place(m, unplaced, missing)

        # 8. hand-overs: a replaced replica drains once the model is whole again, or at once if needs be
        if desired > 0:
            note = self._hand_over(m, replicas, counting, desired, unplaceable, marked, waiting) or note
        if note != m.placement_note:
            act(SetModelNote(m.id, note))

    # 6. and 8. restarts and node drains

    def _to_replace(self, r: ReplicaView) -> bool:
        """A placed replica a restart or its node's drain wants replaced (and not yet being replaced)."""
        if r.node_id is None or r.restart == RESTART_REPLACING:
            return False
        return r.restart == RESTART_QUEUED or self.nodes[r.node_id].draining

    def _start_replacement(
        self, m: ModelView, replicas: list[ReplicaView], counting: list[ReplicaView], desired: int
    ) -> tuple[ReplicaView | None, list[ReplicaView]]:
        """Mark the next replica of the model to replace, if the model may begin one now.

        Returns (the replica marked or None, the ones left waiting to be replaced)."""
        if any(r.restart == RESTART_REPLACING for r in replicas):
            return None, []  # one at a time: it is busy with another (still serving, draining or stopping)
        wanted = [r for r in counting if self._to_replace(r)]
        if not wanted:
            return None, []
        if self.s.now < (m.backoff_until or 0):
            return None, wanted
        placed = [r for r in counting if r.node_id is not None]
        if any(r.state != READY for r in placed):
            return None, wanted  # something of it is on its way: wait until it is ready
        if not len(placed) == len(counting) == desired:
            # Short of replicas (some fit nowhere): wait, except on a node drained with force, where
            # nothing may be left anyway.
            forced = [r for r in wanted if self.nodes[r.node_id].drain_force]
            if not forced:
                return None, wanted
            wanted = forced
        r = min(wanted, key=lambda r: (r.state != READY, r.id))  # the oldest
        node = self.nodes[r.node_id]
        self._marked_at = len(self.actions)
        self.actions.append(MarkReplacing(r.id, f"node {node.name} is draining" if node.draining else "restart queued"))
        return r, [w for w in wanted if w is not r]

    def _hand_over(
        self,
        m: ModelView,
        replicas: list[ReplicaView],
        counting: list[ReplicaView],
        desired: int,
        unplaceable: str,
        marked: ReplicaView | None,
        waiting: list[ReplicaView],
    ) -> str:
        """Drain the replicas being replaced whose time has come; the model's note when one is blocked."""
        act = self.actions.append
        whole = len(counting) == desired and all(r.node_id is not None and r.state == READY for r in counting)
        note = ""
        for r in replicas:
            if (r.restart != RESTART_REPLACING and r is not marked) or r.state not in COUNTING or r.node_id is None:
                continue
            if whole:
                why = f"replaced by {max(counting, key=lambda c: c.id).name}"
                act(Drain(r.id, why) if r.state == READY else Stop(r.id, why))
                continue
            if not unplaceable:
                continue  # its replacement is on its way
            node = self.nodes[r.node_id]
            if self._room_if_freed(m, r):
                why = "no room for a second copy: stopping it first, the new one starts in its place"
                if not any(c.state == READY and c.node_id is not None for c in counting):
                    why += f" (model {m.name} has no other ready replica meanwhile)"
                if marked is r:
                    self.actions[self._marked_at] = MarkReplacing(r.id, self.actions[self._marked_at].reason, False)
                act(Drain(r.id, why, outage=True) if r.state == READY else Stop(r.id, why))
            elif node.draining and node.drain_force:
                why = f"node {node.name} drained with force: nowhere else to go ({unplaceable})"
                act(Drain(r.id, why, outage=True) if r.state == READY else Stop(r.id, why))
            elif node.draining:
                note = f"drain of node {node.name} is blocked for replica {r.name}: nowhere else to go ({unplaceable})"
                self.blocked.setdefault(node.id, []).append(
                    f"replica {r.name} has nowhere else to go ({unplaceable})"
                )
            else:
                note = f"restart of replica {r.name} waits: no room for a second copy, nor in its place ({unplaceable})"
        if unplaceable and marked is None:  # none could begin: say so on the draining nodes
            for r in waiting:
                if self.nodes[r.node_id].draining and not self.nodes[r.node_id].drain_force:
                    self.blocked.setdefault(r.node_id, []).append(
                        f"replica {r.name} waits: model {m.name} is short of replicas ({unplaceable})"
                    )
        return note

    def _room_if_freed(self, m: ModelView, r: ReplicaView) -> bool:
        """Would a new replica of the model fit where `r` runs, once `r` has stopped? If so, reserve it there."""
        ns = self.fleet.by_id.get(r.node_id)  # only an open node: not draining, schedulable, alive
        if ns is None or m.engine_kind not in ns.node.engines or (m.nodes and ns.name not in m.nodes):
            return False
        if m.uses_gpu:
            fits = [
                i
                for i, free in enumerate(ns.free_gpu)
                if free + (r.memory_bytes if i == r.gpu_index else 0) >= m.memory_bytes
            ]
            if not fits:
                return False
            gpu = r.gpu_index if r.gpu_index in fits else fits[0]
        else:
            freed = r.memory_bytes if r.gpu_index is None else 0
            if ns.free_ram + freed < m.memory_bytes:
                return False
            gpu = None
        # What the new one needs beyond what `r` frees is promised: later placements in this run must not take it.
        extra = m.memory_bytes - (r.memory_bytes if gpu == r.gpu_index else 0)
        if extra > 0:
            self.fleet.commit(ns, gpu, extra)
        return True

    def _node_notes(self) -> None:
        for n in sorted(self.s.nodes, key=lambda n: (n.name, n.id)):
            note = "; ".join(self.blocked.get(n.id, ())) if n.draining else ""
            note = note[:NOTE_MAX]
            if note != n.drain_note:
                self.actions.append(SetNodeNote(n.id, note))

    def _drains(self, replicas: list[ReplicaView]) -> None:
        s = self.s
        for r in replicas:
            if r.state != DRAINING:
                continue
            if s.inflight.get(r.name, 0) <= 0:
                self.actions.append(Stop(r.id, "drained: idle"))
            elif s.now - r.state_changed_at >= s.drain_grace:
                self.actions.append(Stop(r.id, f"drain grace of {_seconds(s.drain_grace)} passed"))

    def _place(self, m: ModelView, unplaced: list[ReplicaView], missing: int) -> str:
        """Assign the unplaced replicas, create the missing ones; the first reason nothing fit, or ''."""
        act = self.actions.append
        placer = _ModelPlacer(self.fleet, m, self.holders.setdefault(m.id, {}), len(unplaced) + max(0, missing))
        reason = ""  # once one replica does not fit, none after it does: placing only takes memory away
        for r in unplaced:
            found = None if reason else placer.place()
            if found is not None:
                act(Assign(r.id, found[0].id, found[1]))
                continue
            reason = reason or self._explain(m)
            if reason != r.reason:
                act(Unplaceable(m.id, r.id, reason))
        for _ in range(max(0, missing)):
            found = None if reason else placer.place()
            if found is not None:
                act(Create(m.id, found[0].id, found[1], memory_bytes=m.memory_bytes))
                continue
            reason = reason or self._explain(m)
            act(Unplaceable(m.id, None, reason, memory_bytes=m.memory_bytes))
        return reason

    def _orphans(self, replicas: list[ReplicaView]) -> None:
        """Replicas of a model the snapshot does not have: stop them."""
        for r in replicas:
            if r.state in COUNTING:
                self.actions.append(Stop(r.id, "its model is gone"))
        self._drains(replicas)

    # 8. why a model does not fit

    def _explain(self, m: ModelView) -> str:
        fleet = self.fleet
        kind = m.engine_kind
        if not m.nodes:
            return self._explain_any(m)
        names = _names(m.nodes)
        nodes = [n for name in m.nodes if (n := self.nodes_by_name.get(name)) is not None]
        alive = [n for n in nodes if n.id in self.alive]
        if not alive:
            return f"allowed nodes ({names}) are not connected"
        open_ = [n for n in alive if n.schedulable and not n.draining]
        if not open_:
            return f"no allowed node ({names}) is connected, schedulable and not draining"
        with_engine = [fleet.by_id[n.id] for n in open_ if kind in n.engines]
        if not with_engine:
            return f"no connected, schedulable allowed node ({names}) has engine {kind}"
        return self._memory_reason(m, with_engine, f"no connected, schedulable allowed node ({names})")

    def _explain_any(self, m: ModelView) -> str:
        kind = m.engine_kind
        if not self.alive:
            return "no node is connected"
        if not self.fleet.by_id:
            return "every connected node is unschedulable or draining"
        if not self.fleet.by_engine.get(kind):
            return f"no connected, schedulable node has engine {kind}"
        # The most free is the top of the sorted index; the first entry with that value names the node.
        idx = self.fleet.gpu_index(kind) if m.uses_gpu else self.fleet.cpu_index(kind)
        if not idx:
            return f"no connected, schedulable node with engine {kind} has a GPU"
        top = idx[bisect_left(idx, (idx[-1][0],))]
        return self._need(m, top[0], top[1], top[2] if m.uses_gpu else None)

    def _memory_reason(self, m: ModelView, nodes: list[_NodeState], none_of: str) -> str:
        best = None
        for ns in nodes:
            if m.uses_gpu:
                for i, free in enumerate(ns.free_gpu):
                    if best is None or (-free, ns.name, i) < best:
                        best = (-free, ns.name, i)
            elif best is None or (-ns.free_ram, ns.name, None) < best:
                best = (-ns.free_ram, ns.name, None)
        if best is None:
            return f"{none_of} with engine {m.engine_kind} has a GPU"
        return self._need(m, -best[0], best[1], best[2])

    @staticmethod
    def _need(m: ModelView, free: int, name: str, gpu: int | None) -> str:
        free = max(0, free)
        if m.uses_gpu:
            return (
                f"needs {format_bytes(m.memory_bytes)} on one GPU; "
                f"the most free is {format_bytes(free)} on {name} GPU {gpu}"
            )
        return f"needs {format_bytes(m.memory_bytes)} RAM; the most free is {format_bytes(free)} on {name}"


def _choose_surplus(counting: list[ReplicaView], n: int, leaving=frozenset()) -> list[ReplicaView]:
    """Which `n` of the counting replicas go: unplaced ones, then ones not ready yet (newest first), then
    ready ones to be replaced anyway (ids in `leaving`, newest first), then ready ones from the node
    holding the most replicas of the model (newest first there)."""
    newest = lambda r: (-r.state_changed_at, -r.id)  # noqa: E731
    unplaced = sorted((r for r in counting if r.node_id is None), key=newest)
    not_ready = sorted((r for r in counting if r.node_id is not None and r.state != READY), key=newest)
    chosen = (unplaced + not_ready)[:n]
    n -= len(chosen)
    if n <= 0:
        return chosen
    going = sorted((r for r in counting if r.id in leaving and r.node_id is not None and r.state == READY), key=newest)
    chosen += going[:n]
    n -= len(going[:n])
    if n <= 0:
        return chosen
    taken = {r.id for r in going}
    # Every unplaced and not-ready replica is already chosen: only ready ones are left on the nodes.
    per_node: dict[int, list[ReplicaView]] = {}
    for r in counting:
        if r.node_id is not None and r.state == READY and r.id not in taken:
            per_node.setdefault(r.node_id, []).append(r)
    for rs in per_node.values():
        rs.sort(key=newest)
    heap = [(-len(rs), *newest(rs[0]), node_id) for node_id, rs in per_node.items()]
    heapq.heapify(heap)
    while n > 0 and heap:
        _, _, _, node_id = heapq.heappop(heap)
        rs = per_node[node_id]
        chosen.append(rs.pop(0))
        n -= 1
        if rs:
            heapq.heappush(heap, (-len(rs), *newest(rs[0]), node_id))
    return chosen
