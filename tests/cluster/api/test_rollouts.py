"""The REST API of rollouts: started, shown with both sides and their figures, promoted, aborted, listed; and
every refusal, with its status, changing nothing."""

import pytest

from cluster.models import Model, Rollout
from cluster.rollouts import Side
from tests.factories import make_replica, row_counts
from tests.rest import API, refused

ROLLOUT = f"{API}/models/qwen2.5-7b/rollout/"


def start(client, **body):
    return client.post(ROLLOUT, {"profile": "spare", **body}, format="json")


def counts():
    return row_counts(), list(Rollout.objects.values_list("state", flat=True)), list(
        Model.objects.values_list("profile__name", flat=True))


def test_a_rollout_is_started_shown_and_promoted(cluster, operator, viewer):
    response = start(operator, canary=2, traffic=0.25, watch_seconds=90, max_error_rate=0.02)
    assert response.status_code == 201, response.content
    shown = response.json()
    assert shown["model"] == "qwen2.5-7b" and shown["state"] == "watching" and shown["state_text"] == "watching"
    assert shown["change"] == {"profile": ["default", "spare"]} and shown["change_text"] == "profile default -> spare"
    assert (shown["canary"], shown["traffic"], shown["watch_seconds"], shown["min_requests"]) == (2, 0.25, 90, 50)
    assert (shown["max_error_rate"], shown["max_ttft_ratio"], shown["max_tpot_ratio"]) == (0.02, 1.5, 1.3)
    assert shown["actor"].startswith("user:operator")
    assert shown["figures"] == {"canary": None, "current": None} and shown["window_left_seconds"] is None
    rollout = Rollout.objects.get()
    make_replica(cluster["model"], cluster["node"], rollout=rollout)
    Rollout.objects.filter(pk=rollout.pk).update(figures={
        "canary": Side(requests=20, errors=1, timed=19, ttft_p50=110, ttft_p99=300, tpot_p50=10, tpot_p99=20).shown(),
        "current": Side(requests=200, timed=200, ttft_p50=100, ttft_p99=250, tpot_p50=10, tpot_p99=15).shown(),
        "verdict": "watching: 30s of the window left"})
    shown = viewer.get(ROLLOUT).json()
    assert [len(shown["replicas"][side]) for side in ("canary", "current")] == [1, 1]
    assert shown["figures"]["canary"]["error_rate"] == 0.05 and shown["figures"]["current"]["requests"] == 200
    assert shown["verdict"] == "watching: 30s of the window left"
    assert shown["ratios"] == {"ttft": 1.1, "tpot": 1.0}  # as the dashboard draws them
    assert shown["breached"] == {"error_rate": False, "ttft": False, "tpot": False}  # 1 error: within 2% of 50
    response = operator.post(f"{ROLLOUT}promote/", format="json")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "promoting" and response.json()["reason"].startswith("promoted by user:")
    assert Model.objects.get().profile.name == "spare"
    listed = viewer.get(f"{API}/rollouts/").json()
    assert [r["state"] for r in listed["results"]] == ["promoting"]
    response = operator.post(f"{ROLLOUT}abort/", format="json")  # while promoting: back to the settings before
    assert response.status_code == 200 and response.json()["state"] == "rolling_back"
    assert response.json()["reason"].startswith("aborted by user:operator") and response.json()["reason"].endswith(
        "while promoting")
    assert Model.objects.get().profile.name == "default"
    refused(operator.post(f"{ROLLOUT}abort/", format="json"), 409, "only a rollout watching or promoting")


def test_a_rollout_is_aborted_and_then_its_model_may_roll_out_again(cluster, operator):
    assert start(operator).status_code == 201
    response = operator.post(f"{ROLLOUT}abort/", format="json")
    assert response.status_code == 200 and response.json()["state_text"] == "aborted"
    assert Model.objects.get().profile.name == "default"
    refused(operator.post(f"{ROLLOUT}abort/", format="json"), 409, "has no rollout under way")
    response = start(operator, traffic=0, shadow=0.05, memory_bytes=6 * 1024**3)
    assert response.status_code == 201 and (response.json()["traffic"], response.json()["shadow"]) == (0, 0.05)
    assert response.json()["change"]["memory"][1] == "6.0 GiB" and Rollout.objects.get(
        state="watching").memory_bytes == 6 * 1024**3
    states = [r["state"] for r in operator.get(f"{API}/rollouts/", {"model": "qwen2.5-7b"}).json()["results"]]
    assert states == ["watching", "aborted"]
    assert [r["state"] for r in operator.get(f"{API}/rollouts/", {"state": "aborted"}).json()["results"]] == [
        "aborted"]


def test_one_rollout_at_a_time_and_no_model_set_meanwhile(cluster, operator):
    assert start(operator).status_code == 201
    before = counts()
    refused(start(operator), 409, "has a rollout watching", "one at a time")
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"profile": "spare"}, format="json"), 409,
            "has a rollout watching: its profile changes only through it")
    assert counts() == before


@pytest.mark.parametrize("body, status, words", [
    ({"traffic": 1.5}, 400, ["traffic", "from 0 to 1, not 1.5"]),
    ({"shadow": -0.5}, 400, ["shadow", "from 0 to 1, not -0.5"]),
    ({"traffic": 0}, 422, ["a canary with no traffic and no shadow would never be judged"]),
    ({"traffic": "10%"}, 400, ["traffic", "must be a number"]),
    ({"max_error_rate": -0.1}, 400, ["max_error_rate", "from 0 to 1"]),
    ({"max_ttft_ratio": 0.5}, 400, ["max_ttft_ratio", "from 1 to 1000"]),
    ({"canary": 0}, 400, ["canary"]),
    ({"watch_seconds": "10m"}, 400, ["watch_seconds", "whole number"]),
    ({"min_requests": 0}, 400, ["min_requests"]),
    ({"memory_bytes": -1}, 400, ["memory_bytes"]),
    ({"memory_bytes": "8GiB"}, 400, ["memory_bytes", "whole number"]),
    ({"colour": "red"}, 400, ["colour", "unknown field"]),
    ({"profile": "default"}, 422, ["nothing to roll out"]),
    ({"profile": "nope"}, 422, ["no profile named 'nope'"]),
    ({"engine": "nope"}, 422, ["no engine named 'nope'"]),
])
def test_bad_rollouts_are_refused_and_change_nothing(cluster, operator, body, status, words):
    before = counts()
    refused(start(operator, **body), status, *words)
    assert counts() == before


def test_what_is_not_there_is_a_404(cluster, operator, viewer):
    refused(viewer.get(ROLLOUT), 404, "model qwen2.5-7b has no rollout")
    refused(viewer.get(f"{API}/models/nope/rollout/"), 404, "no model named 'nope'")
    refused(operator.post(f"{API}/models/nope/rollout/", {"profile": "spare"}, format="json"), 404, "nope")
    refused(operator.post(f"{API}/models/nope/rollout/promote/", format="json"), 404, "nope")
    refused(operator.post(f"{ROLLOUT}promote/", format="json"), 409, "has no rollout under way")
    refused(viewer.get(f"{API}/rollouts/", {"model": "nope"}), 422, "no model named 'nope'")
    refused(viewer.get(f"{API}/rollouts/", {"state": "sideways"}), 400, "state", "unknown state")


def test_a_viewer_looks_and_may_not_start_promote_or_abort(cluster, operator, viewer):
    assert start(operator).status_code == 201
    before = counts()
    for path in (ROLLOUT, f"{ROLLOUT}promote/", f"{ROLLOUT}abort/"):
        assert viewer.post(path, {"profile": "spare"} if path == ROLLOUT else {}, format="json").status_code == 403
    assert counts() == before
    assert viewer.get(f"{API}/rollouts/").status_code == 200
