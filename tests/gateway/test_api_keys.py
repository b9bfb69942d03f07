"""The REST API's keys, usage and system endpoints: parsing, status codes, fields, who may do what."""

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from cluster.models import ClusterSettings, Event
from gateway import budgets, operations
from gateway.models import KEY_PREFIX, ApiKey, Usage
from tests.factories import make_model, row_counts
from tests.rest import API, refused


def state() -> dict:
    """Everything a keys, usage or system request could change: equal before and after a refused one."""
    keys = {k.name: (k.key_hash, k.revoked_at, k.rpm, k.tpm, k.max_tokens, k.priority, k.allowed_models, k.expires_at,
                     k.budget_tokens, k.budget_period, k.max_concurrency, k.log_bodies)
            for k in ApiKey.objects.all()}
    return {
        "keys": keys,
        "usage": list(Usage.objects.values_list("key__name", "model", "hour", "requests")),
        "events": Event.objects.count(),
        "stopped": ClusterSettings.load().serving_stopped,
    }


# Keys


def test_create_shows_the_key_once_and_stores_only_its_hash(operator):
    make_model("qwen2.5-7b")
    make_model("smollm2")
    expires = (timezone.now() + timedelta(days=30)).replace(microsecond=0)
    body = {"name": "ci", "models": ["qwen2.5-7b", "smollm2"], "rpm": 60, "tpm": 10000, "expires_at": expires}
    response = operator.post(f"{API}/keys/", body, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    secret = shown["key"]
    assert secret.startswith(KEY_PREFIX) and len(secret) > 40
    assert shown["prefix"] == secret[:14]
    assert (shown["name"], shown["models"], shown["rpm"], shown["tpm"]) == ("ci", ["qwen2.5-7b", "smollm2"], 60, 10000)
    assert datetime.fromisoformat(shown["expires_at"]) == expires
    assert (shown["state"], shown["revoked_at"], shown["last_used_at"]) == ("active", None, None)

    key = ApiKey.objects.get(name="ci")
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    stored = [str(v) for v in ApiKey.objects.filter(name="ci").values().get().values()]
    assert not any(secret in v for v in stored)  # the secret itself is nowhere in the row
    event = Event.objects.get(kind="key.created")
    assert event.subject == "ci" and event.actor.startswith("user:operator-") and secret not in event.message

    # never again: not in the list, not in the detail
    for path in (f"{API}/keys/", f"{API}/keys/ci/"):
        text = operator.get(path).content.decode()
        assert secret not in text and '"key"' not in text and "key_hash" not in text


def test_create_with_defaults(operator):
    shown = operator.post(f"{API}/keys/", {"name": "all"}, format="json").json()
    assert (shown["models"], shown["rpm"], shown["tpm"], shown["expires_at"]) == ([], None, None, None)
    assert shown["priority"] == "standard"
    assert ApiKey.objects.get(name="all").allowed_models == []


def test_create_with_a_priority(operator):
    shown = operator.post(f"{API}/keys/", {"name": "nightly", "priority": "batch"}, format="json").json()
    assert shown["priority"] == "batch" and ApiKey.objects.get(name="nightly").priority == "batch"
    assert operator.get(f"{API}/keys/nightly/").json()["priority"] == "batch"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({}, 400, ["name", "required"]),
        ({"name": ""}, 400, ["name", "blank"]),
        ({"name": "CI Key"}, 400, ["use lower-case letters"]),
        ({"name": "taken"}, 409, ["already exists"]),
        ({"name": "k", "models": "qwen"}, 400, ["models", "list"]),
        ({"name": "k", "models": ["Not A Model"]}, 400, ["use lower-case letters"]),
        ({"name": "k", "models": ["nosuch"]}, 422, ["no model named 'nosuch'"]),
        ({"name": "k", "models": ["qwen", "nosuch", "other"]}, 422, ["no models named 'nosuch', 'other'"]),
        ({"name": "k", "rpm": 0}, 400, ["rpm", "greater than or equal to 1"]),
        ({"name": "k", "rpm": -5}, 400, ["rpm"]),
        ({"name": "k", "rpm": "lots"}, 400, ["rpm", "must be a whole number"]),
        ({"name": "k", "rpm": True}, 400, ["rpm", "must be a whole number"]),
        ({"name": "k", "tpm": 2**40}, 400, ["tpm", "less than or equal"]),
        ({"name": "k", "expires_at": "tomorrow"}, 400, ["expires_at", "Datetime has wrong format"]),
        ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, 422, ["in the past"]),
        ({"name": "k", "secret": "mine"}, 400, ["secret", "unknown field"]),
        ({"name": "k", "priority": "urgent"}, 400, ["priority", "not a valid choice"]),
        ({"name": "k", "priority": None}, 400, ["priority", "may not be null"]),
    ],
)
def test_create_refusals_change_nothing(operator, body, status, words):
    make_model("qwen")
    operations.create_key("taken", "test")
    before = state()
    refused(operator.post(f"{API}/keys/", body, format="json"), status, *words)
    assert state() == before


@pytest.mark.parametrize("body", [[], ["k"], "k", 5])
def test_create_with_a_body_that_is_not_an_object_is_a_400(operator, body):
    assert operator.post(f"{API}/keys/", body, format="json").status_code == 400
    assert not ApiKey.objects.exists() and not Event.objects.filter(kind="key.created").exists()


def test_list_shows_state_and_no_secrets(viewer):
    make_model("qwen")
    operations.create_key("active", "test", models=["qwen"], rpm=5)
    operations.create_key("revoked", "test")
    operations.revoke_key("revoked", "test")
    operations.create_key("expired", "test", expires_at=timezone.now() + timedelta(days=1))
    ApiKey.objects.filter(name="expired").update(expires_at=timezone.now() - timedelta(hours=1))
    used = timezone.now() - timedelta(minutes=3)
    ApiKey.objects.filter(name="active").update(last_used_at=used)

    response = viewer.get(f"{API}/keys/")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 3
    rows = {k["name"]: k for k in body["results"]}
    assert [k["name"] for k in body["results"]] == ["active", "expired", "revoked"]
    assert {name: k["state"] for name, k in rows.items()} == {
        "active": "active",
        "revoked": "revoked",
        "expired": "expired",
    }
    assert set(rows["active"]) == {
        "name",
        "prefix",
        "models",
        "rpm",
        "tpm",
        "max_tokens",
        "priority",
        "budget",
        "max_concurrency",
        "log_bodies",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "state",
        "created_at",
    }
    assert rows["active"]["models"] == ["qwen"] and rows["active"]["rpm"] == 5
    assert datetime.fromisoformat(rows["active"]["last_used_at"]) == used
    assert rows["revoked"]["revoked_at"] is not None
    assert viewer.get(f"{API}/keys/active/").json() == rows["active"]
    refused(viewer.get(f"{API}/keys/nope/"), 404, "no key named 'nope'")


def test_key_list_makes_a_fixed_number_of_queries(viewer, django_assert_max_num_queries):
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for i in range(20):
        key, _ = operations.create_key(f"key-{i}", "test", budget_tokens=1000 * (i + 1) if i % 2 else None,
                                       budget_period=budgets.PERIODS[i % 3] if i % 2 else None)
        Usage.objects.create(key=key, model="qwen", hour=hour, requests=1, prompt_tokens=i, completion_tokens=1)
    with django_assert_max_num_queries(6):  # the user and its groups, the count, the page (its budgets' spend too)
        shown = viewer.get(f"{API}/keys/").json()["results"]
    assert len(shown) == 20
    assert [k["budget"] and k["budget"]["spent"] for k in shown[:4]] == [None, 2, None, 12]  # key-0, -1, -10, -11


def test_revoke(operator):
    operations.create_key("ci", "test")
    response = operator.post(f"{API}/keys/ci/revoke/")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "revoked" and response.json()["revoked_at"]
    assert ApiKey.objects.get(name="ci").revoked_at is not None
    event = Event.objects.get(kind="key.revoked")
    assert event.subject == "ci" and event.actor.startswith("user:operator-")

    before = state()
    refused(operator.post(f"{API}/keys/ci/revoke/"), 409, "already revoked")
    refused(operator.post(f"{API}/keys/nope/revoke/"), 404, "no key named 'nope'")
    assert state() == before


def test_create_with_a_budget_and_a_concurrency_limit(operator):
    body = {"name": "metered", "budget_tokens": 2_000_000, "budget_period": "day", "max_concurrency": 4}
    response = operator.post(f"{API}/keys/", body, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    tomorrow = budgets.period_end("day", timezone.now())
    assert shown["budget"] == {"tokens": 2_000_000, "period": "day", "spent": 0,
                               "resets_at": tomorrow.isoformat().replace("+00:00", "Z")}
    assert shown["max_concurrency"] == 4
    key = ApiKey.objects.get(name="metered")
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (2_000_000, "day", 4)
    message = Event.objects.get(kind="key.created").message
    assert "budget 2M/day" in message and "at most 4 requests at once" in message
    shown = operator.post(f"{API}/keys/", {"name": "free"}, format="json").json()
    assert (shown["budget"], shown["max_concurrency"]) == (None, None)


def test_a_budget_shows_what_the_key_spent_in_its_period(viewer):
    now = timezone.now()
    today = budgets.period_start("day", now)
    key, _ = operations.create_key("metered", "test", budget_tokens=1000, budget_period="day")
    other, _ = operations.create_key("other", "test", budget_tokens=1000, budget_period="day")
    for hour, model, prompt, completion in ((today, "qwen", 100, 20), (now, "smol", 5, 7),
                                            (today - timedelta(hours=1), "qwen", 400, 400)):  # yesterday's: not
        Usage.objects.create(key=key, model=model, hour=hour.replace(minute=0, second=0, microsecond=0),
                             requests=1, prompt_tokens=prompt, completion_tokens=completion)
    Usage.objects.create(key=other, model="qwen", hour=today, requests=1, prompt_tokens=50, completion_tokens=0)

    budget = viewer.get(f"{API}/keys/metered/").json()["budget"]
    assert (budget["tokens"], budget["period"], budget["spent"]) == (1000, "day", 132)
    assert datetime.fromisoformat(budget["resets_at"]) == today + timedelta(days=1)
    listed = {k["name"]: k["budget"] for k in viewer.get(f"{API}/keys/").json()["results"]}
    assert listed == {"metered": budget, "other": {**budget, "spent": 50}}
    assert budgets.status(key, now)["spent"] == 132  # without the list's annotation: the same figure
    # a month holds yesterday too, unless today is the first
    ApiKey.objects.filter(name="metered").update(budget_period="month")
    spent = viewer.get(f"{API}/keys/metered/").json()["budget"]["spent"]
    assert spent == (132 if today.day == 1 else 932)


@pytest.mark.parametrize("method", ["patch", "put"])
def test_change_a_keys_budget_and_concurrency_limit(operator, method):
    operations.create_key("ci", "test")
    change = getattr(operator, method)
    shown = change(f"{API}/keys/ci/", {"budget_tokens": 500_000, "budget_period": "week", "max_concurrency": 2},
                   format="json").json()
    assert (shown["budget"]["tokens"], shown["budget"]["period"], shown["max_concurrency"]) == (500_000, "week", 2)
    assert "budget 500K/week" in Event.objects.get(kind="key.edited").message
    shown = change(f"{API}/keys/ci/", {"budget_period": "month"}, format="json").json()  # the tokens stay
    assert (shown["budget"]["tokens"], shown["budget"]["period"], shown["max_concurrency"]) == (500_000, "month", 2)
    shown = change(f"{API}/keys/ci/", {"budget_tokens": 10}, format="json").json()  # the period stays
    assert (shown["budget"]["tokens"], shown["budget"]["period"]) == (10, "month")
    shown = change(f"{API}/keys/ci/", {"budget_tokens": None, "max_concurrency": None}, format="json").json()
    assert (shown["budget"], shown["max_concurrency"]) == (None, None)
    key = ApiKey.objects.get(name="ci")
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (None, "", None)
    change(f"{API}/keys/ci/", {"budget_tokens": 7, "budget_period": "day"}, format="json")
    assert change(f"{API}/keys/ci/", {"budget_period": ""}, format="json").json()["budget"] is None


@pytest.mark.parametrize(
    "method, path, body, status, words",
    [
        ("post", "", {"name": "k", "budget_tokens": 0, "budget_period": "day"}, 400,
         ["budget_tokens", "greater than or equal to 1"]),
        ("post", "", {"name": "k", "budget_tokens": "2M", "budget_period": "day"}, 400,
         ["budget_tokens", "must be a whole number"]),
        ("post", "", {"name": "k", "budget_tokens": 10**16, "budget_period": "day"}, 400,
         ["budget_tokens", "less than or equal"]),
        ("post", "", {"name": "k", "budget_tokens": 5, "budget_period": "year"}, 400,
         ["budget_period", "not a valid choice"]),
        ("post", "", {"name": "k", "max_concurrency": 0}, 400, ["max_concurrency", "greater than or equal to 1"]),
        ("post", "", {"name": "k", "max_concurrency": "4"}, 400, ["max_concurrency", "must be a whole number"]),
        ("post", "", {"name": "k", "budget_period": "day"}, 422, ["a budget needs its tokens"]),
        ("post", "", {"name": "k", "budget_tokens": 5}, 422, ["a budget's period is one of day, week, month"]),
        ("patch", "ci/", {"budget_period": "week"}, 422, ["a budget needs its tokens"]),
        ("patch", "ci/", {"budget_tokens": 5}, 422, ["a budget's period is one of day, week, month"]),
        ("patch", "ci/", {"budget_period": None}, 400, ["budget_period", "may not be null"]),
        ("patch", "ci/", {"max_concurrency": 10**6}, 400, ["max_concurrency", "less than or equal"]),
        ("patch", "gone/", {"max_concurrency": 3}, 409, ["key gone is revoked"]),
    ],
)
def test_budget_and_concurrency_refusals_change_nothing(operator, method, path, body, status, words):
    operations.create_key("ci", "test", max_concurrency=3)
    operations.create_key("gone", "test")
    operations.revoke_key("gone", "test")
    before, rows = state(), row_counts()
    refused(getattr(operator, method)(f"{API}/keys/{path}", body, format="json"), status, *words)
    assert (state(), row_counts()) == (before, rows)


def test_create_a_key_that_logs_bodies(operator):
    shown = operator.post(f"{API}/keys/", {"name": "plain"}, format="json").json()
    assert shown["log_bodies"] is False and ApiKey.objects.get(name="plain").log_bodies is False
    response = operator.post(f"{API}/keys/", {"name": "logged", "log_bodies": True}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["log_bodies"] is True and ApiKey.objects.get(name="logged").log_bodies is True
    assert Event.objects.get(kind="key.created", subject="logged").message.endswith("bodies logged")
    assert operator.get(f"{API}/keys/logged/").json()["log_bodies"] is True
    listed = {k["name"]: k["log_bodies"] for k in operator.get(f"{API}/keys/").json()["results"]}
    assert listed == {"logged": True, "plain": False}


@pytest.mark.parametrize("method", ["patch", "put"])
def test_turn_a_keys_body_logging_on_and_off(operator, method):
    operations.create_key("ci", "test", rpm=10)
    change = getattr(operator, method)
    shown = change(f"{API}/keys/ci/", {"log_bodies": True}, format="json").json()
    assert (shown["log_bodies"], shown["rpm"]) == (True, 10)  # what is left out stays
    assert ApiKey.objects.get(name="ci").log_bodies is True
    assert Event.objects.get(kind="key.edited").message.endswith("edited: bodies logged")
    assert change(f"{API}/keys/ci/", {"rpm": 20}, format="json").json()["log_bodies"] is True
    shown = change(f"{API}/keys/ci/", {"log_bodies": False}, format="json").json()
    assert shown["log_bodies"] is False and ApiKey.objects.get(name="ci").log_bodies is False
    assert Event.objects.filter(kind="key.edited").first().message.endswith("edited: bodies not logged")


@pytest.mark.parametrize(
    "method, path, body, status, words",
    [
        ("post", "", {"name": "k", "log_bodies": "true"}, 400, ["log_bodies", "must be true or false"]),
        ("post", "", {"name": "k", "log_bodies": 1}, 400, ["log_bodies", "must be true or false"]),
        ("post", "", {"name": "k", "log_bodies": None}, 400, ["log_bodies", "may not be null"]),
        ("patch", "ci/", {"log_bodies": "yes"}, 400, ["log_bodies", "must be true or false"]),
        ("patch", "ci/", {"log_bodies": 0}, 400, ["log_bodies", "must be true or false"]),
        ("put", "ci/", {"log_bodies": []}, 400, ["log_bodies", "must be true or false"]),
        ("patch", "ci/", {"log_bodies": None}, 400, ["log_bodies", "may not be null"]),
        ("patch", "ci/", {"log_bodies": True, "rpm": 0}, 400, ["rpm", "greater than or equal to 1"]),
        ("patch", "gone/", {"log_bodies": True}, 409, ["key gone is revoked"]),
    ],
)
def test_log_bodies_refusals_change_nothing(operator, method, path, body, status, words):
    operations.create_key("ci", "test")
    operations.create_key("gone", "test")
    operations.revoke_key("gone", "test")
    before, rows = state(), row_counts()
    refused(getattr(operator, method)(f"{API}/keys/{path}", body, format="json"), status, *words)
    assert (state(), row_counts()) == (before, rows)


@pytest.mark.parametrize("method", ["patch", "put"])
def test_change_a_key(operator, method):
    make_model("qwen")
    operations.create_key("ci", "test", rpm=10, tpm=500)
    expires = (timezone.now() + timedelta(days=3)).replace(microsecond=0)
    body = {"priority": "interactive", "rpm": 60, "tpm": None, "models": ["qwen"], "expires_at": expires}
    response = getattr(operator, method)(f"{API}/keys/ci/", body, format="json")
    assert response.status_code == 200, response.content
    shown = response.json()
    assert (shown["priority"], shown["rpm"], shown["tpm"], shown["models"]) == ("interactive", 60, None, ["qwen"])
    assert datetime.fromisoformat(shown["expires_at"]) == expires and shown["max_tokens"] is None
    assert shown == operator.get(f"{API}/keys/ci/").json()
    event = Event.objects.get(kind="key.edited")
    assert event.subject == "ci" and event.actor.startswith("user:operator-") and "priority interactive" in event.message

    # what is left out stays; an empty body changes nothing
    shown = operator.patch(f"{API}/keys/ci/", {"max_tokens": 64}, format="json").json()
    assert (shown["priority"], shown["rpm"], shown["max_tokens"], shown["models"]) == ("interactive", 60, 64, ["qwen"])
    before = state()
    assert operator.patch(f"{API}/keys/ci/", {}, format="json").status_code == 200
    assert state() == before


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("ci", {"priority": "urgent"}, 400, ["priority", "not a valid choice"]),
        ("ci", {"priority": None}, 400, ["priority", "may not be null"]),
        ("ci", {"rpm": 0}, 400, ["rpm", "greater than or equal to 1"]),
        ("ci", {"tpm": "lots"}, 400, ["tpm", "must be a whole number"]),
        ("ci", {"max_tokens": 2**40}, 400, ["max_tokens", "less than or equal"]),
        ("ci", {"models": "qwen"}, 400, ["models", "list"]),
        ("ci", {"models": None}, 400, ["models", "may not be null"]),
        ("ci", {"expires_at": "tomorrow"}, 400, ["expires_at", "Datetime has wrong format"]),
        ("ci", {"name": "other"}, 400, ["name", "unknown field"]),
        ("ci", {"rpm": 5, "models": ["nosuch"]}, 422, ["no model named 'nosuch'"]),
        ("ci", {"expires_at": "2001-01-01T00:00:00Z"}, 422, ["in the past"]),
        ("gone", {"rpm": 5}, 409, ["key gone is revoked"]),
        ("nope", {"rpm": 5}, 404, ["no key named 'nope'"]),
    ],
)
def test_change_refusals_change_nothing(operator, path, body, status, words):
    operations.create_key("ci", "test", rpm=10)
    operations.create_key("gone", "test")
    operations.revoke_key("gone", "test")
    before = state()
    refused(operator.patch(f"{API}/keys/{path}/", body, format="json"), status, *words)
    assert state() == before


def test_keys_cannot_be_deleted(operator):
    operations.create_key("ci", "test")
    before = state()
    assert operator.delete(f"{API}/keys/ci/").status_code == 405
    assert state() == before


WRITES = [
    ("post", "keys/", {"name": "mine"}),
    ("post", "keys/ci/revoke/", None),
    ("patch", "keys/ci/", {"priority": "batch"}),
    ("post", "system/stop/", None),
    ("post", "system/start/", None),
]


@pytest.mark.parametrize("method, path, body", WRITES)
def test_viewer_may_not_write(viewer, method, path, body):
    operations.create_key("ci", "test")
    before = state()
    refused(getattr(viewer, method)(f"{API}/{path}", body, format="json"), 403, "role")
    assert state() == before


@pytest.mark.parametrize("method, path, body", WRITES)
def test_anonymous_may_not_write(db, method, path, body):
    operations.create_key("ci", "test")
    before = state()
    assert getattr(APIClient(), method)(f"{API}/{path}", body, format="json").status_code == 401
    assert state() == before


@pytest.mark.parametrize("path", ["keys/", "usage/", "system/status/"])
def test_anonymous_may_not_look(db, path):
    response = APIClient().get(f"{API}/{path}")
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Bearer"


def test_admin_may_create_and_revoke(admin):
    assert admin.post(f"{API}/keys/", {"name": "a"}, format="json").status_code == 201
    assert admin.patch(f"{API}/keys/a/", {"priority": "batch"}, format="json").status_code == 200
    assert admin.post(f"{API}/keys/a/revoke/").status_code == 200


# Usage


@pytest.fixture
def usage(db):
    a, _ = operations.create_key("alice", "test")
    b, _ = operations.create_key("bob", "test")
    h = lambda hour: datetime(2026, 3, 1, hour, tzinfo=UTC)  # noqa: E731
    Usage.objects.create(key=a, model="qwen", hour=h(9), requests=3, prompt_tokens=30, completion_tokens=7)
    Usage.objects.create(key=a, model="qwen", hour=h(11), requests=1, prompt_tokens=10, completion_tokens=2)
    Usage.objects.create(key=a, model="smol", hour=h(11), requests=2, prompt_tokens=4, completion_tokens=4)
    Usage.objects.create(key=b, model="qwen", hour=h(10), requests=5, prompt_tokens=50, completion_tokens=9)


ALL = [("alice", "qwen", "11"), ("alice", "smol", "11"), ("bob", "qwen", "10"), ("alice", "qwen", "09")]


def rows(response) -> list[tuple]:
    assert response.status_code == 200, response.content
    return [(r["key"], r["model"], r["hour"][11:13]) for r in response.json()["results"]]


def test_usage_newest_first_with_every_field(viewer, usage):
    response = viewer.get(f"{API}/usage/")
    assert rows(response) == ALL
    first = response.json()["results"][0]
    assert first == {
        "key": "alice",
        "model": "qwen",
        "hour": "2026-03-01T11:00:00Z",
        "requests": 1,
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "resumed_prompt_tokens": 0,
    }
    assert response.json()["count"] == 4


@pytest.mark.parametrize(
    "query, expected",
    [
        ("key=alice", [("alice", "qwen", "11"), ("alice", "smol", "11"), ("alice", "qwen", "09")]),
        ("model=qwen", [("alice", "qwen", "11"), ("bob", "qwen", "10"), ("alice", "qwen", "09")]),
        ("key=alice&model=qwen", [("alice", "qwen", "11"), ("alice", "qwen", "09")]),
        ("since=2026-03-01T10:30:00Z", ALL[:3]),  # from the start of its hour
        ("since=2026-03-01T11:00:00%2B01:00", ALL[:3]),  # 10:00Z
        ("since=2026-03-02", []),
        ("model=nothing-here", []),
        ("limit=1&offset=1", [("alice", "smol", "11")]),
        ("by=day", [("alice", "qwen", "00"), ("alice", "smol", "00"), ("bob", "qwen", "00")]),
        ("by=hour&format=json", ALL),
    ],
)
def test_usage_filters(viewer, usage, query, expected):
    assert rows(viewer.get(f"{API}/usage/?{query}")) == expected


@pytest.mark.parametrize(
    "query, status, words",
    [
        ("key=nobody", 422, ["key", "no key named 'nobody'"]),
        ("key=a%00", 400, ["key", "NUL character"]),
        ("key=", 400, ["key", "name a key"]),  # an empty filter is refused, as the schema says (minLength 1)
        ("model=", 400, ["model", "name a model"]),
        ("since=yesterday", 400, ["since", "ISO 8601"]),
        ("since=2026-13-01T00:00:00Z", 400, ["since", "ISO 8601"]),
        ("by=week", 400, ["by", "hour or day"]),
        ("format=xml", 400, ["format", "json or csv"]),
        ("format=csv&key=nobody", 422, ["no key named 'nobody'"]),  # a refusal stays JSON
        ("format=csv&by=week", 400, ["by"]),
    ],
)
def test_usage_bad_filters_are_refused(viewer, usage, query, status, words):
    refused(viewer.get(f"{API}/usage/?{query}"), status, *words)


def test_usage_as_csv_is_every_row_with_a_header(viewer, usage):
    response = viewer.get(f"{API}/usage/?format=csv&by=day&key=alice")
    assert response.status_code == 200 and response["Content-Type"] == "text/csv; charset=utf-8"
    assert response.content.decode().splitlines() == [
        "key,model,hour,requests,prompt_tokens,completion_tokens,resumed_prompt_tokens",
        "alice,qwen,2026-03-01T00:00:00Z,4,40,9,0",
        "alice,smol,2026-03-01T00:00:00Z,2,4,4,0",
    ]
    asked = viewer.get(f"{API}/usage/", HTTP_ACCEPT="text/csv").content.decode().splitlines()
    assert len(asked) == 5 and asked[1] == "alice,qwen,2026-03-01T11:00:00Z,1,10,2,0"
    assert len(viewer.get(f"{API}/usage/?format=csv&limit=2").content.decode().splitlines()) == 3  # a page
    refused(APIClient().get(f"{API}/usage/?format=csv"), 401, "credentials")  # JSON, as every refusal


# The system


def test_stop_and_start(operator):
    response = operator.post(f"{API}/system/stop/")
    assert response.status_code == 200, response.content
    assert response.json()["serving"] == "stopped"
    assert ClusterSettings.load().serving_stopped is True
    assert Event.objects.get(kind="system.stopped").actor.startswith("user:operator-")
    assert operator.get(f"{API}/system/status/").json()["serving"] == "stopped"
    assert operator.get(f"{API}/status/").json()["serving"] == "stopped"

    before = state()
    refused(operator.post(f"{API}/system/stop/"), 409, "already stopped")
    assert state() == before

    response = operator.post(f"{API}/system/start/")
    assert response.status_code == 200 and response.json()["serving"] == "serving"
    assert ClusterSettings.load().serving_stopped is False
    assert Event.objects.filter(kind="system.started").count() == 1

    before = state()
    refused(operator.post(f"{API}/system/start/"), 409, "already serving")
    assert state() == before


def test_system_status_is_the_cluster_status(viewer):
    body = viewer.get(f"{API}/system/status/").json()
    assert body == viewer.get(f"{API}/status/").json()
    assert set(body) == {"serving", "nodes", "models", "replicas"}
    assert viewer.post(f"{API}/system/status/").status_code in (403, 405)


def test_system_has_no_list_or_other_verbs(operator):
    assert operator.get(f"{API}/system/stop/").status_code == 405
    assert operator.get(f"{API}/system/").status_code == 404
