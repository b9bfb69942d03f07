"""gateway.usage.record: what a web process counted into Usage rows and last use, in one transaction, with the
budgets' spend read back; and a web process's books (gateway/runtime.py) keeping what the database refused."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection

from cluster.errors import OperationError
from gateway import operations, usage
from gateway.accounting import Ledger
from gateway.models import ApiKey, Usage

HOUR = 1_772_000_000 // 3600 * 3600  # the start of an hour in 2026


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def counted(*requests) -> tuple[dict[tuple[int, int, str], list[int]], dict[int, float]]:
    """What a web process takes from its ledger: (key, model, prompt tokens, completion tokens, when) each."""
    ledger = Ledger()
    for key, model, prompt, completion, when in requests:
        ledger.add(key.pk, model, prompt, completion, now=when)
    return ledger.take_usage()


def rows() -> dict[tuple, tuple]:
    return {
        (u.key.name, u.model, u.hour): (u.requests, u.prompt_tokens, u.completion_tokens)
        for u in Usage.objects.select_related("key")
    }


@pytest.fixture
def keys(db):
    return operations.create_key("alice", "test")[0], operations.create_key("bob", "test")[0]


def test_usage_adds_up_per_key_model_and_hour_across_writes(keys):
    alice, bob = keys
    Usage.objects.create(key=alice, model="qwen", hour=at(HOUR), requests=10, prompt_tokens=100, completion_tokens=50)
    usage.record(*counted(
        (alice, "qwen", 10, 5, HOUR + 1),
        (alice, "qwen", 20, 7, HOUR + 1800),
        (alice, "smol", 3, 3, HOUR + 3599),
        (alice, "qwen", 1, 1, HOUR + 3600),  # the next hour
    ))
    usage.record(*counted((bob, "qwen", 4, 2, HOUR + 60)))  # another web process
    assert rows() == {
        ("alice", "qwen", at(HOUR)): (12, 130, 62),
        ("alice", "smol", at(HOUR)): (1, 3, 3),
        ("alice", "qwen", at(HOUR + 3600)): (1, 1, 1),
        ("bob", "qwen", at(HOUR)): (1, 4, 2),
    }


def test_last_used_is_set_and_never_moves_back(keys):
    alice, bob = keys
    now = datetime.now(UTC).timestamp()
    usage.record(*counted((alice, "qwen", 1, 1, now - 30), (alice, "qwen", 1, 1, now - 5)))
    ApiKey.objects.filter(pk=bob.pk).update(last_used_at=at(now))
    usage.record(*counted((bob, "qwen", 1, 1, now - 100)))  # older than what the database already has
    alice.refresh_from_db()
    bob.refresh_from_db()
    assert abs((alice.last_used_at - at(now - 5)).total_seconds()) < 0.001
    assert bob.last_used_at == at(now)


def test_a_deleted_keys_usage_is_dropped(keys):
    alice, bob = keys
    taken = counted((alice, "qwen", 1, 1, HOUR), (bob, "qwen", 9, 9, HOUR))
    bob_pk = bob.pk
    bob.delete()
    usage.record(*taken)
    assert rows() == {("alice", "qwen", at(HOUR)): (1, 1, 1)}
    assert not Usage.objects.filter(key_id=bob_pk).exists()


def test_the_spend_of_the_budgets_written_is_read_back(keys):
    alice, _ = keys
    day = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    Usage.objects.create(key=alice, model="qwen", hour=day - timedelta(hours=1), prompt_tokens=500)  # yesterday
    spent = usage.record(*counted((alice, "qwen", 30, 12, day.timestamp() + 60)), spends=[(alice.pk, "day", day)])
    assert spent == {(alice.pk, "day", day): 42}


def test_usage_recorded_is_what_the_report_shows(keys):
    alice, bob = keys
    usage.record(*counted((alice, "qwen", 10, 5, HOUR), (bob, "smol", 1, 1, HOUR + 3600)))
    report = operations.usage_report(key="alice")
    assert report == [
        {"key": "alice", "model": "qwen", "hour": at(HOUR), "requests": 1, "prompt_tokens": 10, "completion_tokens": 5,
         "resumed_prompt_tokens": 0}
    ]
    assert [r["key"] for r in operations.usage_report(since=at(HOUR) + timedelta(minutes=90))] == ["bob"]


def test_resumed_prompt_tokens_add_up_apart_from_the_keys_tokens_and_its_budget(keys):
    """A resume's prompt is the fleet's cost: counted in its own column, never in the key's tokens or spend."""
    alice, _ = keys
    day = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    ledger = Ledger()
    ledger.add(alice.pk, "qwen", 30, 12, now=day.timestamp() + 60, resumed=400)
    ledger.add(alice.pk, "qwen", 5, 1, now=day.timestamp() + 61)
    spent = usage.record(*ledger.take_usage(), spends=[(alice.pk, "day", day)])
    ledger.add(alice.pk, "qwen", 0, 3, now=day.timestamp() + 62, resumed=50)  # the next second's write adds to it
    usage.record(*ledger.take_usage())
    assert spent == {(alice.pk, "day", day): 48}
    assert Usage.objects.values_list("requests", "prompt_tokens", "completion_tokens", "resumed_prompt_tokens").get() == (
        3, 35, 16, 450)
    (shown,) = operations.usage_report(key="alice")
    assert (shown["prompt_tokens"], shown["resumed_prompt_tokens"]) == (35, 450)
    assert operations.usage_csv([shown]).splitlines()[0].endswith(",completion_tokens,resumed_prompt_tokens")


def test_usage_by_day_sums_a_days_hours_in_utc(keys):
    alice, bob = keys
    day = at(HOUR).replace(hour=0)
    Usage.objects.bulk_create([
        Usage(key=alice, model="qwen", hour=day + timedelta(hours=1), requests=2, prompt_tokens=10, completion_tokens=1),
        Usage(key=alice, model="qwen", hour=day + timedelta(hours=23), requests=3, prompt_tokens=20, completion_tokens=2),
        Usage(key=alice, model="qwen", hour=day + timedelta(hours=24), requests=1, prompt_tokens=5, completion_tokens=5),
        Usage(key=bob, model="smol", hour=day + timedelta(hours=5), requests=7, prompt_tokens=70, completion_tokens=7),
    ])
    report = operations.usage_report(by="day")
    assert [(r["key"], r["hour"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in report] == [
        ("alice", day + timedelta(days=1), 1, 5, 5), ("alice", day, 5, 30, 3), ("bob", day, 7, 70, 7)]
    assert len(operations.usage_report(by="hour", limit=None)) == 4 and len(operations.usage_report(limit=2)) == 2
    with pytest.raises(OperationError):
        operations.usage_report(by="week")


@pytest.mark.django_db(transaction=True)
def test_a_write_the_database_refused_is_tried_again_with_what_came_since():
    """A web process's books: the database refuses (a lock, a failover); nothing is lost or counted twice."""
    from gateway.runtime import Gateway

    alice = operations.create_key("alice", "test")[0]
    failing = [True]

    def database_fails(execute, sql, params, many, context):
        if failing[0] and "usage" in sql.lower() and sql.lstrip().upper().startswith(("INSERT", "UPDATE")):
            raise RuntimeError("the database went away")
        return execute(sql, params, many, context)

    async def twice():
        gw = Gateway()
        try:
            gw.ledger.add(alice.pk, "qwen", 10, 10, now=HOUR + 1)
            await gw.books()
            assert not await Usage.objects.aexists()
            failing[0] = False
            gw.ledger.add(alice.pk, "qwen", 1, 1, now=HOUR + 2)  # more arrives meanwhile
            await gw.books()
        finally:
            await gw.aclose()

    # the gateway's database work runs on this thread (database_sync_to_async under async_to_sync)
    with connection.execute_wrapper(database_fails):
        async_to_sync(twice)()
    assert rows() == {("alice", "qwen", at(HOUR)): (2, 11, 11)}


def test_on_postgresql_resumed_prompt_tokens_add_to_the_hours_row(on_postgresql):
    alice = operations.create_key("alice", "test")[0]
    for resumed in (400, 50):
        ledger = Ledger()
        ledger.add(alice.pk, "qwen", 10, 2, now=HOUR + 60, resumed=resumed)
        usage.record(*ledger.take_usage())
    assert Usage.objects.values_list("requests", "prompt_tokens", "resumed_prompt_tokens").get() == (2, 20, 450)
