"""The autoscaler, run by the reconciler before it plans: for each autoscaled model, what the gateways see (requests
in flight and waiting, the last request) against the state kept in its Demand row decides the replicas it wants
now (cluster.planner.scaling). The state is saved, and each change written as an Event with its figures, in the
reconciler's transaction; a restarted control plane carries on from the database.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from django.conf import settings

from cluster import inflight
from cluster.events import record
from cluster.models import Demand
from cluster.planner import READY, Snapshot
from cluster.planner.scaling import Decision, DemandState, Seen, decide

ACTOR = "autoscaler"


def _epoch(value) -> float | None:
    return value.timestamp() if value else None


def _time(value: float | None):
    return datetime.fromtimestamp(value, tz=UTC) if value is not None else None


@dataclasses.dataclass
class Scaled:
    """What one run decided: the new states to save, the decisions to record."""

    states: dict[int, DemandState] = dataclasses.field(default_factory=dict)  # model id -> state
    decisions: dict[int, Decision] = dataclasses.field(default_factory=dict)
    names: dict[int, str] = dataclasses.field(default_factory=dict)


def load_states(model_ids) -> dict[int, DemandState]:
    return {
        d.model_id: DemandState(
            replicas=d.replicas,
            samples=tuple((float(t), float(load)) for t, load in (d.samples or [])),
            below_since=_epoch(d.below_since),
            last_request=_epoch(d.last_request_at),
            last_scaled=_epoch(d.last_scaled_at),
        )
        for d in Demand.objects.filter(model_id__in=model_ids)
    }


def scale(snapshot: Snapshot, redis) -> tuple[Snapshot, Scaled]:
    """The snapshot with each autoscaled model's `replicas` as the autoscaler now wants, what it sees of the
    model's demand (for the planner's evictions), and what to save."""
    scaled = Scaled()
    autoscaled = [m for m in snapshot.models if m.scaling is not None and not m.removing]
    if not autoscaled:
        return snapshot, scaled
    scaled_ids = {m.id for m in autoscaled}
    states = load_states(scaled_ids)
    waiting = inflight.waiting(redis)
    last = inflight.last_requests(redis)
    names = {r.name: r.model_id for r in snapshot.replicas}
    per_model: dict[int, int] = {}
    for replica, n in snapshot.inflight.items():
        model_id = names.get(replica)
        if model_id is not None:
            per_model[model_id] = per_model.get(model_id, 0) + n
    ready: dict[int, int] = {}
    for r in snapshot.replicas:
        if r.state == READY and r.restart != "replacing":
            ready[r.model_id] = ready.get(r.model_id, 0) + 1
    window = float(settings.LLMGW_AUTOSCALE_WINDOW)
    models = []
    for m in snapshot.models:
        if m.id not in scaled_ids or m.scaling is None:  # (one in scaled_ids has its scaling)
            models.append(m)
            continue
        state = states.get(m.id) or DemandState(replicas=m.scaling.min)
        n_waiting, since = waiting.get(m.name, (0, None))
        seen = Seen(inflight=per_model.get(m.id, 0), waiting=n_waiting, last_request=last.get(m.name),
                    ready=ready.get(m.id, 0))
        state, decision = decide(m.scaling, state, seen, snapshot.now, window)
        scaled.states[m.id] = state
        scaled.names[m.id] = m.name
        if decision is not None:
            scaled.decisions[m.id] = decision
        models.append(dataclasses.replace(m, replicas=state.replicas, last_request=state.last_request,
                                          waiting=n_waiting, waiting_since=since))
    return dataclasses.replace(snapshot, models=tuple(models)), scaled


def save(scaled: Scaled) -> None:
    """In the reconciler's transaction: each model's state, and an Event for each change of its replicas."""
    for model_id, state in scaled.states.items():
        values = {
            "replicas": state.replicas,
            "samples": [[round(t, 3), load] for t, load in state.samples],
            "below_since": _time(state.below_since),
            "last_request_at": _time(state.last_request),
            "last_scaled_at": _time(state.last_scaled),
        }
        Demand.objects.update_or_create(model_id=model_id, defaults=values)
    for model_id, d in scaled.decisions.items():
        name = scaled.names[model_id]
        record("model.scaled", ACTOR, f"model {name}: {d.before} -> {d.after} replica(s): {d.why}", subject=name,
               before=d.before, after=d.after, **d.figures)


def evicted(model_id: int, name: str, why: str) -> None:
    """A replica of the model was stopped to make room for another: it wants one fewer now (down to its minimum;
    a request for it wakes it again)."""
    demand = Demand.objects.select_for_update().filter(model_id=model_id).first()
    if demand is None or demand.replicas == 0:
        return
    minimum = demand.model.min_replicas or 0
    if demand.replicas <= minimum:
        return
    before = demand.replicas
    demand.replicas = before - 1
    demand.samples = []
    demand.below_since = None
    demand.save(update_fields=["replicas", "samples", "below_since", "updated_at"])
    record("model.scaled", ACTOR, f"model {name}: {before} -> {before - 1} replica(s): {why}", subject=name,
           before=before, after=before - 1)
