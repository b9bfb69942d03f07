"""The REST API for the event log, the cluster's status and users; refusals mapped to 400 and 404."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from cluster import operations
from cluster.api.errors import exception_handler
from cluster.models import Event
from tests.factories import row_counts
from tests.rest import API, refused

# Events


def test_events_newest_first_and_filters(cluster, operator):
    Event.objects.all().delete()  # the fixtures' own
    old = Event.objects.create(
        kind="node.added", actor="system", subject="gpu-0", message="old", created_at=timezone.now() - timedelta(days=2)
    )
    operator.post(f"{API}/profiles/", {"name": "long"}, format="json")
    operator.patch(f"{API}/profiles/long/", {"threads": 4}, format="json")
    events = operator.get(f"{API}/events/").json()["results"]
    assert [e["kind"] for e in events] == ["profile.edited", "profile.added", "node.added"]
    assert set(events[0]) == {"id", "created_at", "kind", "actor", "subject", "message", "data"}

    def kinds(query):
        return [e["kind"] for e in operator.get(f"{API}/events/?{query}").json()["results"]]

    assert kinds("kind=profile.added") == ["profile.added"]
    assert kinds("subject=gpu-0") == ["node.added"]
    assert kinds("actor=system") == ["node.added"]
    since = (old.created_at + timedelta(hours=1)).isoformat()
    assert kinds("since=" + since.replace("+", "%2B")) == ["profile.edited", "profile.added"]
    assert kinds("since=2000-01-01T00:00:00") == ["profile.edited", "profile.added", "node.added"]
    assert kinds("since=2999-01-01T00:00:00Z") == []


@pytest.mark.parametrize("since", ["yesterday", "2025-13-01T00:00:00", "", "1700000000"])
def test_events_bad_since_is_a_400(db, viewer, since):
    refused(viewer.get(f"{API}/events/?since={since}"), 400, "since", "ISO 8601")


def test_events_far_times_and_nul_filters(db, viewer):
    assert viewer.get(f"{API}/events/?since=9999-12-31T23:59:59-12:00").json()["results"] == []  # past year 9999 in UTC
    assert viewer.get(f"{API}/events/?since=0001-01-01T00:00:00%2B14:00").status_code == 200  # before year 1 in UTC
    refused(viewer.get(f"{API}/events/?kind=model%00"), 400, "kind", "NUL character")


def test_events_are_read_only(db, operator):
    assert operator.post(f"{API}/events/", {"kind": "x"}, format="json").status_code == 405


# Status


def test_status(cluster, viewer):
    body = viewer.get(f"{API}/status/").json()
    assert body == {
        "serving": "serving",
        "nodes": {"total": 1, "connected": 1},
        "models": [{"name": "qwen2.5-7b", "mode": "fixed", "ready": 1, "wanted": 1, "replicas": 1, "min_replicas": None,
                    "max_replicas": None, "replicas_text": "1/1", "last_request_at": None, "removing": False,
                    "placement_note": ""}],
        "replicas": {"ready": 1},
    }


# Users


def test_admin_adds_a_user_whose_token_works(admin):
    response = admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["name"], body["role"]) == ("carol", "viewer")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['token']}")
    assert client.get(f"{API}/models/").status_code == 200
    refused(client.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json"), 403, "role")


def test_admin_lists_users_with_their_roles_and_no_one_else_does(admin, operator, viewer):
    operations.add_user("carol", "viewer", "test", password="correct-horse")
    response = admin.get(f"{API}/users/")
    assert response.status_code == 200, response.content
    rows = {u["name"]: u for u in response.json()["results"]}
    assert rows["carol"]["role"] == "viewer" and rows["carol"]["password"] is True
    assert {u["role"] for u in rows.values()} >= {"admin", "operator", "viewer"}
    assert not any("token" in u for u in rows.values())  # a token is shown once, when made
    assert list(rows) == sorted(rows)
    for client in (operator, viewer):
        refused(client.get(f"{API}/users/"), 403, "admins only")


def test_operator_may_not_add_users(operator):
    before = row_counts()
    refused(operator.post(f"{API}/users/", {"name": "mallory", "role": "admin"}, format="json"), 403, "role")
    assert row_counts() == before


@pytest.mark.parametrize(
    "body, words",
    [
        ({"name": "carol", "role": "owner"}, ["role", "not a valid choice"]),
        ({"name": "bob smith", "role": "viewer"}, ["use letters, digits and . @ + - _"]),
        ({"name": "bob\n", "role": "viewer"}, ["use letters, digits and . @ + - _"]),
        ({"name": "b\u00f6b", "role": "viewer"}, ["use letters, digits and . @ + - _"]),  # ASCII: no look-alikes
        ({"name": "carol", "role": "viewer", "password": 12345678}, ["password", "must be a string"]),
        ({"name": "carol", "role": "viewer", "password": "short"}, ["at least 8 characters"]),
        ({"role": "viewer"}, ["name", "required"]),
    ],
)
def test_add_user_refusals(admin, body, words):
    before = row_counts()
    refused(admin.post(f"{API}/users/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_add_user_twice_is_refused(admin):
    assert admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json").status_code == 201
    before = row_counts()
    refused(admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json"), 409, "already exists")
    refused(admin.post(f"{API}/users/", {"name": "Carol", "role": "viewer"}, format="json"), 409, "already exists")
    assert row_counts() == before


@pytest.mark.parametrize(
    "error, status",
    [
        (operations.NotFound("no model named 'x'"), 404),
        (operations.Conflict("model x is being removed"), 409),
        (operations.OperationError("no engine named 'x'"), 422),
    ],
)
def test_exception_handler_maps_unwrapped_refusals(error, status):
    response = exception_handler(error, {})
    assert (response.status_code, response.data) == (status, {"detail": str(error)})


def test_api_root_lists_the_resources(viewer):
    body = viewer.get(f"{API}/").json()
    assert set(body) == {
        "nodes",
        "models",
        "replicas",
        "profiles",
        "engines",
        "model-files",
        "control-planes",
        "events",
        "rollouts",
        "users",
        "keys",
        "usage",
        "requests",
    }
