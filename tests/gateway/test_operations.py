"""gateway.operations: a key's priority when created, and every setting of an existing key changed; each refusal
changes nothing."""

from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.errors import Conflict, NotFound, OperationError
from cluster.models import Event
from gateway import operations
from gateway.models import ApiKey
from tests.factories import make_model, row_counts

ACTOR = "test"


def keys() -> dict:
    """Every key's settings, with row_counts(): equal before and after a refused change."""
    fields = ("name", "priority", "rpm", "tpm", "max_tokens", "allowed_models", "expires_at", "revoked_at",
              "log_bodies")
    return {"keys": list(ApiKey.objects.order_by("name").values_list(*fields)), **row_counts()}


def test_create_with_a_priority(db, monkeypatch):
    sent = []
    monkeypatch.setattr(operations.notify, "routing_changed", lambda: sent.append(1))
    key, _ = operations.create_key("batchy", ACTOR, priority="batch")
    assert ApiKey.objects.get(name="batchy").priority == "batch" and key.priority == "batch"
    assert Event.objects.get(kind="key.created", subject="batchy").message.endswith("all models, priority batch")
    operations.create_key("plain", ACTOR)
    assert ApiKey.objects.get(name="plain").priority == "standard"
    assert "priority" not in Event.objects.get(kind="key.created", subject="plain").message
    assert sent == [1, 1]


@pytest.mark.parametrize("priority", ["urgent", "", None, "Batch", 1])
def test_create_refuses_an_unknown_priority_in_one_line(db, priority):
    before = keys()
    with pytest.raises(OperationError) as refused:
        operations.create_key("k", ACTOR, priority=priority)
    assert str(refused.value) == f"priority is one of interactive, standard, batch, not {str(priority)!r}"
    assert keys() == before


def test_set_key_changes_what_is_given_and_says_what(db, monkeypatch):
    make_model("qwen")
    make_model("smol")
    operations.create_key("k1", ACTOR, rpm=10, tpm=1000, max_tokens=50, models=["qwen"])
    sent = []
    monkeypatch.setattr(operations.notify, "routing_changed", lambda: sent.append(1))
    expires = (timezone.now() + timedelta(days=7)).replace(microsecond=0)

    key = operations.set_key("k1", "user:otto", priority="batch", rpm=60, models=["smol", "qwen", "smol"],
                             expires_at=expires)
    stored = ApiKey.objects.get(name="k1")
    assert (stored.priority, stored.rpm, stored.tpm, stored.max_tokens, stored.allowed_models, stored.expires_at) == (
        "batch", 60, 1000, 50, ["qwen", "smol"], expires)
    assert (key.priority, key.rpm, key.allowed_models) == ("batch", 60, ["qwen", "smol"])
    event = Event.objects.get(kind="key.edited")
    assert (event.subject, event.actor) == ("k1", "user:otto")
    assert event.message == (f"key k1 ({stored.prefix}…) edited: priority batch, rpm 60, models qwen, smol, "
                             f"expires {expires:%Y-%m-%d %H:%M}")
    assert sent == [1]

    # None: no limit, never; an empty list: every model
    operations.set_key("k1", ACTOR, rpm=None, tpm=None, max_tokens=None, expires_at=None, models=[])
    stored.refresh_from_db()
    assert (stored.rpm, stored.tpm, stored.max_tokens, stored.expires_at, stored.allowed_models) == (
        None, None, None, None, [])
    assert Event.objects.filter(kind="key.edited").first().message.endswith(  # newest first
        "edited: rpm no limit, tpm no limit, max tokens the model's, all models, never expires")
    assert sent == [1, 1]


def test_bodies_are_off_by_default_kept_when_asked_and_the_events_say_so(db):
    assert operations.create_key("plain", ACTOR)[0].log_bodies is False
    assert "bodies" not in Event.objects.get(kind="key.created", subject="plain").message  # the default goes unsaid
    key, _ = operations.create_key("logged", ACTOR, log_bodies=True)
    assert key.log_bodies is True and ApiKey.objects.get(name="logged").log_bodies is True
    assert Event.objects.get(kind="key.created", subject="logged").message.endswith("all models, bodies logged")

    operations.set_key("plain", ACTOR, log_bodies=True)
    assert ApiKey.objects.get(name="plain").log_bodies is True
    assert Event.objects.filter(kind="key.edited").first().message.endswith("edited: bodies logged")
    operations.set_key("plain", ACTOR, log_bodies=False, rpm=5)
    assert ApiKey.objects.get(name="plain").log_bodies is False
    assert Event.objects.filter(kind="key.edited").first().message.endswith("edited: rpm 5, bodies not logged")
    operations.set_key("plain", ACTOR, log_bodies=False)  # unchanged: no Event
    assert Event.objects.filter(kind="key.edited").count() == 2


@pytest.mark.parametrize("value", ["true", "false", 1, 0, None, "yes"])
def test_create_refuses_log_bodies_that_is_not_a_bool(db, value):
    before = keys()
    with pytest.raises(OperationError) as refused:
        operations.create_key("k", ACTOR, log_bodies=value)
    assert str(refused.value) == f"log_bodies is true or false, not {str(value)!r}"
    assert keys() == before


def test_set_key_with_nothing_different_writes_nothing(db, monkeypatch):
    operations.create_key("k1", ACTOR, rpm=10, priority="interactive")
    sent = []
    monkeypatch.setattr(operations.notify, "routing_changed", lambda: sent.append(1))
    before = keys()
    operations.set_key("k1", ACTOR, rpm=10, priority="interactive")
    operations.set_key("k1", ACTOR)
    assert keys() == before and sent == []


def test_an_expired_key_may_be_given_a_new_expiry(db):
    operations.create_key("old", ACTOR, expires_at=timezone.now() + timedelta(days=1))
    ApiKey.objects.filter(name="old").update(expires_at=timezone.now() - timedelta(hours=1))
    assert operations.set_key("old", ACTOR, expires_at=None).active


@pytest.mark.parametrize(
    "values, error, words",
    [
        ({"priority": "urgent"}, OperationError, "priority is one of interactive, standard, batch, not 'urgent'"),
        ({"priority": None}, OperationError, "priority is one of interactive, standard, batch, not 'None'"),
        ({"rpm": 0}, OperationError, "rpm must be a whole number from 1 to"),
        ({"tpm": -1}, OperationError, "tpm must be a whole number from 1 to"),
        ({"max_tokens": "many"}, OperationError, "max tokens must be a whole number"),
        ({"rpm": True}, OperationError, "rpm must be a whole number"),
        ({"models": "qwen"}, OperationError, "models must be a list of model names"),
        ({"models": ["Not A Model"]}, OperationError, "invalid model name 'Not A Model'"),
        ({"models": ["qwen", "nosuch"]}, NotFound, "no model named 'nosuch'"),
        ({"expires_at": timezone.now() - timedelta(days=1)}, OperationError, "is in the past"),
        ({"secret": "mine"}, OperationError, "a key has no setting secret"),
        ({"log_bodies": "true"}, OperationError, "log_bodies is true or false, not 'true'"),
        ({"log_bodies": 1}, OperationError, "log_bodies is true or false, not '1'"),
        ({"log_bodies": None}, OperationError, "log_bodies is true or false, not 'None'"),
        ({"log_bodies": True, "rpm": 0}, OperationError, "rpm must be a whole number"),
        # a valid change with a bad one: nothing at all
        ({"priority": "batch", "rpm": 5, "models": ["nosuch"]}, NotFound, "no model named 'nosuch'"),
    ],
)
def test_set_key_refusals_change_nothing(db, values, error, words):
    make_model("qwen")
    operations.create_key("k1", ACTOR, rpm=10)
    before = keys()
    with pytest.raises(error) as refused:
        operations.set_key("k1", ACTOR, **values)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert keys() == before


def test_set_key_refuses_a_key_that_does_not_exist_or_is_revoked(db):
    operations.create_key("gone", ACTOR)
    operations.revoke_key("gone", ACTOR)
    before = keys()
    with pytest.raises(NotFound, match="no key named 'nope'"):
        operations.set_key("nope", ACTOR, rpm=5)
    with pytest.raises(Conflict, match="key gone is revoked"):
        operations.set_key("gone", ACTOR, priority="batch")
    assert keys() == before


def test_a_revocation_that_commits_first_wins(db, monkeypatch):
    """The conditional update: a key revoked between the read and the write is refused, not changed."""
    operations.create_key("k1", ACTOR)
    before_write = ApiKey.objects.filter

    def revoked_meanwhile(*args, **kwargs):
        rows = before_write(*args, **kwargs)
        if kwargs.get("revoked_at__isnull"):
            ApiKey.objects.exclude(revoked_at__isnull=False).update(revoked_at=timezone.now())
        return rows

    monkeypatch.setattr(ApiKey.objects, "filter", revoked_meanwhile)
    with pytest.raises(Conflict, match="key k1 is revoked"):
        operations.set_key("k1", ACTOR, priority="batch")
    monkeypatch.undo()
    assert ApiKey.objects.get(name="k1").priority == "standard"
    assert not Event.objects.filter(kind="key.edited").exists()
