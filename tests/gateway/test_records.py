"""The request records (gateway/records.py): kept in memory until written, pruned by age and count, and read
through the REST API (`/api/v1/requests/`) with its filters and roles."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from cluster.models import Event
from gateway import metrics, records
from gateway.models import ApiKey, RequestRecord
from tests.rest import API, refused

pytestmark = pytest.mark.django_db


def record(request_id: str, ago: float = 0.0, **fields) -> RequestRecord:
    values = {"request_id": request_id, "at": timezone.now() - timedelta(seconds=ago), "surface": "chat/completions",
              "status": 200, "total_ms": 10.0, **fields}
    return RequestRecord(**values)


def row(request_id: str) -> records.Row:
    return records.Row(request_id, "ab" * 16, 1_700_000_000.25, None, "qwen", "fast", "messages", True, 200, "",
                       "batch", 2.5, "qwen-1", 2, 30.0, 90.0, 11, 7, "10.1.2.3", "cd" * 8, "ef" * 8, 3,
                       records.Why("prefix", "", "qwen-1 (0 in flight)", (("qwen-0", "tried: answered 503"),)),
                       (records.Try("qwen-0", 2.5, 4.0, "answered 503"), records.Try("qwen-1", 4.5, 6.0, "answered 200")),
                       4, 12.5, 50.25, '{"model": "qwen"}', "data: {}\n\n")


def test_records_wait_in_memory_until_taken_and_a_failed_write_keeps_them_first(monkeypatch):
    monkeypatch.setattr(records, "KEPT", 3)
    waiting = records.Records()
    for name in "abcd":
        waiting.add(row(name))
    assert [r.request_id for r in waiting.take()] == ["b", "c", "d"] and waiting.dropped == 1  # the oldest dropped
    waiting.add(row("e"))
    waiting.keep([row("x"), row("y")])
    assert [r.request_id for r in waiting.take()] == ["x", "y", "e"]
    records.write([row("w")])
    written = RequestRecord.objects.values().get()
    assert written["at"].isoformat() == "2023-11-14T22:13:20.250000+00:00"
    sent = row("w")._asdict()
    assert {k: written[k] for k in records.Row._fields if k not in ("at", "route", "tries")} == {
        k: v for k, v in sent.items() if k not in ("at", "route", "tries")}
    assert written["route"] == {"policy": "prefix", "hit": "", "chosen": "qwen-1 (0 in flight)",
                                "passed": [["qwen-0", "tried: answered 503"]]}  # JSON, on SQLite and PostgreSQL
    assert written["tries"] == [["qwen-0", 2.5, 4.0, "answered 503"], ["qwen-1", 4.5, 6.0, "answered 200"]]


@override_settings(LLMGW_REQUEST_LOG_DAYS=7, LLMGW_REQUEST_LOG_ROWS=3)
def test_prune_keeps_the_last_days_and_at_most_the_newest_rows():
    RequestRecord.objects.bulk_create([record("old", ago=8 * 86400), *(record(f"r{i}", ago=100 - i) for i in range(5))])
    assert records.prune() == 3  # the old one, and the two oldest past the newest three
    assert sorted(RequestRecord.objects.values_list("request_id", flat=True)) == ["r2", "r3", "r4"]
    with override_settings(LLMGW_REQUEST_LOG_ROWS=0):
        assert records.prune() == 3 and not RequestRecord.objects.exists()


@pytest.fixture
def recorded():
    ci = ApiKey.objects.create(name="ci", prefix="sk-llmgw-ci", key_hash="1" * 64)
    batch = ApiKey.objects.create(name="batch", prefix="sk-llmgw-ba", key_hash="2" * 64)
    RequestRecord.objects.bulk_create([
        record("fast", ago=50, key=ci, model="qwen", total_ms=12.0, prompt_tokens=3, completion_tokens=5),
        record("slow", ago=40, key=ci, model="qwen", total_ms=2500.0, streamed=True, ttft_ms=300.0),
        record("limited", ago=30, key=batch, model="qwen", status=429, error="rate_limited"),
        record("broken", ago=20, key=batch, model="smol", status=502, error="upstream_error", replica="smol-1"),
        record("same", ago=10, model="qwen"), record("same", ago=5, model="smol"),
    ])


def listed(client, query: str = "") -> list[str]:
    response = client.get(f"{API}/requests/{query}")
    assert response.status_code == 200, response.content
    return [r["request_id"] for r in response.json()["results"]]


def test_a_viewer_lists_them_newest_first_filtered_by_key_model_status_slowness_and_time(viewer, recorded):
    assert listed(viewer) == ["same", "same", "broken", "limited", "slow", "fast"]
    assert listed(viewer, "?key=ci") == ["slow", "fast"]
    assert listed(viewer, "?model=smol") == ["same", "broken"]
    assert listed(viewer, "?status=5xx") == ["broken"] and listed(viewer, "?status=429") == ["limited"]
    assert listed(viewer, "?status=2xx&key=ci") == ["slow", "fast"]
    assert listed(viewer, "?slower_than=2s") == ["slow"] and listed(viewer, "?slower_than=12ms") == ["slow"]
    since = (timezone.now() - timedelta(seconds=25)).isoformat().replace("+00:00", "Z")
    assert listed(viewer, f"?since={since}") == ["same", "same", "broken"]
    shown = viewer.get(f"{API}/requests/slow/").json()
    assert shown["key"] == "ci" and shown["streamed"] is True and shown["ttft_ms"] == 300.0
    assert viewer.get(f"{API}/requests/same/").json()["model"] == "smol"  # the newest with that id
    assert listed(viewer, "?replica=smol-1") == ["broken"]


def test_one_is_told_as_its_timeline_and_its_phases(viewer, recorded):
    RequestRecord.objects.filter(request_id="slow").update(
        position=1, route={"policy": "least in flight", "hit": "", "chosen": "qwen-1 (2 in flight)",
                           "passed": [["qwen-2", "3 in flight"]]}, tries=[["qwen-1", 20.0, 290.0, "answered 200"]],
        cached_tokens=2, prompt_ms=250.0, generation_ms=2100.0)
    shown = viewer.get(f"{API}/requests/slow/").json()
    assert (shown["position"], shown["cached_tokens"], shown["route"]["passed"]) == (1, 2, [["qwen-2", "3 in flight"]])
    assert [s["what"].split(":")[0] for s in shown["timeline"]] == [
        "arrived from -", "queued at position 1 in its model's queue", "admitted", "replica qwen-1 chosen",
        "attempt 1", "attempt 1", "first token", "the engine", "ended"]
    assert [(p["kind"], p["start_ms"], p["end_ms"]) for p in shown["phases"]] == [
        ("queue", 0.0, 20.0), ("prompt", 20.0, 300.0), ("generation", 300.0, 2500.0)]
    assert viewer.get(f"{API}/requests/fast/").json()["route"] is None  # none was chosen on record


def test_a_replicas_failure_event_lists_the_requests_it_broke(viewer, recorded):
    failed = Event.objects.create(kind="replica.failed", actor="agent:a", subject="smol-1", message="smol-1 failed")
    long_before = Event.objects.create(kind="replica.failed", actor="agent:a", subject="smol-1", message="earlier",
                                       created_at=timezone.now() - timedelta(hours=1))
    assert listed(viewer, f"?event={failed.id}") == ["broken"]
    assert listed(viewer, f"?event={long_before.id}") == []  # what broke an hour later was not its doing
    ready = Event.objects.create(kind="replica.ready", actor="agent:a", subject="smol-1", message="ready")
    refused(viewer.get(f"{API}/requests/?event={ready.id}"), 422, f"no replica.failed Event has id {ready.id}")
    for said in (2**63, "x", "0", "²"):
        refused(viewer.get(f"{API}/requests/?event={said}"), 400, "event")


@pytest.mark.parametrize("query, field", [("?status=600", "status"), ("?status=5x", "status"),
                                          ("?slower_than=soon", "slower_than"), ("?since=yesterday", "since"),
                                          ("?key=", "key"), ("?model=a%00b", "model")])
def test_a_filter_it_cannot_read_is_a_400_naming_it(viewer, recorded, query, field):
    refused(viewer.get(f"{API}/requests/{query}"), 400, field)


def test_one_not_on_record_is_a_404_and_nobody_unknown_sees_any(viewer, recorded):
    refused(viewer.get(f"{API}/requests/nope/"), 404, "nope")
    assert APIClient().get(f"{API}/requests/").status_code in (401, 403)


def test_errors_per_hour_and_day_are_the_answers_of_400_and_more():
    key = ApiKey.objects.create(name="agent", prefix="sk-llmgw-ag", key_hash="5" * 64)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    RequestRecord.objects.bulk_create([
        record("a", status=502, key=key, model="qwen"), record("b", status=429, model="qwen"),
        record("c", status=200, key=key, model="qwen"), record("d", ago=3600, status=500, key=key, model="smol"),
    ])
    since = now - timedelta(hours=2)
    assert records.errors_per("hour", since) == {hour: 2, hour - timedelta(hours=1): 1}
    assert records.errors_per("hour", since, key="agent", model="qwen") == {hour: 1}
    days = records.errors_per("day", since)
    assert sum(days.values()) == 3 and all(d.hour == 0 and d.tzinfo is not None for d in days)


def test_only_an_admin_sees_the_bodies(viewer, operator, admin, recorded):
    RequestRecord.objects.filter(request_id="fast").update(request_body='{"model": "qwen"}', response_body="{}")
    for someone in (viewer, operator):
        shown = someone.get(f"{API}/requests/fast/").json()
        assert "request_body" not in shown and "response_body" not in shown
        assert all("request_body" not in r for r in someone.get(f"{API}/requests/").json()["results"])
    shown = admin.get(f"{API}/requests/fast/").json()
    assert (shown["request_body"], shown["response_body"]) == ('{"model": "qwen"}', "{}")


def resumed_row(request_id: str, *tries: records.Try, resumes: int = 1, fleets: int = 957) -> records.Row:
    return row(request_id)._replace(tries=tries, resumes=resumes, resumed_prompt_tokens=fleets)


CLOSED = "broke off after 57 tokens: the engine closed the connection (EOF); resumed"
SILENT = "went silent for 30s after 12 tokens; resumed"


def _written_with_resumes() -> None:
    records.write([
        resumed_row("r1", records.Try("spread-1a2b", 2.0, 90.0, CLOSED), records.Try("spread-3c4d", 91.0, 400.0,
                                                                                        "answered 200")),
        resumed_row("r2", records.Try("spread-1a2b", 2.0, 30.0, SILENT), records.Try("spread-3c4d", 31.0, 90.0, SILENT),
                    records.Try("spread-5e6f", 91.0, 300.0, "answered 200"), resumes=2, fleets=2000),
        row("plain"),
    ])


def test_a_records_resumes_are_written_and_read_back():
    _written_with_resumes()
    written = {r.request_id: r for r in RequestRecord.objects.all()}
    assert [(written[i].resumes, written[i].resumed_prompt_tokens) for i in ("r1", "r2", "plain")] == [
        (1, 957), (2, 2000), (0, 0)]
    assert written["r1"].tries[0] == ["spread-1a2b", 2.0, 90.0, CLOSED]


def test_on_postgresql_a_records_resumes_are_copied_and_read_back(on_postgresql):
    _written_with_resumes()
    assert sorted(RequestRecord.objects.values_list("request_id", "resumes", "resumed_prompt_tokens")) == [
        ("plain", 0, 0), ("r1", 1, 957), ("r2", 2, 2000)]
    assert Event.objects.filter(kind="replica.broke_off").count() == 2


def test_a_batch_with_resumes_writes_an_event_per_replica_it_resumed_away_from(django_assert_num_queries):
    _written_with_resumes()
    said = {e.subject: e for e in Event.objects.filter(kind="replica.broke_off")}
    assert set(said) == {"spread-1a2b", "spread-3c4d"}  # the replica that answered last broke nothing
    assert said["spread-1a2b"].message == (
        "replica spread-1a2b: 2 answers resumed elsewhere after it broke off (closed the connection / went silent)")
    assert said["spread-1a2b"].data == {"answers": 2, "reasons": {"closed": 1, "silent": 1}, "requests": ["r1", "r2"]}
    assert said["spread-3c4d"].message == "replica spread-3c4d: 1 answer resumed elsewhere after it broke off (went silent)"
    assert said["spread-1a2b"].actor == "gateway"
    with django_assert_num_queries(3):  # the records, and nothing else (the transaction's savepoint and release)
        records.write([row("a"), row("b")])
    assert Event.objects.filter(kind="replica.broke_off").count() == 2
    with django_assert_num_queries(4):  # and one more for a batch's Events, however many
        _written_with_resumes()


@pytest.mark.parametrize("outcome, reason", [
    (CLOSED, "closed"), (SILENT, "silent"), ("broke off: its replica left the fleet (node lost); resumed", "lost"),
    ("broke off after 3 tokens: the engine answered an error event; resumed", "error"),
    ("broke off: connection reset by peer; resumed", "closed"), ("broke off; resumed", "closed")])
def test_a_resumed_trys_outcome_reads_as_its_reason(outcome, reason):
    assert records.resume_reason(outcome) == reason
    assert tuple(records.RESUME_SAID) == metrics.RESUME_REASONS  # each reason in words, for its Event


def test_the_resumed_filter_lists_only_resumed_requests(viewer, recorded):
    RequestRecord.objects.filter(request_id="slow").update(resumes=1, resumed_prompt_tokens=40)
    assert listed(viewer, "?resumed=true") == ["slow"]
    assert "slow" not in listed(viewer, "?resumed=false") and len(listed(viewer, "?resumed=false")) == 5
    shown = viewer.get(f"{API}/requests/slow/").json()
    assert (shown["resumes"], shown["resumed_prompt_tokens"]) == (1, 40)
    for said in ("yes", "TRUE", ""):
        refused(viewer.get(f"{API}/requests/?resumed={said}"), 400, "resumed")


def test_a_resumed_try_reads_as_a_resume_in_the_timeline(viewer, recorded):
    RequestRecord.objects.filter(request_id="slow").update(resumes=1, tries=[
        ["qwen-1", 20.0, 900.0, CLOSED], ["qwen-2", 905.0, 2500.0, "answered 200"]])
    shown = viewer.get(f"{API}/requests/slow/").json()
    steps = [s["what"] for s in shown["timeline"]]
    assert "attempt 1: qwen-1 broke off after 57 tokens: the engine closed the connection (EOF): resumed on qwen-2" in steps
    assert "attempt 2: resumed on qwen-2, the answer going on from where qwen-1 broke off" in steps
    assert [(p["kind"], p["start_ms"], p["end_ms"]) for p in shown["phases"]] == [
        ("queue", 0.0, 20.0), ("failed", 20.0, 900.0), ("generation", 905.0, 2500.0)]
