"""Autoscaled and on-demand models in the domain: the operations' fields and refusals, and the reconciler acting on
what the gateways put in Redis (requests waiting, in flight, the last request), on a real database and Redis."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from cluster import inflight, operations, reconciler
from cluster.locks import redis_client
from cluster.models import ClusterSettings, Demand, Event, Replica
from cluster.operations import OperationError
from tests.factories import make_agent_node, make_file, make_model, make_replica, row_counts

GIB = 1024**3
ACTOR = "test"
S = Replica.State


@pytest.fixture
def gateway_said():
    """Write what a web process's gateway writes for the autoscaler, and clear it after."""
    r = redis_client()
    keys = []

    def say(waiting=None, last=None):
        if waiting:
            key = inflight.WAITING_PREFIX + f"test:{len(keys)}"
            r.hset(key, mapping={m: f"{n} {time.time() - 1:.3f}" for m, n in waiting.items()})
            r.expire(key, 30)
            keys.append(key)
        if last:
            r.hset(inflight.LAST_REQUEST, mapping={m: f"{t:.3f}" for m, t in last.items()})

    yield say
    r.delete(*keys, inflight.LAST_REQUEST)


def add(name, file=None, **kw):
    file = file or make_file()
    return operations.add_model(name, ACTOR, file=file.sha256, engine="llama.cpp", memory_bytes=2 * GIB, **kw)


# The operations


def test_a_model_is_fixed_or_autoscaled_and_says_which(db):
    fixed = add("fixed")
    assert (fixed.mode, fixed.replicas, fixed.min_replicas) == ("fixed", 1, None)
    ranged = add("ranged", min_replicas=1, max_replicas=3, target_inflight=2, scale_down_delay_seconds=60)
    assert ranged.mode == "autoscaled" and ranged.demand.replicas == 1
    lazy = add("lazy", min_replicas=0, max_replicas=2, idle_after_seconds=600)
    assert lazy.mode == "on-demand" and lazy.demand.replicas == 0
    said = Event.objects.get(kind="model.added", subject="lazy").message
    assert "0 to 2 replicas at 4 requests in flight each (one replica fewer after 5m below that, none after 10m idle)" in said


@pytest.mark.parametrize("values, message", [
    ({"replicas": 2, "min_replicas": 0, "max_replicas": 2}, "either a fixed number of replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "min replicas (3) is above max replicas (2)"),
    ({"min_replicas": 0, "max_replicas": 0}, "max replicas must be at least 1"),
    ({"min_replicas": -1, "max_replicas": 2}, "min replicas must be a whole number from 0"),
    ({"min_replicas": 1}, "give both min and max replicas"),
    ({"target_inflight": 3}, "target inflight is for an autoscaled model"),
    ({"replicas": 2, "idle_after_seconds": 60}, "idle after seconds is for an autoscaled model"),
    ({"min_replicas": 0, "max_replicas": 2, "idle_after_seconds": 10**9}, "idle after (seconds) must be a whole number"),
])
def test_bad_combinations_are_one_line_and_change_nothing(db, values, message):
    file = make_file()
    before = row_counts()
    with pytest.raises(OperationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        add("bad", file, **values)
    assert row_counts() == before


def test_set_switches_between_fixed_and_autoscaled(db):
    add("m", replicas=3)
    model = operations.set_model("m", ACTOR, min_replicas=0, max_replicas=2)
    assert model.mode == "on-demand"
    assert Demand.objects.get(model=model).replicas == 2  # from the three it ran, within its range
    model = operations.set_model("m", ACTOR, max_replicas=4, target_inflight=8)  # a range it has: half is enough
    assert (model.min_replicas, model.max_replicas, model.target_inflight) == (0, 4, 8)
    with pytest.raises(OperationError, match="either a fixed number"):
        operations.set_model("m", ACTOR, replicas=1, max_replicas=5)
    model = operations.set_model("m", ACTOR, replicas=1)
    assert model.mode == "fixed" and not Demand.objects.filter(model=model).exists()
    with pytest.raises(OperationError, match="give both min and max replicas"):
        operations.set_model("m", ACTOR, max_replicas=5)


def test_the_minimum_residency_is_a_cluster_setting(db):
    cluster = operations.set_settings(ACTOR, min_resident_seconds=5)
    assert cluster.min_resident_seconds == 5
    assert Event.objects.filter(kind="settings.changed").order_by("pk").last().data == {"min_resident_seconds": 5}


# The reconciler


def test_a_waiting_request_wakes_a_model_at_zero_and_it_idles_back_down(db, gateway_said):
    node = make_agent_node("n1", port_range=(21000, 21009))
    model = add("lazy", min_replicas=0, max_replicas=1, idle_after_seconds=60)
    reconciler.reconcile_once()
    assert not Replica.objects.filter(model=model).exists()  # loaded when asked for, not before

    gateway_said(waiting={"lazy": 2})
    reconciler.reconcile_once()
    [replica] = Replica.objects.filter(model=model)
    assert replica.node == node and replica.state == S.PENDING
    scaled = Event.objects.get(kind="model.scaled", subject="lazy")
    assert scaled.message == "model lazy: 0 -> 1 replica(s): woken: 2 request(s) waiting"
    assert scaled.data == {"before": 0, "after": 1, "waiting": 2, "inflight": 0}

    Replica.objects.filter(pk=replica.pk).update(state=S.READY)
    redis_client().delete(*redis_client().keys(inflight.WAITING_PREFIX + "test:*"))
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Demand.objects.filter(model=model).update(last_request_at=an_hour_ago)
    reconciler.reconcile_once()
    assert Replica.objects.get(pk=replica.pk).state == S.DRAINING  # nothing in flight: it stops next
    assert Demand.objects.get(model=model).replicas == 0
    idle = Event.objects.filter(kind="model.scaled", subject="lazy").order_by("pk").last()
    assert idle.message.startswith("model lazy: 1 -> 0 replica(s): idle: no request for 1h")


def test_the_last_request_a_gateway_saw_keeps_it_loaded(db, gateway_said):
    make_agent_node("n1", port_range=(21000, 21009))
    model = add("lazy", min_replicas=0, max_replicas=1, idle_after_seconds=60)
    Demand.objects.filter(model=model).update(replicas=1, last_request_at=timezone.now() - timedelta(hours=1))
    gateway_said(last={"lazy": time.time() - 5})
    reconciler.reconcile_once()
    demand = Demand.objects.get(model=model)
    assert demand.replicas == 1 and (timezone.now() - demand.last_request_at).total_seconds() < 10


def test_an_idle_on_demand_replica_is_evicted_for_a_model_asked_for(db, gateway_said):
    node = make_agent_node("n1", memory_bytes=3 * GIB, port_range=(21000, 21009))
    ClusterSettings.load()
    ClusterSettings.objects.update(min_resident_seconds=0)
    resident = add("resident", min_replicas=0, max_replicas=1)
    Demand.objects.filter(model=resident).update(replicas=1, last_request_at=timezone.now())
    old = make_replica(resident, node, state=S.READY, memory_bytes=2 * GIB,
                       state_changed_at=timezone.now() - timedelta(minutes=5))
    asked = add("asked", min_replicas=0, max_replicas=1)
    gateway_said(waiting={"asked": 1})

    reconciler.reconcile_once()
    assert Replica.objects.get(pk=old.pk).state == S.DRAINING
    [waiting] = Replica.objects.filter(model=asked)
    assert waiting.node is None and waiting.waiting_for_room and "evicting" in waiting.reason
    evicted = Event.objects.get(kind="replica.evicted")
    assert evicted.data == {"model": "resident", "for_model": "asked", "inflight": 0}
    assert Demand.objects.get(model=resident).replicas == 0  # it comes back when it is asked for

    reconciler.reconcile_once()  # drained (idle): stopped
    assert Replica.objects.get(pk=old.pk).state == S.STOPPING
    Replica.objects.filter(pk=old.pk).update(state=S.STOPPED)  # its agent says so
    reconciler.reconcile_once()
    waiting.refresh_from_db()
    assert waiting.node == node and not waiting.waiting_for_room


def test_a_fixed_model_is_never_evicted_and_the_event_says_what_blocked(db, gateway_said):
    node = make_agent_node("n1", memory_bytes=3 * GIB, port_range=(21000, 21009))
    fixed = make_model("fixed", memory_bytes=2 * GIB)
    kept = make_replica(fixed, node, state=S.READY, memory_bytes=2 * GIB)
    add("asked", min_replicas=0, max_replicas=1)
    gateway_said(waiting={"asked": 1})
    reconciler.reconcile_once()
    assert Replica.objects.get(pk=kept.pk).state == S.READY
    said = Event.objects.get(kind="replica.unplaceable").message
    assert said.endswith("nothing to evict (model fixed is not autoscaled)"), said


def test_the_autoscalers_state_is_in_the_database(db, gateway_said):
    make_agent_node("n1", port_range=(21000, 21009))
    model = add("busy", min_replicas=1, max_replicas=2, target_inflight=1)
    reconciler.reconcile_once()
    first = Demand.objects.get(model=model)
    assert first.replicas == 1 and len(first.samples) == 1
    reconciler.reconcile_once()
    assert len(Demand.objects.get(model=model).samples) == 2  # a restarted control plane reads these on
