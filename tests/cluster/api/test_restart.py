"""The REST API's part of restart, drain and engine-key rotation: parsing, status codes, what is shown."""

import pytest

from cluster.models import ClusterSettings, Event, Node, Profile, Replica
from tests.factories import make_model, make_node, make_replica, row_counts
from tests.rest import API, refused

R = Replica.Restart


@pytest.fixture
def fleet(db):
    node = make_node("gpu-1")
    make_node("gpu-2")
    model = make_model("m1", replicas=2)
    fingerprint = ClusterSettings.fingerprint(ClusterSettings.load().engine_key)
    snapshot = {"args": model.profile.args(), "engine": model.engine.spec(), "file": model.file.sha256,
                "engine_key": fingerprint}
    return [make_replica(model, node, snapshot=snapshot) for _ in range(2)]


def markers():
    return dict(Replica.objects.values_list("name", "restart"))


# restart


def test_restart_queues_and_answers_what_it_did(fleet, operator):
    first, second = fleet
    response = operator.post(f"{API}/restart/", {"replicas": [first.name]}, format="json")
    assert response.status_code == 202, response.content
    assert response.json() == {"queued": [first.name], "skipped": []}
    response = operator.post(f"{API}/restart/", {"models": ["m1"]}, format="json")
    assert response.json() == {
        "queued": [second.name],
        "skipped": [{"name": first.name, "why": "already queued for restart"}],
    }
    assert set(markers().values()) == {R.QUEUED}


def test_restart_without_the_slash(fleet, operator):
    response = operator.post(f"{API}/restart", {"all": True}, format="json")
    assert response.status_code == 202 and len(response.json()["queued"]) == 2


def test_restart_stale(fleet, operator):
    assert operator.post(f"{API}/restart/", {"stale": True}, format="json").json()["queued"] == []
    Profile.objects.filter(name="default").update(context_size=99)
    response = operator.post(f"{API}/restart/", {"stale": True}, format="json")
    assert sorted(response.json()["queued"]) == sorted(r.name for r in fleet)


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({}, 422, ["name replicas, --model, --all or --stale"]),  # well formed, but it asks for nothing
        ({"all": False, "stale": False}, 422, ["name replicas, --model, --all or --stale"]),
        ({"replicas": ["m1-nope"]}, 422, ["no replica named 'm1-nope'; nothing queued"]),
        ({"models": ["zzz"]}, 422, ["no model named 'zzz'"]),
        ({"models": ["m1\x00"]}, 400, ["models", "Null characters"]),
        ({"all": 1}, 400, ["all", "must be true or false"]),
        ({"replicas": "m1-x"}, 400, ["replicas"]),
        ({"all": "maybe"}, 400, ["all"]),
        ({"everything": True}, 400, ["everything", "unknown field"]),
    ],
)
def test_restart_refusals_change_nothing(fleet, operator, body, status, words):
    before = (row_counts(), markers())
    refused(operator.post(f"{API}/restart/", body, format="json"), status, *words)
    assert (row_counts(), markers()) == before


def test_a_viewer_may_not_restart(fleet, viewer):
    before = markers()
    assert viewer.post(f"{API}/restart/", {"all": True}, format="json").status_code == 403
    assert markers() == before


def test_replicas_show_stale(fleet, viewer):
    rows = viewer.get(f"{API}/replicas/").json()["results"]
    assert [r["stale"] for r in rows] == [None, None]
    Profile.objects.filter(name="default").update(context_size=99)
    assert viewer.get(f"{API}/replicas/{fleet[0].name}/").json()["stale"] == "profile edited"


# drain and undrain


def test_drain_and_undrain(fleet, operator):
    response = operator.post(f"{API}/nodes/gpu-1/drain/", {"force": True}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["draining"], body["drain"], body["drain_force"], body["drain_note"]) == (True, "draining", True, "")
    refused(operator.post(f"{API}/nodes/gpu-1/drain/"), 409, "already draining")
    Node.objects.filter(name="gpu-1").update(drain_note="replica x has nowhere else to go")
    assert operator.get(f"{API}/nodes/gpu-1/").json()["drain"] == "blocked"
    Replica.objects.update(state=Replica.State.STOPPED)
    assert operator.get(f"{API}/nodes/gpu-1/").json()["drain"] == "drained"

    response = operator.post(f"{API}/nodes/gpu-1/undrain/")
    assert response.status_code == 200
    assert (response.json()["draining"], response.json()["drain"]) == (False, None)
    refused(operator.post(f"{API}/nodes/gpu-1/undrain/"), 409, "not draining")


def test_drain_without_a_body_and_its_refusals(fleet, operator, viewer):
    assert operator.post(f"{API}/nodes/gpu-2/drain/").json()["drain_force"] is False
    refused(operator.post(f"{API}/nodes/gpu-9/drain/"), 404, "no node named 'gpu-9'")
    refused(operator.post(f"{API}/nodes/gpu-1/drain/", {"force": "x"}, format="json"), 400, "force")
    refused(operator.post(f"{API}/nodes/gpu-1/drain/", {"forced": True}, format="json"), 400, "unknown field")
    for body in ("null", "false", "[]"):  # only an empty body or {} means the defaults
        response = operator.post(f"{API}/nodes/gpu-1/drain/", body, content_type="application/json")
        assert response.status_code == 400, (body, response.content)
    assert viewer.post(f"{API}/nodes/gpu-1/drain/").status_code == 403
    assert not Node.objects.get(name="gpu-1").draining


# engine key


def test_rotate_engine_key(fleet, operator, viewer):
    assert viewer.post(f"{API}/engine-key/rotate/").status_code == 403
    old = ClusterSettings.load().engine_key
    response = operator.post(f"{API}/engine-key/rotate/")
    assert response.status_code == 200, response.content
    new = ClusterSettings.load().engine_key
    assert new != old
    assert response.json() == {"fingerprint": ClusterSettings.fingerprint(new), "stale": 2}
    assert "engine key" in viewer.get(f"{API}/replicas/{fleet[0].name}/").json()["stale"]
    refused(operator.post(f"{API}/engine-key/rotate/"), 409, "still use the engine key before the current one")
    assert ClusterSettings.load().engine_key == new


# settings and the engine key itself


def test_settings_show_and_change(db, operator, viewer):
    shown = viewer.get(f"{API}/settings/").json()
    assert shown["drain_grace_seconds"] == 300 and shown["reconcile_interval_seconds"] == 5
    assert shown["serving_stopped"] is False and len(shown["engine_key_fingerprint"]) == 12
    assert viewer.patch(f"{API}/settings/", {"drain_grace_seconds": 60}, format="json").status_code == 403
    response = operator.patch(f"{API}/settings/", {"drain_grace_seconds": 60}, format="json")
    assert response.status_code == 200 and response.json()["drain_grace_seconds"] == 60
    assert ClusterSettings.load().drain_grace_seconds == 60
    before = row_counts()
    for body in ({"reconcile_interval_seconds": 0}, {"drain_grace_seconds": "soon"}, {"bogus": 1}, {}):
        response = operator.patch(f"{API}/settings/", body, format="json")
        assert response.status_code == 400, body
    assert row_counts() == before and ClusterSettings.load().reconcile_interval_seconds == 5


def test_settings_queue_defaults(db, operator):
    shown = operator.get(f"{API}/settings/").json()
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (512, 120)
    body = {"queue_limit": 64, "max_wait_seconds": 30}
    shown = operator.patch(f"{API}/settings/", body, format="json").json()
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (64, 30)
    assert "queue limit 64, max wait 30s" in Event.objects.get(kind="settings.changed").message
    before = row_counts()
    for body in ({"queue_limit": 0}, {"queue_limit": 100_001}, {"max_wait_seconds": 3601}, {"max_wait_seconds": None}):
        assert operator.patch(f"{API}/settings/", body, format="json").status_code == 400, body
    assert row_counts() == before and ClusterSettings.load().queue_limit == 64


def test_the_engine_key_is_shown_to_admins_only(db, operator, admin):
    assert operator.get(f"{API}/engine-key/").status_code == 403
    shown = admin.get(f"{API}/engine-key/").json()
    assert shown["engine_key"] == ClusterSettings.load().engine_key


def test_cli_settings(db):
    from tests.cluster.test_restart import cli

    assert "drain grace seconds: 300" in cli("ctl", "settings")
    out = cli("ctl", "settings", "--drain-grace", "90", "--reconcile-interval", "2", "--json")
    import json

    assert json.loads(out)["drain_grace_seconds"] == 90 and json.loads(out)["reconcile_interval_seconds"] == 2
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="reconcile_interval_seconds"):
        cli("ctl", "settings", "--reconcile-interval", "0")
    out = cli("ctl", "settings", "--queue-limit", "64", "--max-wait", "2m")
    assert "queue limit: 64\n" in out and "max wait seconds: 120\n" in out
    with pytest.raises(CommandError, match="queue_limit"):
        cli("ctl", "settings", "--queue-limit", "0")
    with pytest.raises(CommandError, match="not a duration"):
        cli("ctl", "settings", "--max-wait", "soon")
