"""Memory and CPU cores in use on each node, by the one rule placement counts them with; `ctl nodes`, the REST
API and the dashboard show what placement sees (cluster.queries.memory_in_use reads the rows into it).

A replica holds memory on its node from the moment it is placed until its engine has stopped: while pending,
downloading, starting, ready, draining or stopping. A CPU engine's replica holds RAM; a GPU engine's holds
memory on its one GPU (and no RAM). Every replica, on CPU or GPU, holds its threads' CPU cores meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.planner.snapshot import RUNNING, STOPPING

HOLDS_MEMORY = RUNNING | {STOPPING}


@dataclass
class NodeMemory:
    ram: int = 0
    gpus: list[int] = field(default_factory=list)  # by GPU index
    cores: int = 0  # CPU cores its engines' threads take


class MemoryInUse(dict[int, NodeMemory]):
    """node id -> NodeMemory, added to replica by replica."""

    def add(self, node_id: int, gpu_count: int, state: str, gpu_index: int | None, memory_bytes: int,
            threads: int = 0) -> None:
        if state not in HOLDS_MEMORY:
            return
        used = self.get(node_id)
        if used is None:
            used = self[node_id] = NodeMemory(0, [0] * gpu_count)
        used.cores += threads
        if gpu_index is None:
            used.ram += memory_bytes
        elif 0 <= gpu_index < len(used.gpus):
            used.gpus[gpu_index] += memory_bytes

    def ram(self, node_id: int) -> int:
        used = self.get(node_id)
        return used.ram if used else 0

    def cores(self, node_id: int) -> int:
        used = self.get(node_id)
        return used.cores if used else 0

    def gpus(self, node_id: int, gpu_count: int) -> list[int]:
        used = self.get(node_id)
        return list(used.gpus) if used else [0] * gpu_count
