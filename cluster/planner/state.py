"""What the planner's parts share of one run (cluster.planner.planning.Planner holds it): its snapshot, the actions
decided so far, the nodes by id and by name and which are alive, what this run evicts and places, the draining
nodes' notes, and the fleet's room. The rule mixins (restarts and drains, reasons, evictions) stand on it."""

from __future__ import annotations

from cluster.planner.actions import Action
from cluster.planner.placement import Fleet
from cluster.planner.snapshot import ModelView, NodeView, Snapshot


class PlannerState:
    s: Snapshot
    actions: list[Action]
    nodes: dict[int, NodeView]
    nodes_by_name: dict[str, NodeView]
    alive: set[int]
    evicting: set[int]  # replicas this run evicts (for a model asked for)
    placed_now: list[tuple[ModelView, int, int | None]]  # (model, node id, GPU) placed in this run
    blocked: dict[int, list[str]]  # draining node id -> why its drain is blocked

    @property
    def fleet(self) -> Fleet:
        """The room on the schedulable nodes (built when first asked)."""
        raise NotImplementedError
