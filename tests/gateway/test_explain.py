"""Why a request went to its replica (gateway/explain.py), as its record says it."""

from gateway.explain import explain
from gateway.records import Why

LOADS = {"a": 4, "b": 1, "c": 0}


def why(chosen, walk=None, tried=None, unreachable=(), **flags) -> Why:
    return explain(list(LOADS), chosen=chosen, walk=walk, load_of=LOADS.__getitem__, tried=tried or {},
                   unreachable=unreachable, **flags)


def test_prefix_its_keys_replica_taking_it_is_a_hit_of_its_prefix_or_its_session():
    assert why("b", walk=iter("bca")) == Why("prefix", "prefix", "b (1 in flight)", ())
    assert why("b", walk=iter("bca"), session=True).hit == "session"


def test_prefix_a_busy_replica_passed_over_names_the_bound_it_was_over():
    # 5 in flight over 3 replicas, with this one: ceil(1.0 × 6 / 3) = 2; a's 4 (+1) is over it
    assert why("b", walk=iter("abc")) == Why("prefix", "", "b (1 in flight)",
                                             (("a", "busy: 4 in flight, over the bound of 2"),))
    assert why("b", walk=iter("abc"), factor=2.0).passed == (("a", "busy: 4 in flight, over the bound of 4"),)
    assert why("b", walk=iter("abc"), queued=True).passed == (("a", "no free slot"),)  # admission's pick


def test_tried_and_unreachable_replicas_say_so_before_their_load():
    failed = why("c", walk=iter("abc"), tried={"a": "failed: connection refused"}, unreachable={"b"})
    assert failed.hit == "" and failed.passed == (("a", "tried: failed: connection refused"), ("b", "unreachable lately"))


def test_least_in_flight_names_every_other_replica_and_its_load():
    assert why("c") == Why("least in flight", "", "c (0 in flight)", (("a", "4 in flight"), ("b", "1 in flight")))
    even = explain(["x", "y"], chosen="y", walk=None, load_of=lambda _: 2, tried={}, unreachable=())
    assert even.passed == (("x", "2 in flight, as few (chosen at random)"),)
    assert even.shown() == {"policy": "least in flight", "hit": "", "chosen": "y (2 in flight)",
                            "passed": [["x", "2 in flight, as few (chosen at random)"]]}
