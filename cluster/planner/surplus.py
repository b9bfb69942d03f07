"""Surplus: which replicas go when a model has more than it wants, and drains that are done."""

from __future__ import annotations

import heapq
from collections.abc import Set

from cluster.planner.actions import Action, Stop
from cluster.planner.snapshot import DRAINING, READY, ReplicaView, Snapshot


def finished_drains(s: Snapshot, replicas: list[ReplicaView]) -> list[Action]:
    """Stop each draining replica that is idle (nothing in flight) or whose drain grace has passed."""
    actions: list[Action] = []
    for r in replicas:
        if r.state != DRAINING:
            continue
        if s.inflight.get(r.name, 0) <= 0:
            actions.append(Stop(r.id, "drained: idle"))
        elif s.now - r.state_changed_at >= s.drain_grace:
            actions.append(Stop(r.id, f"drain grace of {s.drain_grace:g}s passed"))
    return actions


def choose_surplus(counting: list[ReplicaView], n: int, leaving: Set[int] = frozenset()) -> list[ReplicaView]:
    """Which `n` of the counting replicas go: unplaced ones, then ones not ready yet (newest first), then
    ready ones to be replaced anyway (ids in `leaving`, newest first), then ready ones from the node
    holding the most replicas of the model (newest first there)."""
    def newest(r: ReplicaView) -> tuple[float, int]:
        return (-r.state_changed_at, -r.id)

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
