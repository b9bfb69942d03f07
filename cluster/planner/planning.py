"""One plan: the steps, in the order of concern, for the nodes, each model and the replicas of models that
are gone. The rules of each step that have a module of their own: placement, surplus, hand-over, reasons."""

from __future__ import annotations

import math
import time

from cluster.planner.actions import (
    Action,
    Assign,
    Create,
    DeleteModel,
    Drain,
    Fail,
    MarkNodeDisconnected,
    MarkStopped,
    SetModelNote,
    Stop,
    Unplaceable,
)
from cluster.planner.capacity import MemoryInUse
from cluster.planner.eviction import Evictions
from cluster.planner.handover import HandOver
from cluster.planner.placement import Fleet, ModelPlacer, NodeState
from cluster.planner.reasons import Reasons
from cluster.planner.snapshot import (
    COUNTING,
    READY,
    RESTART_REPLACING,
    RUNNING,
    STOPPING,
    TERMINAL,
    ModelView,
    NodeView,
    ReplicaView,
    Snapshot,
)
from cluster.planner.surplus import choose_surplus, finished_drains


class Planner(HandOver, Reasons, Evictions):
    def __init__(self, snapshot: Snapshot):
        self.s = snapshot
        self.actions: list[Action] = []
        self.evicting: set[int] = set()  # replicas this run evicts (for a model asked for)
        self.placed_now: list[tuple[ModelView, int, int | None]] = []  # (model, node id, GPU) placed in this run
        self.blocked: dict[int, list[str]] = {}  # draining node id -> why its drain is blocked

    def run(self) -> list[Action]:
        s = self.s
        self._nodes()
        by_model = self.by_model = self._replicas()
        # a model whose replica waits for room made for it (an eviction) is placed first, the one waiting longest
        # first: the room is its, and requests for models that do not fit together take their turns in order
        waits = {m.id for m in s.models if any(r.waiting_for_room and r.node_id is None for r in by_model.get(m.id, ()))}
        models = sorted(s.models, key=lambda m: (m.id not in waits, m.waiting_since if m.waiting_since is not None
                                                 else float("inf"), m.name, m.id))
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
        self.returning: list[NodeView] = []  # silent, within the lost grace: its agent may be on its way back
        for n in sorted(s.nodes, key=lambda n: (n.name, n.id)):
            silent = None if n.last_seen is None else now - n.last_seen - self._away(n.last_seen)
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
            else:
                self.returning.append(n)

    def _away(self, last_seen: float) -> float:
        """Seconds since `last_seen` that no control plane was there to hear the node (Snapshot.away)."""
        if self.s.away is None:
            return 0.0
        begun, ended = self.s.away
        return max(0.0, min(ended, self.s.now) - max(begun, last_seen))

    def _replicas(self) -> dict[int, list[ReplicaView]]:
        """Fail what went with a lost node; group the rest by model; account memory and spread."""
        used = MemoryInUse()
        # model id -> node id -> its replicas there that count (not one being replaced: it is leaving)
        self.holders: dict[int, dict[int, int]] = {}
        self.live_models: set[int] = set()  # models with a non-terminal replica in the snapshot
        by_model: dict[int, list[ReplicaView]] = {}
        nodes, lost = self.nodes, self.lost
        for r in sorted(self.s.replicas, key=lambda r: r.id):
            if r.state in TERMINAL:
                continue
            self.live_models.add(r.model_id)
            if r.of_model is not None:  # a model is not deleted while a canary of it runs
                self.live_models.add(r.of_model)
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
                else:
                    used.add(node_id, len(node.gpus), r.state, r.gpu_index, r.memory_bytes, r.threads)
                if r.state in COUNTING and r.restart != RESTART_REPLACING:
                    held = self.holders.setdefault(r.model_id, {})
                    held[node_id] = held.get(node_id, 0) + 1
            by_model.setdefault(r.model_id, []).append(r)
        self._used = used
        self._fleet: Fleet | None = None
        return by_model

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:  # built only when something is to be placed
            used = self._used
            self._fleet = Fleet(
                [
                    NodeState(n, used.ram(n.id), used.gpus(n.id, len(n.gpus)), used.cores(n.id))
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
            removed = choose_surplus(counting, len(counting) - desired, leaving)
            gone = {r.id for r in removed}
            counting = [r for r in counting if r.id not in gone]
        if desired == 0:  # nothing stays, not even a replica being replaced: nothing will replace it
            removed += [r for r in replicas if r.state in COUNTING and r.restart == RESTART_REPLACING]
        why = f"surplus: model wants {desired}" if not m.canary_of else (
            f"canary of model {m.canary_of}: its rollout is not watching" if desired == 0 else
            f"surplus: its rollout wants {desired} canary replica(s)")
        for r in removed:
            act(Drain(r.id, why) if r.state == READY and r.node_id is not None else Stop(r.id, why))

        # 4. drains that are done
        self.actions.extend(finished_drains(self.s, replicas))

        # 5. a removed model goes once nothing of it is left
        if m.removing:
            if m.id not in self.live_models:
                act(DeleteModel(m.id))
            return

        # 6. restarts and node drains: one replica of the model at a time is marked replacing
        # (Not in a run that removes surplus: one step at a time.)
        marked: ReplicaView | None = None
        waiting: list[ReplicaView] = []
        if desired > 0 and not removed:
            marked, waiting = self._start_replacement(m, replicas, counting, desired)
        if marked is not None:
            counting = [r for r in counting if r.id != marked.id]
            held = self.holders[m.id]  # it is leaving: its replacement spreads as any replica would
            node_id = self._node(marked).id
            held[node_id] -= 1
            if not held[node_id]:
                del held[node_id]

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

    def _place(self, m: ModelView, unplaced: list[ReplicaView], missing: int) -> str:
        """Assign the unplaced replicas, create the missing ones; the first reason nothing fit, or ''. For a model
        asked for (requests waiting for it) that fits nowhere, room is made by eviction where it can be."""
        act = self.actions.append
        placer = ModelPlacer(self.fleet, m, self.holders.setdefault(m.id, {}), len(unplaced) + max(0, missing))
        reason = ""  # once one replica does not fit, none after it does: placing only takes memory away
        coming = False

        def no_room() -> str:
            nonlocal coming
            why = self._explain(m)
            if m.waiting and not any(r.state == READY for r in self.by_model.get(m.id, ())):
                room = self._room_for(m, self.by_model, why)
                self.actions.extend(room.evict)
                coming, why = room.coming, room.reason
            if not coming and (back := self._coming_back(m)):
                coming, why = True, f"{why}; waiting for {back} to reconnect"
            return why

        for r in unplaced:
            found = None if reason else placer.place()
            if found is not None:
                act(Assign(r.id, found[0].id, found[1]))
                self.placed_now.append((m, found[0].id, found[1]))
                continue
            reason = reason or no_room()
            if reason != r.reason or coming != r.waiting_for_room:
                act(Unplaceable(m.id, r.id, reason, waiting_for_room=coming))
        for _ in range(max(0, missing)):
            found = None if reason else placer.place()
            if found is not None:
                act(Create(m.id, found[0].id, found[1], memory_bytes=m.memory_bytes))
                self.placed_now.append((m, found[0].id, found[1]))
                continue
            reason = reason or no_room()
            act(Unplaceable(m.id, None, reason, memory_bytes=m.memory_bytes, waiting_for_room=coming))
        return reason

    def _coming_back(self, m: ModelView) -> str:
        """The nodes not connected now but heard from within the lost grace where the model could go, named ('':
        none). Agents reconnect on their own schedule (a few seconds after a control plane restarts): a replica
        that waits for one is on its way, and its model's requests wait for it."""
        used, names = self._used, []
        for n in self.returning:
            if not n.schedulable or n.draining or m.engine_kind not in n.engines or (m.nodes and n.name not in m.nodes):
                continue
            ns = NodeState(n, used.ram(n.id), used.gpus(n.id, len(n.gpus)), used.cores(n.id))
            room = any(free >= m.memory_bytes for free in ns.free_gpu) if m.uses_gpu else ns.free_ram >= m.memory_bytes
            if room and ns.cpu_fits(m.threads):
                names.append(n.name)
        if not names:
            return ""
        return f"node {names[0]}" if len(names) == 1 else f"nodes {', '.join(names)}"

    def _orphans(self, replicas: list[ReplicaView]) -> None:
        """Replicas of a model the snapshot does not have: stop them."""
        for r in replicas:
            if r.state in COUNTING:
                self.actions.append(Stop(r.id, "its model is gone"))
        self.actions.extend(finished_drains(self.s, replicas))

    # 8. why a model does not fit
