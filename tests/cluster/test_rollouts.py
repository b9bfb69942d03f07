"""Rollouts on a real database: started, its canary placed with the new settings beside the model's replicas,
judged on request records, promoted (the model replaced one replica at a time) or rolled back, by hand too; and
what they refuse."""

import datetime as dt

import pytest
from django.utils import timezone

from cluster import operations, reconciler, reports
from cluster.errors import Conflict, NotFound, OperationError
from cluster.memory import estimate
from cluster.models import ClusterSettings, Event, Model, Replica, Rollout
from cluster.operations.rollouts import carry_on
from cluster.rollouts import Bounds, Side, judge
from gateway import rollout_figures
from gateway.models import RequestRecord
from tests.cluster.test_reconciler import report, report_none
from tests.factories import make_agent_node, make_model, make_profile, row_counts

S = Replica.State
GIB = 1024**3
ACTOR = "user:alice"
BOUNDS = Bounds(min_requests=10, max_error_rate=0.05, max_ttft_ratio=1.5, max_tpot_ratio=1.3)


def run(times: int = 1) -> None:
    for _ in range(times):
        reconciler.reconcile_once()


def later(seconds: float) -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=seconds)


def kinds(subject: str) -> list[str]:
    return list(Event.objects.filter(kind__startswith="rollout.", subject=subject).order_by("id")
                .values_list("kind", flat=True))


def served(model: str, replica: str, n: int, ttft: float = 100.0, status: int = 200, outcome: str = "answered 200",
           at: dt.datetime | None = None) -> None:
    """`n` request records of streams `replica` answered (first token after `ttft` ms, 11 tokens, 10 ms each)."""
    at = at or timezone.now()
    RequestRecord.objects.bulk_create([RequestRecord(
        request_id=f"req_{replica}_{i}_{ttft}", at=at, model=model, surface="chat/completions", streamed=True,
        status=status, replica=replica, attempts=1, ttft_ms=ttft, total_ms=ttft + 100, completion_tokens=11,
        tries=[[replica, 0, ttft + 100, outcome]]) for i in range(n)])


@pytest.fixture
def fleet(db):
    node = make_agent_node("n1", memory_bytes=8 * GIB, port_range=(21000, 21019))
    model = make_model("m1", replicas=2, memory_bytes=GIB)
    make_profile("fast", context_size=8192, threads=2)
    run()
    report(Replica.objects.filter(model=model), "ready")
    return node, model


def canaries(rollout) -> list[Replica]:
    return list(Replica.objects.filter(rollout=rollout).exclude(state__in=Replica.TERMINAL))


def ready_canary(model):
    rollout = operations.start_rollout(model.name, ACTOR, profile="fast", watch_seconds=60, min_requests=10)
    run()
    [canary] = canaries(rollout)
    report([canary], "ready")
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    return rollout, canary


# the verdict


def test_the_canary_holding_every_bound_over_the_window_is_promoted():
    good = Side(requests=20, errors=0, timed=20, ttft_p50=110, tpot_p50=10)
    current = Side(requests=200, errors=1, timed=200, ttft_p50=100, tpot_p50=10)
    assert judge(good, current, BOUNDS, elapsed=30, watch=60).why == "watching: 30s of the window left"
    verdict = judge(good, current, BOUNDS, elapsed=61, watch=60)
    assert verdict.promote and not verdict.roll_back
    assert verdict.why == ("the canary held every bound over the window: errors 0 of 20 (0%), median time to first "
                           "token 1.10x the current replicas', median time per output token 1.00x the current "
                           "replicas'")


def test_a_quiet_canary_is_watched_on_until_it_has_its_requests():
    verdict = judge(Side(requests=3), Side(requests=100), BOUNDS, elapsed=600, watch=60)
    assert not (verdict.promote or verdict.roll_back)
    assert verdict.why == "waiting for requests: the canary has 3 of 10"


def test_errors_past_what_the_least_requests_allow_roll_back_at_once():
    # 5% of at least 10 allows none: the first error already puts it over, whatever follows
    verdict = judge(Side(requests=2, errors=1), Side(requests=50), BOUNDS, elapsed=1, watch=60)
    assert verdict.roll_back
    assert verdict.why == ("the canary's errors: 1 of 2 requests (50%), over the bound of 5% of at least 10 "
                           "(the current replicas: 0 of 50)")
    assert not judge(Side(requests=40, errors=2), Side(requests=50), BOUNDS, elapsed=1, watch=60).roll_back


def test_latency_is_a_ratio_to_the_current_side_once_both_have_their_requests():
    slow = Side(requests=20, timed=20, ttft_p50=400, tpot_p50=10)
    assert not judge(slow, Side(requests=9, timed=9, ttft_p50=100, tpot_p50=10), BOUNDS, 1, 60).roll_back
    verdict = judge(slow, Side(requests=20, timed=20, ttft_p50=100, tpot_p50=10), BOUNDS, 1, 60)
    assert verdict.roll_back
    assert verdict.why == ("the canary's median time to first token: 400 ms against 100 ms, 4.00x, over the bound "
                           "of 1.5x")
    tpot = judge(Side(requests=20, timed=20, ttft_p50=100, tpot_p50=20),
                 Side(requests=20, timed=20, ttft_p50=100, tpot_p50=10), BOUNDS, 1, 60)
    assert tpot.roll_back and "time per output token: 20 ms against 10 ms, 2.00x" in tpot.why


def record(request_id: str, replica: str, ttft: float, total: float, tries: list) -> None:
    RequestRecord.objects.create(request_id=request_id, at=timezone.now(), model="m1", surface="chat/completions",
                                 streamed=True, status=200, replica=replica, attempts=len(tries), ttft_ms=ttft,
                                 total_ms=total, completion_tokens=11, tries=tries)


def test_the_figures_count_each_try_for_its_side_and_time_only_answered_streams(db):
    served("m1", "m1-canary", 3, ttft=300)
    served("m1", "m1-old", 4, ttft=100)
    served("m1", "m1-canary", 1, status=502, outcome="failed: the engine closed the connection")
    RequestRecord.objects.create(  # broke off on the canary, resumed on the current side: an error of the canary
        request_id="r", at=timezone.now(), model="m1", surface="chat/completions", streamed=True, status=200,
        replica="m1-old", attempts=2, ttft_ms=50, total_ms=500, completion_tokens=5,
        tries=[["m1-canary", 0, 100, "answered 200; broke off after 2 tokens; resumed"], ["m1-old", 100, 500, "answered 200"]])
    RequestRecord.objects.create(request_id="q", at=timezone.now(), model="m1", surface="chat/completions",
                                 status=429, total_ms=1, attempts=0)  # refused before any replica: no side's
    # time to first token from when the answering try began: not a wait in the queue, nor a failed try before it
    record("w", "m1-old", 600, 700, [["m1-old", 500, 700, "answered 200"]])
    record("f", "m1-old", 180, 280, [["m1-canary", 0, 30, "did not accept the connection"],
                                     ["m1-old", 80, 280, "answered 200"]])
    canary, current = rollout_figures.sides("m1", frozenset({"m1-canary"}), timezone.now() - dt.timedelta(seconds=5))
    # the resumed stream's first token came from the canary: its time is the canary's, its tokens per second no one's
    assert (canary.requests, canary.errors, canary.timed, canary.ttft_p50) == (6, 3, 4, 300.0)
    assert sorted(rollout_figures.tally([("m1-old", 200, True, 50, 500, 5, [
        ["m1-canary", 0, 100, "answered 200; resumed"], ["m1-old", 100, 500, "answered 200"]])], frozenset(
        {"m1-canary"}))[0].shown().items()) == sorted(Side(1, 1, 1, 50.0, 50.0, None, None).shown().items())
    assert (current.requests, current.errors, current.timed, current.ttft_p50, current.ttft_p99) == (
        7, 0, 6, 100.0, 100.0)
    assert canary.tpot_p50 == 10.0 and current.tpot_p50 == 10.0


# the lifecycle


def test_a_rollout_places_its_canary_with_the_new_settings_beside_the_model_and_is_promoted(fleet):
    node, model = fleet
    old = {r.name for r in Replica.objects.filter(model=model)}
    rollout = operations.start_rollout("m1", ACTOR, profile="fast", watch_seconds=60, min_requests=10)
    assert rollout.change == {"profile": ["default", "fast"]}
    run()
    [canary] = canaries(rollout)
    assert canary.snapshot["profile"] == "fast" and canary.snapshot["args"]["context_size"] == 8192
    [sent] = [r for r in reports.desired(node.pk, "http://cp")["replicas"] if r["name"] == canary.name]
    assert sent["args"]["context_size"] == 8192
    model.refresh_from_db()
    assert model.profile.name == "default"  # the model's own settings change only when it is promoted
    assert Replica.objects.filter(model=model, state=S.READY).count() == 2

    report([canary], "ready")
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.watching_since is not None and rollout.state == Rollout.State.WATCHING
    since = rollout.watching_since
    served("m1", canary.name, 12, at=since)
    for name in old:
        served("m1", name, 12, at=since)
    carry_on(rollout_figures.sides, now=since + dt.timedelta(seconds=30))
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.WATCHING
    assert rollout.figures["canary"]["requests"] == 12 and rollout.figures["current"]["requests"] == 24
    carry_on(rollout_figures.sides, now=since + dt.timedelta(seconds=61))
    rollout.refresh_from_db()
    model.refresh_from_db()
    assert rollout.state == Rollout.State.PROMOTING
    assert model.profile.name == "fast"
    canary.refresh_from_db()
    assert canary.rollout_id is None  # one of the model's own now
    assert {r.restart for r in Replica.objects.filter(name__in=old)} == {Replica.Restart.QUEUED}

    for _ in range(12):  # the old replicas replaced one at a time, as a restart does
        run()
        report(Replica.objects.filter(model=model, state__in=(S.PENDING, S.STARTING)), "ready")
        stopping = list(Replica.objects.filter(model=model, state=S.STOPPING))
        report(stopping, "stopped")
        carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.PROMOTED
    live = Replica.objects.filter(model=model).exclude(state__in=Replica.TERMINAL)
    assert live.count() == 2 and not live.filter(name__in=old).exists()
    assert {r.snapshot["profile"] for r in live} == {"fast"}
    assert kinds("m1") == ["rollout.started", "rollout.watching", "rollout.promoting", "rollout.promoted"]


def test_a_canary_whose_engine_fails_is_rolled_back_and_its_model_is_not_held_back(fleet):
    node, model = fleet
    rollout = operations.start_rollout("m1", ACTOR, profile="fast")
    run()
    [canary] = canaries(rollout)
    reports.report(node.pk, [{"name": canary.name, "state": "failed", "reason": "engine exited with code 1: "
                              "unknown argument --bogus"}], full=False)
    run()
    assert not canaries(rollout)  # none placed again meanwhile
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK  # nothing of it was left to drain
    assert rollout.reason == f"canary replica {canary.name} failed: engine exited with code 1: unknown argument --bogus"
    model.refresh_from_db()
    assert (model.failures, model.backoff_until, model.profile.name) == (0, None, "default")
    assert kinds("m1") == ["rollout.started", "rollout.rolling_back", "rollout.rolled_back"]


def test_errors_on_the_canary_roll_it_back_and_it_drains_before_it_is_rolled_back(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    served("m1", canary.name, 3, status=500, outcome="answered 500", at=rollout.watching_since)
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLING_BACK
    assert rollout.reason.startswith("the canary's errors: 3 of 3 requests (100%), over the bound of 1%")
    run()
    canary.refresh_from_db()
    assert canary.state in (S.DRAINING, S.STOPPING)
    assert canary.reason == "canary of model m1: its rollout is not watching"
    carry_on(rollout_figures.sides)
    assert Rollout.objects.get(pk=rollout.pk).state == Rollout.State.ROLLING_BACK  # until it is gone
    run(2)
    report([canary], "stopped")
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK and rollout.ended_at is not None
    assert Model.objects.get(pk=model.pk).profile.name == "default"
    event = Event.objects.get(kind="rollout.rolled_back")
    assert event.data["figures"]["canary"]["errors"] == 3


def test_a_canary_on_a_lost_node_is_placed_again_and_the_rollout_carries_on(db):
    make_agent_node("n1", memory_bytes=8 * GIB)
    n2 = make_agent_node("n2", memory_bytes=8 * GIB, port_range=(22000, 22009))
    model = make_model("m1", replicas=1, memory_bytes=GIB, nodes=[])
    make_profile("fast")
    run()
    rollout = operations.start_rollout("m1", ACTOR, profile="fast")
    run()
    [first] = canaries(rollout)
    lost = first.node
    lost.last_seen = timezone.now() - dt.timedelta(seconds=3600)
    lost.save()
    run(2)
    first.refresh_from_db()
    assert first.state == S.FAILED
    [again] = canaries(rollout)
    assert again.node_id == (n2.pk if lost.pk != n2.pk else again.node_id) and again.node_id != lost.pk
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert (rollout.state, rollout.failures) == (Rollout.State.WATCHING, 0)
    assert model.pk


def test_a_canary_lost_once_ready_and_not_placed_again_rolls_back_and_is_never_promoted(fleet, settings):
    node, model = fleet
    settings.LLMGW_ROLLOUT_READY_TIMEOUT = 60
    rollout, canary = ready_canary(model)
    since = rollout.watching_since
    served("m1", canary.name, 12, at=since)
    served("m1", Replica.objects.filter(model=model, rollout=None).first().name, 12, at=since)
    Replica.objects.filter(pk=canary.pk).update(state=S.FAILED, reason="node n1 lost")  # as the reconciler does
    carry_on(rollout_figures.sides, now=since + dt.timedelta(seconds=61))  # the window over, the figures good
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.WATCHING and rollout.unready_since is not None
    assert rollout.figures["verdict"] == "waiting for a canary replica to be ready again"
    carry_on(rollout_figures.sides, now=since + dt.timedelta(seconds=61 + 61))
    rollout.refresh_from_db()
    assert (rollout.state, rollout.reason) == (Rollout.State.ROLLED_BACK, "no canary replica ready for 60s")


def test_the_time_a_canary_has_to_be_ready_does_not_run_while_the_system_is_stopped(fleet, settings):
    node, model = fleet
    settings.LLMGW_ROLLOUT_READY_TIMEOUT = 60
    rollout = operations.start_rollout("m1", ACTOR, profile="fast")
    ClusterSettings.objects.update(serving_stopped=True)  # `llmgw stop` before the canary was ready
    carry_on(rollout_figures.sides, now=later(1200))
    ClusterSettings.objects.update(serving_stopped=False)  # `llmgw start` twenty minutes on
    carry_on(rollout_figures.sides, now=later(1201))
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.WATCHING
    carry_on(rollout_figures.sides, now=later(1200 + 61))
    rollout.refresh_from_db()
    assert (rollout.state, rollout.reason) == (Rollout.State.ROLLED_BACK, "no canary replica became ready in 60s")


def test_abort_by_hand_drains_the_canary_and_the_model_is_as_it_was(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.abort_rollout("m1", ACTOR)
    rollout.refresh_from_db()
    assert (rollout.state, rollout.reason) == (Rollout.State.ABORTED, f"aborted by {ACTOR}")
    run()
    canary.refresh_from_db()
    assert canary.state in (S.DRAINING, S.STOPPING)
    with pytest.raises(Conflict, match="model m1 has no rollout under way"):
        operations.abort_rollout("m1", ACTOR)
    assert operations.rollout_of("m1").pk == rollout.pk  # its last, finished


def test_a_rollout_that_sets_memory_places_its_canary_with_it_and_the_model_takes_it_once_promoted(fleet):
    node, model = fleet  # the model's memory set by hand: 1 GiB
    rollout = operations.start_rollout("m1", ACTOR, profile="fast", memory_bytes=2 * GIB)
    assert rollout.change == {"profile": ["default", "fast"], "memory": ["1.0 GiB", "2.0 GiB"]}
    assert rollout.change_text() == "profile default -> fast, memory 1.0 GiB -> 2.0 GiB"
    run()
    [canary] = canaries(rollout)
    assert canary.memory_bytes == 2 * GIB and node.replicas.filter(memory_bytes=GIB).count() == 2
    with pytest.raises(Conflict, match=r"model m1 has a rollout watching: its memory changes only through it"):
        operations.set_model("m1", ACTOR, memory_bytes=3 * GIB)
    operations.promote_rollout("m1", ACTOR)
    model.refresh_from_db()
    assert model.memory_bytes == 2 * GIB and model.profile.name == "fast"

    # `auto` (0): estimated from the new file and profile, and the model's figure cleared once promoted
    make_profile("long", context_size=32768)
    Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.PROMOTED)
    rollout = operations.start_rollout("m1", ACTOR, profile="long", memory_bytes=0)
    assert rollout.change["memory"] == ["2.0 GiB", "estimated"]
    run()
    [canary] = canaries(rollout)
    model.refresh_from_db()
    assert canary.memory_bytes == estimate(model.file.size, model.file.gguf or {}, 32768) != 2 * GIB
    operations.promote_rollout("m1", ACTOR)
    model.refresh_from_db()
    assert model.memory_bytes is None


def test_a_rollout_without_memory_leaves_the_model_s_as_it_is(fleet):
    node, model = fleet
    rollout = operations.start_rollout("m1", ACTOR, profile="fast", memory_bytes=GIB)  # the same: no change
    assert rollout.change == {"profile": ["default", "fast"]}
    run()
    [canary] = canaries(rollout)
    assert canary.memory_bytes == GIB
    operations.set_model("m1", ACTOR, memory_bytes=GIB + 1)  # a rollout that does not change it: set as ever
    operations.promote_rollout("m1", ACTOR)
    model.refresh_from_db()
    assert model.memory_bytes == GIB + 1


def test_promote_by_hand_while_watching(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.promote_rollout("m1", ACTOR)
    rollout.refresh_from_db()
    assert (rollout.state, rollout.reason) == (Rollout.State.PROMOTING, "promoted by hand")
    with pytest.raises(Conflict, match="is promoting: only a rollout watching may be promoted"):
        operations.promote_rollout("m1", ACTOR)


def replace_all(model, rollout) -> None:
    """The reconciler and the agents at work until the model's replicas are replaced one at a time as queued."""
    for _ in range(12):
        run()
        report(Replica.objects.filter(model=model, state__in=(S.PENDING, S.STARTING), node__isnull=False), "ready")
        report(list(Replica.objects.filter(model=model, state=S.STOPPING)), "stopped")
        carry_on(rollout_figures.sides)


def first_replacement(model, canary) -> Replica:
    """Promoted, the model has one replica too many (its canary joined it): one old one drains and stops; then
    the other's replacement is placed, on the new settings."""
    run()
    run()
    report(list(Replica.objects.filter(model=model, state=S.STOPPING)), "stopped")
    [new] = Replica.objects.filter(model=model, state=S.PENDING, node__isnull=False).exclude(pk=canary.pk)
    return new


def test_abort_while_promoting_sends_the_model_back_to_its_settings_before(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.promote_rollout("m1", ACTOR)
    assert first_replacement(model, canary).snapshot["profile"] == "fast"
    assert Replica.objects.filter(model=model, restart=Replica.Restart.REPLACING).count() == 1
    operations.abort_rollout("m1", ACTOR)
    rollout.refresh_from_db()
    model.refresh_from_db()
    assert (rollout.state, rollout.reason) == (Rollout.State.ROLLING_BACK, f"aborted by {ACTOR} while promoting")
    assert model.profile.name == "default"
    canary.refresh_from_db()
    assert canary.restart == Replica.Restart.QUEUED  # it runs the new settings: replaced in its turn
    with pytest.raises(Conflict, match="is rolling back: only a rollout watching or promoting may be aborted"):
        operations.abort_rollout("m1", ACTOR)
    replace_all(model, rollout)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK
    live = Replica.objects.filter(model=model).exclude(state__in=Replica.TERMINAL)
    assert live.count() == 2 and {r.snapshot["profile"] for r in live} == {"default"}
    assert kinds("m1") == ["rollout.started", "rollout.watching", "rollout.promoting", "rollout.rolling_back",
                           "rollout.rolled_back"]


def test_a_replica_on_the_new_settings_that_fails_while_promoting_sends_the_model_back(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.promote_rollout("m1", ACTOR)
    new = first_replacement(model, canary)
    assert new.snapshot["profile"] == "fast"
    report([new], "failed")  # say, another node's GPU cannot take the new settings
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    model.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLING_BACK
    assert rollout.reason.startswith(f"replica {new.name} on the new settings failed")
    assert (model.profile.name, model.failures, model.backoff_until) == ("default", 0, None)
    replace_all(model, rollout)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK
    live = Replica.objects.filter(model=model).exclude(state__in=Replica.TERMINAL)
    assert {r.snapshot["profile"] for r in live} == {"default"}


def test_an_old_replica_that_fails_while_promoting_is_not_the_new_settings_fault(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.promote_rollout("m1", ACTOR)
    old = Replica.objects.filter(model=model, restart=Replica.Restart.QUEUED).first()
    report([old], "failed")
    carry_on(rollout_figures.sides)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.PROMOTING and rollout.failures == 0


# refusals


@pytest.mark.parametrize(("values", "error"), [
    ({}, "nothing to roll out: give a --file, --profile or --engine other than model m1's own"),
    ({"profile": "default"}, "nothing to roll out"),
    ({"profile": "nope"}, "no profile named 'nope'"),
    ({"profile": "fast", "traffic": 0}, "a canary with no traffic and no shadow would never be judged: give "
                                        "--traffic or --shadow above 0%"),
    ({"profile": "fast", "traffic": 1.5}, "traffic (a share of new conversations) must be from 0 to 1, not 1.5"),
    ({"profile": "fast", "shadow": -0.1}, "shadow (a share of requests copied to the canary) must be from 0 to 1"),
    ({"profile": "fast", "canary": 0}, "canary replicas must be a whole number from 1 to 100, not 0"),
    ({"profile": "fast", "max_ttft_ratio": 0.5}, "max TTFT ratio must be from 1 to 1000, not 0.5"),
    ({"profile": "fast", "max_error_rate": "1%"}, "max error rate must be a number, not '1%'"),
    ({"profile": "fast", "shadow_traffic": 1}, "unknown rollout setting(s): shadow_traffic"),
    ({"memory_bytes": 2 * GIB}, "nothing to roll out: give a --file, --profile or --engine other than model m1's own "
                                "(its memory alone is set with `ctl model set m1 --memory`)"),
    ({"profile": "fast", "memory_bytes": -1}, "memory must be a whole number from 0"),
])
def test_a_bad_rollout_is_refused_and_changes_nothing(fleet, values, error):
    before = row_counts()
    with pytest.raises(OperationError, match=error.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        operations.start_rollout("m1", ACTOR, **values)
    assert row_counts() == before and not Rollout.objects.exists()


def test_one_rollout_per_model_and_its_settings_change_only_through_it(fleet):
    operations.start_rollout("m1", ACTOR, profile="fast")
    with pytest.raises(Conflict, match=r"model m1 has a rollout watching \(since .*\): one at a time"):
        operations.start_rollout("m1", ACTOR, profile="default", file=None, engine="llama.cpp")
    with pytest.raises(Conflict, match=r"model m1 has a rollout watching: its profile changes only through it"):
        operations.set_model("m1", ACTOR, profile="fast")
    operations.set_model("m1", ACTOR, replicas=3)  # what it does not change may
    with pytest.raises(Conflict, match="profile fast is being rolled out on model\\(s\\) m1"):
        operations.remove_profile("fast", ACTOR)
    with pytest.raises(NotFound, match="no model named 'nope'"):
        operations.rollout_of("nope")
    make_model("m2")
    with pytest.raises(NotFound, match="model m2 has no rollout"):
        operations.rollout_of("m2")


def test_a_removed_model_aborts_its_rollout_and_waits_for_its_canary(fleet):
    node, model = fleet
    rollout, canary = ready_canary(model)
    operations.remove_model("m1", ACTOR)
    carry_on(rollout_figures.sides)
    assert Rollout.objects.get(pk=rollout.pk).state == Rollout.State.ABORTED
    run(2)
    assert Model.objects.filter(pk=model.pk).exists()  # its canary is still stopping
    report_none(node)
    run(2)
    assert not Model.objects.filter(pk=model.pk).exists()
