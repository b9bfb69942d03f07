"""Why a model does not fit: the first thing that stands in its way, named in an operator's words (which node,
how much memory it needs, the most that is free and where)."""

from __future__ import annotations

from bisect import bisect_left

from cluster.planner.placement import NodeState
from cluster.planner.snapshot import ModelView
from cluster.planner.state import PlannerState
from ground.units import format_size


class Reasons(PlannerState):
    """The planner's explanations (a mixin of cluster.planner.planning.Planner: it reads the planner's nodes,
    the alive set and the fleet of candidates)."""

    def _explain(self, m: ModelView) -> str:
        fleet = self.fleet
        kind = m.engine_kind
        if not m.nodes:
            return self._explain_any(m)
        names = ", ".join(sorted(m.nodes))
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
        if top[0] >= m.memory_bytes:  # the memory is there: the cores are not
            return self._cores(m, self.fleet.by_engine[kind])
        return self._need(m, top[0], top[1], top[2] if m.uses_gpu else None)

    def _memory_reason(self, m: ModelView, nodes: list[NodeState], none_of: str) -> str:
        best: tuple[int, str, int | None] | None = None  # (-free, node name, GPU index)
        for ns in nodes:
            if m.uses_gpu:
                for i, free in enumerate(ns.free_gpu):
                    if best is None or (-free, ns.name, i) < best:
                        best = (-free, ns.name, i)
            elif best is None or (-ns.free_ram, ns.name, None) < best:
                best = (-ns.free_ram, ns.name, None)
        if best is None:
            return f"{none_of} with engine {m.engine_kind} has a GPU"
        if -best[0] >= m.memory_bytes:  # the memory is there: the cores are not
            return self._cores(m, nodes)
        return self._need(m, -best[0], best[1], best[2])

    @staticmethod
    def _cores(m: ModelView, nodes: list[NodeState]) -> str:
        """Why a model whose memory some node has fits on none of them: the CPU cores its threads take."""
        def has_memory(ns: NodeState) -> bool:
            return any(f >= m.memory_bytes for f in ns.free_gpu) if m.uses_gpu else ns.free_ram >= m.memory_bytes

        roomy = [(ns.free_cpu, ns) for ns in nodes if has_memory(ns) and ns.free_cpu is not None]
        if not roomy:
            return f"needs {m.threads} CPU cores (its threads)"
        free, best = min(roomy, key=lambda c: (-c[0], c[1].name))
        cores = "core" if m.threads == 1 else "cores"
        return (f"needs {m.threads} CPU {cores} (its threads); the most free is {max(0, free)} "
                f"of {best.node.cpus} on {best.name}")

    @staticmethod
    def _need(m: ModelView, free: int, name: str, gpu: int | None) -> str:
        free = max(0, free)
        if m.uses_gpu:
            return (
                f"needs {format_size(m.memory_bytes)} on one GPU; "
                f"the most free is {format_size(free)} on {name} GPU {gpu}"
            )
        return f"needs {format_size(m.memory_bytes)} RAM; the most free is {format_size(free)} on {name}"
