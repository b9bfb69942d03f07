"""Placement: the candidate nodes with what is free on each, indexed so that the fullest place that fits is
found fast, and the placer that spreads one model's replicas across nodes before stacking them."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from typing import TypeVar

from cluster.planner.snapshot import ModelView, NodeView

CpuEntry = tuple[int, str, int]  # (free RAM, node name, node id)
GpuEntry = tuple[int, str, int, int]  # (free GPU memory, node name, GPU index, node id)
LevelEntry = tuple[int, str, int | None, int]  # (free memory, node name, GPU index or None, node id)
_Entry = TypeVar("_Entry", CpuEntry, GpuEntry)


class NodeState:
    """A candidate node (alive, schedulable, not draining) and what is free on it, updated as we place: memory,
    and CPU cores (its cores less its engines' threads; None when the node did not say how many it has)."""

    __slots__ = ("node", "id", "name", "free_ram", "free_gpu", "free_cpu")

    def __init__(self, node: NodeView, used_ram: int, used_gpu: list[int] | None, used_cores: int = 0):
        self.node = node
        self.id = node.id
        self.name = node.name
        self.free_ram = node.memory_bytes - used_ram
        self.free_gpu = [mem - (used_gpu[i] if used_gpu else 0) for i, mem in enumerate(node.gpus)]
        self.free_cpu = node.cpus - used_cores if node.cpus > 0 else None

    def cpu_fits(self, threads: int) -> bool:
        return self.free_cpu is None or threads <= 0 or self.free_cpu >= threads


class Fleet:
    """The candidate nodes, with sorted free-memory indexes per engine kind (built on first use).

    A CPU index holds (free RAM, name, node id) for every candidate with the engine; a GPU index holds
    (free memory, name, GPU index, node id) for every GPU of those candidates. Both ascend, so the
    first entry at or above a model's memory is the fullest place that fits (bin-packing).
    """

    def __init__(self, candidates: list[NodeState]):
        self.by_id = {ns.id: ns for ns in candidates}
        self.by_name = {ns.name: ns for ns in candidates}
        self.by_engine: dict[str, list[NodeState]] = {}
        for ns in sorted(candidates, key=lambda ns: (ns.name, ns.id)):
            for kind in ns.node.engines:
                self.by_engine.setdefault(kind, []).append(ns)
        self._cpu: dict[str, list[CpuEntry]] = {}
        self._gpu: dict[str, list[GpuEntry]] = {}

    def cpu_index(self, kind: str) -> list[CpuEntry]:
        idx = self._cpu.get(kind)
        if idx is None:
            idx = sorted((ns.free_ram, ns.name, ns.id) for ns in self.by_engine.get(kind, ()))
            self._cpu[kind] = idx
        return idx

    def gpu_index(self, kind: str) -> list[GpuEntry]:
        idx = self._gpu.get(kind)
        if idx is None:
            idx = sorted(
                (free, ns.name, i, ns.id) for ns in self.by_engine.get(kind, ()) for i, free in enumerate(ns.free_gpu)
            )
            self._gpu[kind] = idx
        return idx

    def commit(self, ns: NodeState, gpu: int | None, memory: int, threads: int = 0) -> None:
        """Account a placement: the node (or its GPU) has `memory` less free, in every built index, and the node
        `threads` CPU cores less."""
        if ns.free_cpu is not None:
            ns.free_cpu -= threads
        if gpu is None:
            old_cpu = (ns.free_ram, ns.name, ns.id)
            ns.free_ram -= memory
            _reindex(self._cpu, ns.node.engines, old_cpu, (ns.free_ram, ns.name, ns.id))
        else:
            old_gpu = (ns.free_gpu[gpu], ns.name, gpu, ns.id)
            ns.free_gpu[gpu] -= memory
            _reindex(self._gpu, ns.node.engines, old_gpu, (ns.free_gpu[gpu], ns.name, gpu, ns.id))


def _reindex(indexes: dict[str, list[_Entry]], kinds: Iterable[str], old: _Entry, new: _Entry) -> None:
    """Move a place from `old` to `new` in every built index of the engine kinds."""
    for kind in kinds:
        idx = indexes.get(kind)
        if idx is not None:
            i = bisect_left(idx, old)
            del idx[i]
            insort(idx, new)


def best_gpu(ns: NodeState, memory: int) -> tuple[int, int] | None:
    """(free, index) of the fullest GPU of the node that still fits `memory`; lowest index on a tie."""
    best: tuple[int, int] | None = None
    for i, free in enumerate(ns.free_gpu):
        if free >= memory and (best is None or free < best[0]):
            best = (free, i)
    return best


class ModelPlacer:
    """Places replicas of one model, one at a time, and says why when it cannot.

    A node fits when it has the memory (on one GPU for GPU engines) and the CPU cores the model's threads take.
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

    def __init__(self, fleet: Fleet, model: ModelView, counts: dict[int, int], batch: int):
        self.fleet = fleet
        self.model = model
        self.counts = counts  # node id -> running replicas of this model; updated as we place
        self.memory = model.memory_bytes
        self.threads = model.threads
        self.gpu = model.uses_gpu
        self.allowed = model.nodes
        kind = model.engine_kind
        self.levels: dict[int, list[LevelEntry]] | None = None
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
                nodes = fleet.by_engine.get(kind, [])
            self.levels = self._build_levels(nodes)

    # private levels

    def _entries(self, ns: NodeState) -> list[LevelEntry]:
        if self.gpu:
            return [(free, ns.name, i, ns.id) for i, free in enumerate(ns.free_gpu)]
        return [(ns.free_ram, ns.name, None, ns.id)]

    def _build_levels(self, nodes: list[NodeState]) -> dict[int, list[LevelEntry]]:
        levels: dict[int, list[LevelEntry]] = {}
        for ns in nodes:
            levels.setdefault(self.counts.get(ns.id, 0), []).extend(self._entries(ns))
        for entries in levels.values():
            entries.sort()
        return levels

    def _place_private(self, levels: dict[int, list[LevelEntry]]) -> tuple[NodeState, int | None] | None:
        key = (self.memory,)
        by_id, threads = self.fleet.by_id, self.threads
        for level in sorted(levels):
            entries = levels[level]
            i = bisect_left(entries, key)
            while i < len(entries) and not by_id[entries[i][3]].cpu_fits(threads):
                i += 1
            if i < len(entries):
                _, _, gpu, node_id = entries[i]
                ns = by_id[node_id]
                for entry in self._entries(ns):  # the node moves up a level, with its new free memory
                    del entries[bisect_left(entries, entry)]
                if not entries:
                    del levels[level]
                return ns, gpu
        return None

    def _after_private(self, levels: dict[int, list[LevelEntry]], ns: NodeState) -> None:
        entries = levels.setdefault(self.counts[ns.id], [])
        for entry in self._entries(ns):
            insort(entries, entry)

    # shared index

    def _place_shared(self) -> tuple[NodeState, int | None] | None:
        fleet, counts, memory = self.fleet, self.counts, self.memory
        kind = self.model.engine_kind
        idx = fleet.gpu_index(kind) if self.gpu else fleet.cpu_index(kind)
        allowed, threads = self.allowed, self.threads
        for j in range(bisect_left(idx, (memory,)), len(idx)):
            entry = idx[j]
            node_id = entry[-1]
            if node_id not in counts and (not allowed or entry[1] in allowed) and fleet.by_id[node_id].cpu_fits(threads):
                return fleet.by_id[node_id], (entry[2] if self.gpu else None)
        # Every node that fits holds some already: the fewest, then the fullest that fits, then name.
        best: tuple[tuple[int, int, str, int | None], NodeState] | None = None
        for node_id, count in counts.items():
            ns = fleet.by_id.get(node_id)
            if ns is None or kind not in ns.node.engines or (allowed and ns.name not in allowed):
                continue
            if not ns.cpu_fits(threads):
                continue
            if self.gpu:
                fit = best_gpu(ns, memory)
                if fit is None:
                    continue
                key: tuple[int, int, str, int | None] = (count, fit[0] - memory, ns.name, fit[1])
            else:
                if ns.free_ram < memory:
                    continue
                key = (count, ns.free_ram - memory, ns.name, None)
            if best is None or key < best[0]:
                best = (key, ns)
        if best is None:
            return None
        return best[1], best[0][3]

    def place(self) -> tuple[NodeState, int | None] | None:
        levels = self.levels
        found = self._place_private(levels) if levels is not None else self._place_shared()
        if found is None:
            return None
        ns, gpu = found
        self.fleet.commit(ns, gpu, self.memory, self.threads)
        self.counts[ns.id] = self.counts.get(ns.id, 0) + 1
        if levels is not None:
            self._after_private(levels, ns)
        return found
