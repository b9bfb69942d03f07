"""What the gateway routes by, loaded from the database in one go and cached per process.

Refreshed when replicas, models, keys or the system state change (a channel-layer event to the `gateway`
group) and by a short timer; a request never queries the database for it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from cluster.models import ClusterSettings, Demand, Model, Replica, Rollout
from gateway.affinity import Ring
from gateway.models import ApiKey
from ground.engines import CAPABILITIES, DRIVERS
from ground.protocol import Facts

FREED_RECENTLY = 30  # seconds a replaced replica's stop counts as room freed for its unplaced replacement
WAITING_STATES = (Replica.State.PENDING, Replica.State.DOWNLOADING, Replica.State.STARTING)


@dataclass(frozen=True)
class Upstream:
    replica: str
    base_url: str  # http://host:port
    engine_key: str
    host: str = field(init=False)  # as in the URL: an IPv6 address in brackets
    port: int = field(init=False)
    authorization: str = field(init=False, repr=False)  # the header the engine wants

    def __post_init__(self) -> None:
        host, port = self.base_url[len("http://"):].rsplit(":", 1)
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "port", int(port))
        object.__setattr__(self, "authorization", f"Bearer {self.engine_key}")


@dataclass(frozen=True)
class ModelRoute:
    name: str
    wait_seconds: int
    ready: tuple[Upstream, ...] = ()
    coming: int = 0  # replicas on their way (pending, downloading, starting): worth waiting for
    capabilities: frozenset[str] = frozenset(CAPABILITIES)  # what its engine serves, as its profile says
    max_tokens: int | None = None  # a completion's cap
    routing: str = Model.Routing.LEAST_INFLIGHT
    ring: Ring = field(default_factory=lambda: Ring(()))  # the ready replicas, for `prefix` (gateway/affinity.py)
    # autoscaled: a request finding no replica asks for one (at zero, it wakes the model) and waits for it
    autoscaled: bool = False
    no_room: str = ""  # why its replica cannot be placed and no room is coming: a request is answered at once
    context: int | None = None  # tokens of context its engine is started with (its profile's)
    max_logprobs: int | None = None  # top log-probabilities per token a request may ask for (None: no cap)
    max_choices: int | None = None  # choices a request may ask for (None: no cap)
    aliases: tuple[str, ...] = ()  # other names a request may give for it
    slots: int | None = None  # requests each replica takes at once (None: not known, admission leaves it be)
    queue_limit: int = 512  # requests that may wait for a slot
    max_wait: int = 120  # seconds one may wait for a slot
    resume_limit: int = 2  # times one answer may be resumed on another replica after its engine fails (0: never)
    stream_idle_timeout: float = 30.0  # seconds a streaming engine may send nothing before it counts as failed
    grammar: bool = False  # its engine takes a GBNF grammar with a request (ground.engines: llama.cpp's)
    # a rollout watching: its canary replicas (of `ready`), and the share of new conversations they take
    canary: frozenset[str] = frozenset()
    canary_share: float = 0.0
    shadow: float = 0.0  # the share of the current side's requests also sent to the canary (gateway/shadow.py)

    def other_side(self, conversation: int) -> frozenset[str]:
        """The ready replicas a conversation does not go to while a rollout watches: the canary's or the current
        ones', as its key falls (the same key, the same side, in every web process). Nothing when its side has
        no replica ready: a request is never refused for the sake of a rollout."""
        if not self.canary:
            return frozenset()
        current, canary = self._sides
        if (conversation * 0x9E3779B97F4A7C15 % 2**64) / 2**64 < self.canary_share:
            return current if canary else frozenset()
        return canary if current else frozenset()

    @functools.cached_property
    def _sides(self) -> tuple[frozenset[str], frozenset[str]]:
        """The ready replicas of the current side, and of the canary (once per table load)."""
        names = frozenset(u.replica for u in self.ready)
        return names - self.canary, names & self.canary


@dataclass(frozen=True)
class KeyInfo:
    id: int
    name: str
    prefix: str
    models: frozenset[str]
    rpm: int | None
    tpm: int | None
    expires_at: float | None
    revoked: bool
    max_tokens: int | None = None  # a completion's cap, below the model's
    priority: str = "standard"  # its requests' class (gateway/admission.py)
    budget_tokens: int | None = None  # tokens per budget period (gateway/budgets.py)
    budget_period: str = ""
    max_concurrency: int | None = None  # its requests in flight at once
    log_bodies: bool = False  # its requests' bodies kept in their records


@dataclass(frozen=True)
class Table:
    serving_stopped: bool
    models: dict[str, ModelRoute]
    keys: dict[str, KeyInfo]  # by key hash
    loaded_at: float = field(default_factory=time.monotonic)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> model name
    # every replica that may still be answering (neither failed nor stopped): an answer from any other is given up
    live: frozenset[str] = frozenset()

    def find(self, name: str) -> ModelRoute | None:
        """The model a request names: by its own name first, so an alias never shadows a name, else by alias."""
        route = self.models.get(name)
        if route is None and name in self.aliases:
            route = self.models.get(self.aliases[name])
        return route


def _host(node_address: str, facts: Facts | None) -> str:
    host = (facts.get("advertise_address") if facts else None) or node_address or "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def load() -> Table:
    cluster = ClusterSettings.load()
    keys_by_fingerprint = {
        ClusterSettings.fingerprint(k): k for k in (cluster.engine_key, cluster.previous_engine_key) if k
    }
    ready: dict[str, list[Upstream]] = {}
    coming: dict[str, int] = {}
    unplaced: dict[str, int] = {}
    present: dict[str, int] = {}  # replicas that exist for the model and count toward it (ready or on the way)
    making_room: set[str] = set()
    just_freed = Q(state=Replica.State.STOPPED, restart=Replica.Restart.REPLACING,
                   state_changed_at__gte=timezone.now() - timedelta(seconds=FREED_RECENTLY))
    rows = Replica.objects.filter(
        Q(state__in=(Replica.State.READY, Replica.State.DRAINING, Replica.State.STOPPING, *WAITING_STATES)) | just_freed,
        model__removing=False,
    ).values_list("name", "state", "port", "snapshot", "model__name", "node__address", "node__facts", "node_id",
                  "waiting_for_room", "reason", "rollout__state", "rollout__traffic", "rollout__shadow")
    no_room: dict[str, str] = {}
    canary: dict[str, set[str]] = {}
    share: dict[str, tuple[float, float]] = {}
    for (name, state, port, snapshot, model, address, facts, node_id, waiting_for_room, reason, rollout, traffic,
         shadow) in rows:
        if rollout is not None:  # a rollout's canary: its side of the model's traffic, not one of its own replicas
            if rollout == Rollout.State.WATCHING and state == Replica.State.READY and port:
                key = keys_by_fingerprint.get((snapshot or {}).get("engine_key", ""), cluster.engine_key)
                ready.setdefault(model, []).append(Upstream(name, f"http://{_host(address, facts)}:{port}", key))
                canary.setdefault(model, set()).add(name)
                share[model] = (traffic, shadow)
            continue
        if state == Replica.State.READY or state in WAITING_STATES:
            present[model] = present.get(model, 0) + 1
        if state == Replica.State.READY and port:
            key = keys_by_fingerprint.get((snapshot or {}).get("engine_key", ""), cluster.engine_key)
            ready.setdefault(model, []).append(Upstream(name, f"http://{_host(address, facts)}:{port}", key))
        elif state in (Replica.State.DRAINING, Replica.State.STOPPING, Replica.State.STOPPED):
            making_room.add(model)
        elif state == Replica.State.PENDING and node_id is None:
            if waiting_for_room:  # an eviction makes room for it, or a node reconnects: worth waiting for
                coming[model] = coming.get(model, 0) + 1
            else:
                unplaced[model] = unplaced.get(model, 0) + 1
                no_room.setdefault(model, reason)
        elif state in WAITING_STATES:
            coming[model] = coming.get(model, 0) + 1
    for model, n in unplaced.items():
        # A pending replica with no node cannot be placed yet. It is on its way only while one of its model's
        # replicas is draining or stopping, or was just replaced and stopped, freeing the room it waits for (a
        # restart with no room for a second copy: the next reconcile places it there). Otherwise nothing is
        # coming and a request is answered at once.
        if model in making_room:
            coming[model] = coming.get(model, 0) + n
    models = {}
    demanded = dict(Demand.objects.values_list("model_id", "replicas"))
    for m in Model.objects.filter(removing=False).select_related("engine", "profile"):
        name, wanted = m.name, m.replicas
        if m.autoscaled:  # what its autoscaler wants now
            wanted = demanded.get(m.id, m.min_replicas or 0)  # autoscaled: min_replicas is set
        # Replicas the model wants that do not exist yet: the reconciler's next run creates them (a model just
        # added, scaled up, or serving just started again). Worth waiting for; once the reconciler finds no room
        # it creates them unplaced, and they no longer count here.
        missing = 0 if cluster.serving_stopped else max(0, wanted - present.get(name, 0))
        upstreams = tuple(sorted(ready.get(name, []), key=lambda u: u.replica))
        serves = frozenset(m.capabilities())
        models[name] = ModelRoute(name, m.wait_seconds, upstreams, coming.get(name, 0) + missing, serves, m.max_tokens,
                                  m.routing, Ring(u.replica for u in upstreams), m.autoscaled,
                                  no_room.get(name, "") if name not in making_room else "", m.context(),
                                  m.max_logprobs, m.max_choices, tuple(m.aliases), m.slots(),
                                  m.queue_limit if m.queue_limit is not None else cluster.queue_limit,
                                  m.max_wait_seconds if m.max_wait_seconds is not None else cluster.max_wait_seconds,
                                  resume_limit=m.resume_limit,
                                  stream_idle_timeout=float(m.stream_idle_timeout_seconds),
                                  grammar=getattr(DRIVERS.get(m.engine.kind), "grammar", False),
                                  canary=frozenset(canary.get(name, ())), canary_share=share.get(name, (0.0, 0.0))[0],
                                  shadow=share.get(name, (0.0, 0.0))[1])
    # each alias names one model (the operations check); were a race to give one to two, the first by name has it
    aliases = {alias: name for name in sorted(models, reverse=True) for alias in models[name].aliases}
    keys = {
        k["key_hash"]: KeyInfo(
            id=k["id"],
            name=k["name"],
            prefix=k["prefix"],
            models=frozenset(k["allowed_models"] or ()),
            rpm=k["rpm"],
            tpm=k["tpm"],
            max_tokens=k["max_tokens"],
            expires_at=k["expires_at"].timestamp() if k["expires_at"] else None,
            revoked=k["revoked_at"] is not None,
            priority=k["priority"],
            budget_tokens=k["budget_tokens"],
            budget_period=k["budget_period"],
            max_concurrency=k["max_concurrency"],
            log_bodies=k["log_bodies"],
        )
        for k in ApiKey.objects.values("id", "name", "prefix", "key_hash", "allowed_models", "rpm", "tpm", "max_tokens",
                                   "expires_at", "revoked_at", "priority", "budget_tokens", "budget_period",
                                   "max_concurrency", "log_bodies")
    }
    live = frozenset(Replica.objects.exclude(state__in=(Replica.State.FAILED, Replica.State.STOPPED))
                     .values_list("name", flat=True))
    return Table(serving_stopped=cluster.serving_stopped, models=models, keys=keys, aliases=aliases, live=live)
