"""What the planner takes: a snapshot of nodes, models and replicas as plain frozen data, and the states a
replica goes through (as strings: cluster.models.Replica.State holds the same values)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.planner.scaling import Scaling

# Replica states, as plain strings (cluster.models.Replica.State holds the same values).
PENDING, DOWNLOADING, STARTING, READY = "pending", "downloading", "starting", "ready"
DRAINING, STOPPING, STOPPED, FAILED = "draining", "stopping", "stopped", "failed"
COUNTING = frozenset({PENDING, DOWNLOADING, STARTING, READY})
RUNNING = frozenset({PENDING, DOWNLOADING, STARTING, READY, DRAINING})  # hold memory, in the node's desired list
TERMINAL = frozenset({STOPPED, FAILED})
RESTART_NONE, RESTART_QUEUED, RESTART_REPLACING = "none", "queued", "replacing"
NOTE_MAX = 500  # the longest note a model or node keeps


@dataclass(frozen=True)
class NodeView:
    id: int
    name: str
    connected: bool
    last_seen: float | None  # epoch seconds
    schedulable: bool
    draining: bool
    engines: frozenset[str]  # driver kinds installed
    memory_bytes: int  # RAM offered for replicas
    gpus: tuple[int, ...] = ()  # memory of each GPU, by index
    drain_force: bool = False  # draining with --force: a replica with nowhere else to go is stopped anyway
    drain_note: str = ""  # why the drain is blocked, as last written
    cpus: int = 0  # CPU cores offered for engines (the agent's count, --cpus may lower it); 0: unknown, not counted


@dataclass(frozen=True)
class ModelView:
    id: int
    name: str
    replicas: int
    memory_bytes: int  # per replica
    engine_kind: str
    uses_gpu: bool
    nodes: frozenset[str] = frozenset()  # allowed node names; empty: any
    removing: bool = False
    failures: int = 0
    backoff_until: float | None = None
    placement_note: str = ""
    scaling: Scaling | None = None  # autoscaled (`replicas` is then what the autoscaler wants now); None: fixed
    last_request: float | None = None  # epoch seconds: least recently used on-demand models are evicted first
    waiting: int = 0  # requests waiting for a replica: an on-demand model asked for may evict an idle one
    waiting_since: float | None = None  # when the oldest of them began
    threads: int = 0  # CPU cores each replica takes (its profile's --threads, else its engine's default)
    canary_of: str = ""  # a rollout's canaries (cluster.reconciler._canary_views): the model they are of

    @property
    def evictable(self) -> bool:
        """Autoscaled: its idle replicas may be stopped to make room for another model (down to its minimum)."""
        return self.scaling is not None


@dataclass(frozen=True)
class ReplicaView:
    id: int
    name: str
    model_id: int
    node_id: int | None  # None: not placed yet (pending, with `reason`)
    state: str
    restart: str = RESTART_NONE
    memory_bytes: int = 0
    gpu_index: int | None = None
    state_changed_at: float = 0.0
    reason: str = ""
    waiting_for_room: bool = False
    threads: int = 0  # CPU cores it takes on its node (as it was started)
    of_model: int | None = None  # a rollout's canary (model_id: its group's): the model it is of


@dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[NodeView, ...]
    models: tuple[ModelView, ...]
    replicas: tuple[ReplicaView, ...]  # non-terminal ones; terminal replicas need not be passed
    serving_stopped: bool = False
    node_tolerance: float = 15.0  # a connected node silent this long is disconnected
    node_lost_grace: float = 60.0  # a disconnected node's replicas stop counting after this long
    # the last stretch (from, until; epoch seconds) no control plane watched the nodes (it was down): a node's
    # silence then is not counted, so after a restart every agent has its tolerance and lost grace to reconnect
    away: tuple[float, float] | None = None
    drain_grace: float = 300.0
    inflight: Mapping[str, int] = field(default_factory=dict)  # replica name -> requests in flight
    min_resident: float = 30.0  # seconds an on-demand model's replica serves before it may be evicted
