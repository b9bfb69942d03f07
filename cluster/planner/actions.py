"""What the planner gives: the actions, in order. The reconciler applies them in one transaction and writes an
Event for each."""

from __future__ import annotations

from dataclasses import dataclass


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
    waiting_for_room: bool = False  # room is coming (an eviction, a node reconnecting): its model's requests wait


@dataclass(frozen=True)
class Drain:
    """No new requests; stopped once idle or after the drain grace. `outage`: no copy of it serves meanwhile."""

    replica_id: int
    reason: str
    outage: bool = False


@dataclass(frozen=True)
class Evict:
    """Drain a replica of an autoscaled model to make room for another model that is asked for (it stops once
    idle); its model wants one fewer."""

    replica_id: int
    for_model: str
    reason: str
    inflight: int = 0


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
    | Evict
    | Stop
    | Fail
    | MarkStopped
    | SetModelNote
    | DeleteModel
    | MarkReplacing
    | SetNodeNote
)
