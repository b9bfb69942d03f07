"""`llmgw ctl rollout start|status|promote|abort`: one line for each change, the status with both sides' figures
side by side, every bad input one line that changes nothing; the same from the control plane's host (the API in
process) and from elsewhere (over HTTP)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.management.base import CommandError
from django.utils import timezone

from cluster.models import EngineVersion, Model, Profile, Replica, Rollout
from cluster.rollouts import Side
from tests.factories import make_file, make_model, make_node, make_replica, make_user
from tests.test_cli_remote import no_login, run  # noqa: F401 (no_login: an autouse fixture, here too)


def refused(*args: str) -> str:
    with pytest.raises(CommandError) as error:
        run(*args)
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def named(replica: Replica, name: str) -> None:
    Replica.objects.filter(pk=replica.pk).update(name=name)


def fleet() -> Model:
    EngineVersion.objects.get_or_create(name="llama.cpp", defaults={"kind": "llama.cpp"})
    Profile.objects.get_or_create(name="default")
    Profile.objects.get_or_create(name="fast")
    node = make_node("gpu-1")
    model = make_model("m1", file=make_file("m1.gguf"))
    named(make_replica(model, node), "m1-old")
    return model


@pytest.fixture
def m1(db):
    return fleet()


def judged(model: Model) -> Rollout:
    """The rollout with a ready canary and figures, as the control plane would have judged it."""
    rollout = Rollout.objects.get()
    named(make_replica(model, Replica.objects.get(name="m1-old").node, rollout=rollout), "m1-canary")
    Rollout.objects.filter(pk=rollout.pk).update(
        started_at=timezone.now() - timedelta(hours=3), watching_since=timezone.now() - timedelta(seconds=300),
        figures={"canary": Side(20, 1, 19, 110.0, 300.0, 10.0, 20.0).shown(),
                 "current": Side(200, 0, 200, 100.0, 250.0, 10.0, 15.0).shown(),
                 "verdict": "watching: 300s of the window left"})
    return rollout


def test_a_rollout_started_shown_and_promoted(m1):
    said = run("ctl", "rollout", "start", "m1", "--profile", "fast", "--traffic", "25%", "--watch", "10m",
               "--max-error-rate", "2")
    assert said == ("rollout of model m1 started: profile default -> fast; 1 canary replica(s) take 25% of new "
                    "conversations; watch with: llmgw ctl rollout status m1\n")
    rollout = Rollout.objects.get()
    assert (rollout.traffic, rollout.watch_seconds, rollout.max_error_rate) == (0.25, 600, 0.02)
    assert "window: 10m, from the first canary replica ready (none yet)" in run("ctl", "rollout", "status", "m1")
    judged(m1)
    status = run("ctl", "rollout", "status", "m1")
    lines = status.splitlines()
    assert lines[0] == "rollout of model m1: watching"
    assert "change: profile default -> fast" in lines
    assert lines[2].startswith("started by cli at ") and lines[2].endswith("(3h ago)")
    assert "window: 5m left of 10m" in lines
    assert "verdict so far: watching: 300s of the window left" in lines
    assert "canary replicas: m1-canary (ready on gpu-1)" in lines
    assert "current replicas: m1-old (ready on gpu-1)" in lines
    table = status.split("\n\n", 1)[1].splitlines()
    assert table[0].split() == ["CANARY", "CURRENT", "RATIO", "/", "BOUND"]
    assert table[1].split() == ["requests", "20", "200", "at", "least", "50"]
    assert table[3].split() == ["error", "rate", "5%", "0%", "at", "most", "2%"]
    assert table[4].split() == ["TTFT", "p50", "110", "ms", "100", "ms", "1.10x", "/", "at", "most", "1.5x"]
    assert table[7].split() == ["TPOT", "p99", "20", "ms", "15", "ms", "1.33x"]
    shown = json.loads(run("ctl", "rollout", "status", "m1", "--json"))
    assert shown["state"] == "watching" and shown["figures"]["canary"]["requests"] == 20
    assert run("ctl", "rollout", "promote", "m1") == (
        "rollout of model m1 promoting: every replica is replaced with profile default -> fast, one at a time; "
        "watch with: llmgw ctl rollout status m1\n")
    assert Model.objects.get().profile.name == "fast"
    assert run("ctl", "rollout", "status", "m1").splitlines()[0] == "rollout of model m1: promoting"
    assert run("ctl", "rollout", "abort", "m1") == (  # while promoting: back to the settings before
        "rollout of model m1 rolling back: the model goes back to its settings before, its replicas on the new ones "
        "replaced one at a time\n")
    assert Model.objects.get().profile.name == "default"
    assert refused("ctl", "rollout", "abort", "m1") == (
        "the rollout of model m1 is rolling back: only a rollout watching or promoting may be aborted")


def test_an_aborted_rollout_leaves_the_model_as_it_was(m1):
    said = run("ctl", "rollout", "start", "m1", "--profile", "fast", "--traffic", "0%", "--shadow", "5", "--memory",
               "3GiB")
    assert "1 canary replica(s) take 0% of new conversations and a copy of 5% of the others' requests;" in said
    assert "started: profile default -> fast, memory " in said and "-> 3.0 GiB;" in said
    assert run("ctl", "rollout", "abort", "m1") == (
        "rollout of model m1 aborted: its canary drains and stops; the model runs as it did\n")
    assert Model.objects.get().profile.name == "default"
    assert "reason: aborted by cli" in run("ctl", "rollout", "status", "m1").splitlines()


@pytest.mark.parametrize("args, words", [
    (["--profile", "fast", "--traffic", "150%"], "argument --traffic: '150%': a percent from 0% to 100%"),
    (["--profile", "fast", "--traffic", "0"], "a canary with no traffic and no shadow would never be judged: give "
                                              "--traffic or --shadow above 0%"),
    (["--profile", "fast", "--shadow", "1000"], "argument --shadow: '1000': a percent from 0% to 100%"),
    (["--profile", "fast", "--traffic", "lots"], "argument --traffic: 'lots' is not a percent (write e.g. 10%)"),
    (["--profile", "fast", "--max-error-rate=-1%"], "argument --max-error-rate: '-1%': a percent from 0% to 100%"),
    (["--profile", "fast", "--watch", "soon"], "argument --watch: not a duration: 'soon'"),
    (["--profile", "fast", "--max-ttft-ratio", "0.5"], "argument --max-ttft-ratio: '0.5': a ratio from 1 to 1000"),
    (["--profile", "fast", "--canary", "0"], "canary: Ensure this value is greater than or equal to 1."),
    ([], "nothing to roll out: give --file, --profile or --engine for model m1's canary"),
    (["--profile", "default"], "nothing to roll out: give a --file, --profile or --engine other than model m1's own"),
    (["--profile", "nope"], "no profile named 'nope'"),
    (["--profile", "fast", "--memory", "lots"], "not a size: 'lots' (write e.g. 2GiB, 512MiB, 1.5G or a number of "
                                                "bytes)"),
    (["--memory", "auto"], "nothing to roll out: give --file, --profile or --engine for model m1's canary"),
])
def test_bad_input_is_one_line_and_changes_nothing(m1, args, words):
    assert words in refused("ctl", "rollout", "start", "m1", *args)
    assert not Rollout.objects.exists() and Model.objects.get().profile.name == "default"


def test_what_is_missing_or_in_conflict_is_one_line(m1):
    assert refused("ctl", "rollout", "start", "nope", "--profile", "fast") == "no model named 'nope'"
    assert refused("ctl", "rollout", "status", "m1") == "model m1 has no rollout"
    assert refused("ctl", "rollout", "promote", "m1") == "model m1 has no rollout under way"
    run("ctl", "rollout", "start", "m1", "--profile", "fast")
    assert "has a rollout watching" in refused("ctl", "rollout", "start", "m1", "--profile", "fast")
    assert refused("ctl", "model", "set", "m1", "--profile", "fast") == (
        "model m1 has a rollout watching: its profile changes only through it (`ctl rollout promote m1` or `abort` "
        "it first)")
    assert Rollout.objects.count() == 1 and Model.objects.get().profile.name == "default"


def test_the_same_from_anywhere(live_server, transactional_db):
    model = fleet()
    _, token = make_user("operator", "olga")
    far = ("--server", live_server.url, "--token", token)
    said = run("ctl", "rollout", "start", "m1", "--profile", "fast", *far)
    assert said.startswith("rollout of model m1 started: profile default -> fast")
    judged(model)
    assert run("ctl", "rollout", "status", "m1", *far) == run("ctl", "rollout", "status", "m1")
    _, viewer = make_user("viewer", "vera")
    with pytest.raises(CommandError) as error:
        run("ctl", "rollout", "abort", "m1", "--server", live_server.url, "--token", viewer)
    assert str(error.value) == "your role (viewer) may not abort rollouts"
    assert run("ctl", "rollout", "abort", "m1", *far).startswith("rollout of model m1 aborted")
    assert Replica.objects.get(name="m1-old").state == "ready"
