"""Room for a model that is asked for: when no node has room for a model with requests waiting, idle replicas of
autoscaled models (least recently used first) are stopped to make it, on one node (or GPU) where that is enough.

Never a fixed model's replica, never one below its model's minimum, never one being replaced, and never one that
has served less than the minimum residency (`Snapshot.min_resident`: two models that do not fit together take
turns instead of evicting each other). A replica with requests in flight, or of a model with requests waiting in
the gateway's queue for a slot (gateway/admission.py), is evicted only once the model asking has waited that
minimum too: it then admits no new request (it drains) and stops when its last one is answered.
The requests for the model asking wait in the gateway meanwhile (its replica is `waiting_for_room`); where nothing
could ever be evicted they are answered at once, and the reason names what blocked it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cluster.planner.actions import Evict
from cluster.planner.snapshot import COUNTING, DRAINING, READY, RESTART_NONE, STOPPING, ModelView, ReplicaView
from cluster.planner.state import PlannerState
from ground.units import format_size

Slot = tuple[int, int | None]  # (node id, GPU index; None for a model on CPU)


@dataclass
class Room:
    """What eviction can do for a model: `coming` (its requests should wait), why, and the evictions to make now."""

    coming: bool
    reason: str
    evict: list[Evict] = field(default_factory=list)


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(math.ceil(epoch)))


class Evictions(PlannerState):
    """A mixin of cluster.planner.planning.Planner: it reads the snapshot, the fleet of candidate nodes and the
    replicas by model, and remembers what this run already chose to evict."""

    def _room_for(self, m: ModelView, by_model: dict[int, list[ReplicaView]], no_room: str) -> Room:
        s, fleet = self.s, self.fleet
        models = {x.id: x for x in s.models}
        need = m.memory_bytes
        # where the model may go, and what is free there now
        slots: dict[Slot, int] = {}
        for ns in fleet.by_engine.get(m.engine_kind, ()):
            if m.nodes and ns.name not in m.nodes:
                continue
            if m.uses_gpu:
                for i, free in enumerate(ns.free_gpu):
                    slots[(ns.id, i)] = free
            else:
                slots[(ns.id, None)] = ns.free_ram
        if not slots:
            return Room(False, no_room)
        freeing: dict[Slot, int] = {}
        candidates: list[tuple[Slot, ReplicaView, ModelView]] = []
        blocked: list[str] = []
        left = {mid: sum(1 for r in rs if r.state in COUNTING and r.id not in self.evicting)
                for mid, rs in by_model.items()}
        for r in s.replicas:
            if r.node_id is None or (m.uses_gpu) != (r.gpu_index is not None):
                continue
            slot: Slot = (r.node_id, r.gpu_index if m.uses_gpu else None)
            if slot not in slots:
                continue
            if r.state in (DRAINING, STOPPING) or r.id in self.evicting:
                freeing[slot] = freeing.get(slot, 0) + r.memory_bytes
                continue
            if r.model_id == m.id:
                continue
            owner = models.get(r.model_id)
            if owner is None or r.state not in COUNTING or r.restart != RESTART_NONE:
                continue
            if not owner.evictable:
                blocked.append(f"model {owner.name} is not autoscaled")
                continue
            candidates.append((slot, r, owner))
        for slot, free in slots.items():
            if free + freeing.get(slot, 0) >= need and freeing.get(slot):
                return Room(True, f"waiting for room: a replica stopping on {self._slot_name(slot)} frees it")
        # least recently used first (a model never asked for counts as the oldest)
        candidates.sort(key=lambda c: (c[2].last_request or 0.0, c[1].state_changed_at, c[1].id))
        best: tuple[tuple[float, int, str], Slot, list[tuple[ReplicaView, ModelView]]] | None = None
        for slot, free in sorted(slots.items(), key=lambda item: (self._slot_name(item[0]),)):
            have = free + freeing.get(slot, 0)
            chosen: list[tuple[ReplicaView, ModelView]] = []
            taken = dict(left)
            for c_slot, r, owner in candidates:
                if have >= need:
                    break
                # (a candidate's model is evictable: it has its scaling)
                if c_slot != slot or owner.scaling is None or taken.get(owner.id, 0) <= owner.scaling.min:
                    continue
                taken[owner.id] -= 1
                chosen.append((r, owner))
                have += r.memory_bytes
            if have >= need and chosen:
                recency = max(owner.last_request or 0.0 for _, owner in chosen)
                key = (recency, len(chosen), self._slot_name(slot))
                if best is None or key < best[0]:
                    best = (key, slot, chosen)
        if best is None:
            # replicas of autoscaled models placed in this very run (two models asked for at once): evictable
            # once they have served their minimum, so room is coming
            for owner, node_id, gpu in self.placed_now:
                slot = (node_id, gpu if m.uses_gpu else None)
                if owner.evictable and slot in slots and slots[slot] + freeing.get(slot, 0) + owner.memory_bytes >= need:
                    return Room(True, f"waiting for room: model {owner.name} is loading on {self._slot_name(slot)}; "
                                      f"it serves {s.min_resident:g}s once ready")
            nothing = "; ".join(sorted(set(blocked))) or "no idle replica of an autoscaled model frees enough"
            return Room(False, f"{no_room}; nothing to evict ({nothing})")
        _, slot, chosen = best
        # asked for (m.waiting), so the gateway said since when; were it not, it has waited nothing yet
        since = m.waiting_since if m.waiting_since is not None else s.now
        now, waited = s.now, s.now - since
        evict: list[Evict] = []
        holding: list[str] = []
        for r, owner in chosen:
            served = now - r.state_changed_at
            busy = s.inflight.get(r.name, 0)
            # in absolute times, so that the reason (and its Event) does not change on every run
            if r.state != READY:
                holding.append(f"replica {r.name} of model {owner.name} is loading; it serves "
                               f"{s.min_resident:g}s once ready")
            elif served < s.min_resident:
                holding.append(f"replica {r.name} of model {owner.name} serves at least until "
                               f"{_clock(r.state_changed_at + s.min_resident)} UTC (the minimum residency)")
            elif busy and waited < s.min_resident:
                holding.append(f"replica {r.name} of model {owner.name} has requests in flight; it stops taking new "
                               f"ones at {_clock(since + s.min_resident)} UTC, once model {m.name} has "
                               f"waited {s.min_resident:g}s")
            elif owner.waiting and waited < s.min_resident:
                # its own requests queued for a slot are served first: two models asked for at once take turns
                # of at least the minimum residency, not a swap per request
                holding.append(f"model {owner.name} has {owner.waiting} request(s) waiting for a slot; replica "
                               f"{r.name} serves them until {_clock(since + s.min_resident)} UTC, once model "
                               f"{m.name} has waited {s.min_resident:g}s")
            else:
                idle = "idle" if not busy else f"{busy} request(s) in flight, admitting no new one"
                evict.append(Evict(r.id, m.name, f"room for model {m.name} ({format_size(need)} on "
                                                 f"{self._slot_name(slot)}): model {owner.name} least recently "
                                                 f"used, {idle}", busy))
        if holding:
            return Room(True, "waiting for room: " + "; ".join(holding))
        self.evicting.update(e.replica_id for e in evict)
        names = ", ".join(r.name for r, _ in chosen)
        return Room(True, f"waiting for room: evicting {names} on {self._slot_name(slot)}", evict)

    def _slot_name(self, slot: Slot) -> str:
        node = self.nodes.get(slot[0])
        name = node.name if node is not None else f"#{slot[0]}"
        return name if slot[1] is None else f"{name} GPU {slot[1]}"
