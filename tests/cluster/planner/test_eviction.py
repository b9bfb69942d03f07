"""Room for a model that is asked for (cluster.planner.eviction), on plain data: idle replicas of autoscaled models
are evicted, least recently used first; never a fixed model's, never below a minimum, never before the minimum
residency, and one with requests in flight only once the model asking has waited that long too."""

from dataclasses import replace

from cluster.planner import DRAINING, PENDING, READY, Assign, Create, Evict, Unplaceable, plan
from cluster.planner.scaling import Scaling
from tests.cluster.planner.snapshots import NOW, GiB, model, node, of, rep, snap, step

ON_DEMAND = Scaling(min=0, max=1, target=4, idle_after=900, scale_down_delay=300)
RESIDENT = 30.0


def asked(id, name, waiting=1, since=NOW - 1, **kw):
    """An on-demand model with requests waiting for it and nothing placed yet."""
    return model(id, name, mem=6 * GiB, scaling=ON_DEMAND, waiting=waiting, waiting_since=since, **kw)


def resident(id, name, last_request, **kw):
    return model(id, name, mem=6 * GiB, scaling=kw.pop("scaling", ON_DEMAND), last_request=last_request, **kw)


def waiting_replica(actions, model_id):
    [u] = [a for a in of(actions, Unplaceable) if a.model_id == model_id]
    return u


def test_an_idle_on_demand_replica_makes_room_for_a_model_asked_for():
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 100), asked(2, "b")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 60)], min_resident=RESIDENT)
    actions = plan(s)
    [evict] = of(actions, Evict)
    assert (evict.replica_id, evict.for_model, evict.inflight) == (1, "b", 0)
    assert "model a least recently used, idle" in evict.reason
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "waiting for room: evicting r1 on n1" in u.reason
    # the next runs: the evicted replica stops, and the model asked for is placed where it was
    for _ in range(3):
        s = step(s)
    assert [(r.model_id, r.node_id, r.state) for r in s.replicas] == [(2, 1, READY)]
    assert [m.replicas for m in s.models] == [0, 1]


def test_the_least_recently_used_goes_first():
    s = snap([node(1, ram=8 * GiB), node(2, ram=8 * GiB)],
             [resident(1, "recent", NOW - 10), resident(3, "old", NOW - 500), asked(2, "b")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600), rep(3, 3, 2, READY, mem=6 * GiB, changed=NOW - 600)],
             min_resident=RESIDENT)
    [evict] = of(plan(s), Evict)
    assert evict.replica_id == 3


def test_a_fixed_model_is_never_evicted_and_the_reason_says_so():
    s = snap([node(1, ram=8 * GiB)], [model(1, "fixed", mem=6 * GiB), asked(2, "b")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)], min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict)
    u = waiting_replica(actions, 2)
    assert not u.waiting_for_room
    assert u.reason.endswith("nothing to evict (model fixed is not autoscaled)"), u.reason
    assert u.reason.startswith("needs 6.0 GiB RAM")


def test_never_below_a_models_minimum():
    keeps_one = Scaling(min=1, max=2, target=4, idle_after=900, scale_down_delay=300)
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 500, scaling=keeps_one), asked(2, "b")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)], min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict) and not waiting_replica(actions, 2).waiting_for_room


def test_not_before_the_minimum_residency():
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 1), asked(2, "b")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 10)], min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict)
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "serves at least until" in u.reason and "(the minimum residency)" in u.reason


def test_one_with_requests_in_flight_only_once_the_other_has_waited_the_minimum():
    models = [resident(1, "a", NOW), asked(2, "b", since=NOW - 5)]
    replicas = [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)]
    s = snap([node(1, ram=8 * GiB)], models, replicas, min_resident=RESIDENT, inflight={"r1": 2})
    actions = plan(s)
    assert not of(actions, Evict)
    assert "has requests in flight; it stops taking new ones at" in waiting_replica(actions, 2).reason
    s = snap([node(1, ram=8 * GiB)], [models[0], asked(2, "b", since=NOW - 31)], replicas, min_resident=RESIDENT,
             inflight={"r1": 2})
    [evict] = of(plan(s), Evict)  # it drains: no new request, and it stops once its two are answered
    assert evict.inflight == 2 and "2 request(s) in flight, admitting no new one" in evict.reason


def test_a_model_with_requests_queued_for_a_slot_serves_them_before_it_is_swapped_out():
    busy = resident(1, "a", NOW, waiting=3, waiting_since=NOW - 2)
    replicas = [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)]
    s = snap([node(1, ram=8 * GiB)], [busy, asked(2, "b", since=NOW - 5)], replicas, min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict)
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "model a has 3 request(s) waiting for a slot; replica r1 serves them until" in u.reason
    # bounded: once the model asking has waited the minimum residency, the swap happens
    s = snap([node(1, ram=8 * GiB)], [busy, asked(2, "b", since=NOW - 31)], replicas, min_resident=RESIDENT)
    [evict] = of(plan(s), Evict)
    assert evict.replica_id == 1


def test_a_model_nobody_waits_for_evicts_nothing():
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 500), asked(2, "b", waiting=0, since=None)],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)], min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict) and not waiting_replica(actions, 2).waiting_for_room


def test_a_replica_already_on_its_way_out_is_waited_for():
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 500), asked(2, "b")],
             [rep(1, 1, 1, DRAINING, mem=6 * GiB, changed=NOW - 1), rep(2, 2, None, PENDING, mem=6 * GiB)],
             min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict)
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "a replica stopping on n1 frees it" in u.reason


def test_two_models_asked_for_do_not_evict_the_same_replica():
    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW - 500), asked(2, "b"), asked(3, "c")],
             [rep(1, 1, 1, READY, mem=6 * GiB, changed=NOW - 600)], min_resident=RESIDENT)
    actions = plan(s)
    assert len(of(actions, Evict)) == 1
    assert all(waiting_replica(actions, m).waiting_for_room for m in (2, 3))


def test_a_replica_still_loading_is_evicted_only_after_it_has_served():
    from cluster.planner import STARTING

    s = snap([node(1, ram=8 * GiB)], [resident(1, "a", NOW), asked(2, "b")],
             [rep(1, 1, 1, STARTING, mem=6 * GiB, changed=NOW - 1)], min_resident=RESIDENT)
    actions = plan(s)
    assert not of(actions, Evict)
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "replica r1 of model a is loading" in u.reason


def test_two_models_asked_for_at_once_the_second_waits_for_the_first_to_have_served():
    first = asked(1, "a")
    s = snap([node(1, ram=8 * GiB)], [replace(first, replicas=1), replace(asked(2, "b"), replicas=1)], [],
             min_resident=RESIDENT)
    actions = plan(s)
    assert [a.model_id for a in of(actions, Create)] == [1]
    u = waiting_replica(actions, 2)
    assert u.waiting_for_room and "model a is loading on n1" in u.reason


def test_room_made_for_a_model_goes_to_it_not_to_one_asked_for_since():
    # b's replica waits for the room a's evicted replica frees; a, woken again meanwhile, comes after it
    models = [asked(1, "a", since=NOW - 1), asked(2, "b", since=NOW - 10)]
    replicas = [rep(2, 2, None, PENDING, mem=6 * GiB, waiting_for_room=True, reason="waiting for room: evicting r1")]
    actions = plan(snap([node(1, ram=8 * GiB)], models, replicas, min_resident=RESIDENT))
    assert [a.replica_id for a in of(actions, Assign)] == [2]
    u = waiting_replica(actions, 1)
    assert u.waiting_for_room and "model b is loading on n1" in u.reason
