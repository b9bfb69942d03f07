"""The autoscaler's rule on plain data (cluster.planner.scaling): waking, idling, scaling up over a window, down
after a delay, and the operator's range."""

import pytest

from cluster.planner.scaling import DemandState, Scaling, Seen, average, decide

WINDOW = 60.0
NOW = 100_000.0


def cfg(min=0, max=4, target=4, idle_after=900, scale_down_delay=300):
    return Scaling(min=min, max=max, target=target, idle_after=idle_after, scale_down_delay=scale_down_delay)


def steady(replicas, load, seconds=WINDOW, **kw):
    """A state that has seen `load` for `seconds` up to NOW."""
    samples = tuple((NOW - seconds + t, float(load)) for t in range(0, int(seconds), 5))
    return DemandState(replicas=replicas, samples=samples, last_request=NOW - 1, **kw)


def test_a_request_waiting_wakes_a_model_at_zero():
    state, decision = decide(cfg(), DemandState(replicas=0), Seen(waiting=2), NOW, WINDOW)
    assert state.replicas == 1 and (decision.before, decision.after) == (0, 1)
    assert decision.why == "woken: 2 request(s) waiting"
    assert state.last_request == NOW
    state, decision = decide(cfg(min=0), DemandState(replicas=0), Seen(), NOW, WINDOW)
    assert state.replicas == 0 and decision is None  # nothing asks: it stays at zero


def test_an_idle_on_demand_model_goes_to_zero():
    busy_a_while_ago = DemandState(replicas=1, last_request=NOW - 901)
    state, decision = decide(cfg(), busy_a_while_ago, Seen(ready=1), NOW, WINDOW)
    assert state.replicas == 0 and decision.why == "idle: no request for 15m" and decision.figures == {"idle_seconds": 901}
    recently = DemandState(replicas=1, last_request=NOW - 60)
    assert decide(cfg(), recently, Seen(ready=1), NOW, WINDOW)[0].replicas == 1
    # the last request as a gateway reports it counts too, and a request in flight is a request now
    assert decide(cfg(), busy_a_while_ago, Seen(ready=1, last_request=NOW - 5), NOW, WINDOW)[0].replicas == 1
    assert decide(cfg(), busy_a_while_ago, Seen(ready=1, inflight=1), NOW, WINDOW)[0].replicas == 1
    # with a minimum above zero it never idles away
    assert decide(cfg(min=1), busy_a_while_ago, Seen(ready=1), NOW, WINDOW)[0].replicas == 1


def test_above_the_target_for_a_window_one_more_replica():
    state, decision = decide(cfg(min=1), steady(1, 6), Seen(inflight=6, ready=1), NOW, WINDOW)
    assert state.replicas == 2 and decision.after == 2
    assert decision.figures["per_replica"] > 4 and decision.figures["target"] == 4
    assert state.samples == ((NOW, 6.0),)  # the next step is measured with two replicas
    # not yet a whole window of it, a replica still on its way, or at the maximum: no more
    assert decide(cfg(min=1), steady(1, 6, seconds=20), Seen(inflight=6, ready=1), NOW, WINDOW)[1] is None
    assert decide(cfg(min=1), steady(2, 12), Seen(inflight=12, ready=1), NOW, WINDOW)[1] is None
    assert decide(cfg(min=1, max=2), steady(2, 12), Seen(inflight=12, ready=2), NOW, WINDOW)[1] is None


def test_below_the_target_for_the_delay_one_fewer():
    low = steady(3, 2)  # 2 requests in flight need 1 replica at a target of 4
    state, decision = decide(cfg(min=1), low, Seen(inflight=2, ready=3), NOW, WINDOW)
    assert state.replicas == 3 and decision is None and state.below_since == NOW  # the delay begins
    decisions = []
    for t in range(5, 305, 5):  # the reconciler's runs, every 5 s
        state, decision = decide(cfg(min=1), state, Seen(inflight=2, ready=3), NOW + t, WINDOW)
        decisions.append((t, decision))
    [(t, decision)] = [(t, d) for t, d in decisions if d is not None]
    assert t == 300 and (decision.before, decision.after) == (3, 2) and state.below_since is None
    # busy again before the delay is over: the clock starts again
    state, _ = decide(cfg(min=1), low, Seen(inflight=2, ready=3), NOW, WINDOW)
    state, decision = decide(cfg(min=1), steady(3, 12), Seen(inflight=12, ready=3), NOW + 100, WINDOW)
    assert decision is None and state.below_since is None
    # load never takes an on-demand model to zero: only idleness does
    state, decision = decide(cfg(min=0, scale_down_delay=0), steady(1, 0), Seen(ready=1), NOW, WINDOW)
    assert state.replicas == 1 and decision is None


def test_the_range_the_operator_sets_applies_at_once():
    state, decision = decide(cfg(min=0, max=2), DemandState(replicas=4, last_request=NOW), Seen(), NOW, WINDOW)
    assert state.replicas == 2 and decision.why == "its range is now 0 to 2"
    state, decision = decide(cfg(min=3, max=5), DemandState(replicas=1, last_request=NOW), Seen(), NOW, WINDOW)
    assert state.replicas == 3


def test_never_asked_for_on_demand_model_stays_unloaded():
    state, decision = decide(cfg(), DemandState(replicas=1), Seen(ready=1), NOW, WINDOW)
    assert state.replicas == 0 and decision.why == "idle: no request yet"


def test_a_model_made_on_demand_keeps_what_it_ran_for_its_idle_time_without_a_made_up_request():
    made_on_demand = DemandState(replicas=2, last_scaled=NOW - 60)  # no request: none is recorded
    state, decision = decide(cfg(), made_on_demand, Seen(ready=2), NOW, WINDOW)
    assert (state.replicas, decision, state.last_request) == (2, None, None)
    state, decision = decide(cfg(), DemandState(replicas=2, last_scaled=NOW - 901), Seen(ready=2), NOW, WINDOW)
    assert state.replicas == 0 and decision.why == "idle: no request since it was last scaled, 15m ago"


@pytest.mark.parametrize("samples, expected", [
    ((), 0.0),
    (((NOW - 10, 4.0),), 4.0),
    (((NOW - 30, 0.0), (NOW - 10, 8.0)), 8 * 10 / 30),  # 0 for 20 s, then 8 for 10 s
])
def test_the_load_is_averaged_over_time(samples, expected):
    assert average(samples, NOW, 30) == pytest.approx(expected)


def test_samples_older_than_the_window_are_forgotten_but_the_last_before_it():
    old = DemandState(replicas=1, samples=((NOW - 500, 50.0), (NOW - 90, 2.0), (NOW - 30, 1.0)), last_request=NOW)
    state, _ = decide(cfg(min=1), old, Seen(inflight=1, ready=1), NOW, WINDOW)
    assert [t for t, _ in state.samples] == [NOW - 90, NOW - 30, NOW]
    assert average(state.samples, NOW, WINDOW) == pytest.approx((2 * 30 + 1 * 30) / 60)


def test_a_step_is_seen_at_the_first_run_after_it_whatever_the_runs_spacing():
    # runs every 2 s with a 4 s window: the window is covered by the sample from before it
    state = DemandState(replicas=1, samples=((NOW - 6, 0.0), (NOW - 4.1, 0.0), (NOW - 2, 0.0)), last_request=NOW)
    state, decision = decide(cfg(min=1, target=1), state, Seen(inflight=4, ready=1), NOW, 4.0)
    assert decision is None  # 4 in flight just now: not yet above the target on average
    state, decision = decide(cfg(min=1, target=1), state, Seen(inflight=4, ready=1), NOW + 2, 4.0)
    assert decision is not None and decision.after == 2  # two of the last four seconds at 4: 2.0 per replica
