"""The reconciler's decision, as a pure function: a snapshot of the cluster in, a list of actions out.

No database, no network, no clock of its own: `Snapshot.now` is the time. Tested on plain data
(tests/cluster/planner/) and benchmarked at fleet sizes (bench/reconcile.py).

    snapshot    what it takes: NodeView, ModelView, ReplicaView, Snapshot, the replica states
    actions     what it gives: Create, Assign, Drain, Stop, MarkReplacing, ...
    planning    one plan, step by step: nodes, then each model, then replicas of models that are gone
    placement   the candidate nodes and the spread-then-bin-pack placer
    surplus     which replicas go when a model has too many; drains that are done
    handover    restarts and node drains, one replica of a model at a time
    reasons     why a model does not fit
    eviction    room for a model asked for: idle replicas of autoscaled models, least recently used first
    scaling     the autoscaler's rule: the replicas an autoscaled model wants now
"""

from __future__ import annotations

from cluster.planner.actions import (
    Action,
    Assign,
    Create,
    DeleteModel,
    Drain,
    Evict,
    Fail,
    MarkNodeDisconnected,
    MarkReplacing,
    MarkStopped,
    SetModelNote,
    SetNodeNote,
    Stop,
    Unplaceable,
)
from cluster.planner.planning import Planner
from cluster.planner.snapshot import (
    COUNTING,
    DOWNLOADING,
    DRAINING,
    FAILED,
    NOTE_MAX,
    PENDING,
    READY,
    RESTART_NONE,
    RESTART_QUEUED,
    RESTART_REPLACING,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    TERMINAL,
    ModelView,
    NodeView,
    ReplicaView,
    Snapshot,
)

__all__ = [
    "COUNTING", "DOWNLOADING", "DRAINING", "FAILED", "NOTE_MAX", "PENDING", "READY", "RESTART_NONE",
    "RESTART_QUEUED", "RESTART_REPLACING", "RUNNING", "STARTING", "STOPPED", "STOPPING", "TERMINAL",
    "Action", "Assign", "Create", "DeleteModel", "Drain", "Evict", "Fail", "MarkNodeDisconnected", "MarkReplacing",
    "MarkStopped", "ModelView", "NodeView", "ReplicaView", "SetModelNote", "SetNodeNote", "Snapshot", "Stop",
    "Unplaceable", "plan",
]


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
    return Planner(snapshot).run()

