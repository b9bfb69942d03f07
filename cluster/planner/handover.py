"""Restarts and node drains: one replica of a model at a time is marked `replacing`; it keeps serving but stops
counting, so a replacement is placed; once the model is whole again it drains and stops. Where no second copy
fits, it makes room first (an outage the Drain says so), or the restart or drain waits and says why."""

from __future__ import annotations

from cluster.planner.actions import Drain, MarkReplacing, SetNodeNote, Stop
from cluster.planner.snapshot import (
    COUNTING,
    NOTE_MAX,
    READY,
    RESTART_QUEUED,
    RESTART_REPLACING,
    ModelView,
    NodeView,
    ReplicaView,
)
from cluster.planner.state import PlannerState


class HandOver(PlannerState):
    """The planner's restart and drain rules (a mixin of cluster.planner.planning.Planner: it uses the
    planner's snapshot, actions, nodes, fleet and the draining nodes' notes)."""

    _marked_at: int  # the index in `actions` of the MarkReplacing _start_replacement last appended

    def _node(self, r: ReplicaView) -> NodeView:
        """The node of a placed replica."""
        assert r.node_id is not None, f"replica {r.name} is not placed"
        return self.nodes[r.node_id]

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
            forced = [r for r in wanted if self._node(r).drain_force]
            if not forced:
                return None, wanted
            wanted = forced
        r = min(wanted, key=lambda r: (r.state != READY, r.id))  # the oldest
        node = self._node(r)
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
                    mark = self.actions[self._marked_at]
                    assert isinstance(mark, MarkReplacing), mark  # put there by _start_replacement
                    self.actions[self._marked_at] = MarkReplacing(r.id, mark.reason, False)
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
                node = self._node(r)
                if node.draining and not node.drain_force:
                    self.blocked.setdefault(node.id, []).append(
                        f"replica {r.name} waits: model {m.name} is short of replicas ({unplaceable})"
                    )
        return note

    def _room_if_freed(self, m: ModelView, r: ReplicaView) -> bool:
        """Would a new replica of the model fit where `r` runs, once `r` has stopped? If so, reserve it there."""
        ns = self.fleet.by_id.get(self._node(r).id)  # only an open node: not draining, schedulable, alive
        if ns is None or m.engine_kind not in ns.node.engines or (m.nodes and ns.name not in m.nodes):
            return False
        if not ns.cpu_fits(m.threads - r.threads):  # the cores `r` frees count
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
        cores = max(0, m.threads - r.threads)
        if extra > 0 or cores:
            self.fleet.commit(ns, gpu, max(0, extra), cores)
        return True

    def _node_notes(self) -> None:
        for n in sorted(self.s.nodes, key=lambda n: (n.name, n.id)):
            note = "; ".join(self.blocked.get(n.id, ())) if n.draining else ""
            note = note[:NOTE_MAX]
            if note != n.drain_note:
                self.actions.append(SetNodeNote(n.id, note))
