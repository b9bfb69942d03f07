"""The dashboard's Requests page: the records newest first, filtered as the API filters them, one shown whole; a
filter it cannot read said on the page."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.models import Event
from gateway.models import ApiKey, RequestRecord
from tests.factories import session_for

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def look(db):
    key = ApiKey.objects.create(name="agent", prefix="sk-llmgw-ag", key_hash="4" * 64)
    now = timezone.now()
    RequestRecord.objects.bulk_create([
        RequestRecord(request_id="ok-1", at=now - timedelta(seconds=20), key=key, model="qwen", surface="messages",
                      streamed=True, status=200, total_ms=2500.0, ttft_ms=310.0, replica="qwen-a", attempts=1,
                      prompt_tokens=40, completion_tokens=9, trace_id="ab" * 16, position=2, cached_tokens=30,
                      prompt_ms=120.0, generation_ms=2000.0,
                      route={"policy": "prefix", "hit": "", "chosen": "qwen-a (0 in flight)",
                             "passed": [["qwen-b", "tried: answered 503"]]},
                      tries=[["qwen-b", 50.0, 60.0, "answered 503"], ["qwen-a", 70.0, 300.0, "answered 200"]]),
        RequestRecord(request_id="bad-2", at=now - timedelta(seconds=10), model="qwen", surface="chat/completions",
                      status=502, error="upstream_error", total_ms=40.0, replica="qwen-a", attempts=1,
                      tries=[["qwen-a", 1.0, 39.0, "failed: connection reset"]]),
    ])
    Event.objects.create(kind="replica.failed", actor="agent:local", subject="qwen-a",
                         message="replica qwen-a failed: exited with code -9")
    Event.objects.create(kind="replica.ready", actor="agent:local", subject="qwen-c", message="replica qwen-c ready")
    return session_for("viewer")


def rows(body: str) -> list[str]:
    return re.findall(r'<tr data-request="([^"]+)"', body)


def test_a_viewer_sees_them_newest_first_and_filters_them(look):
    assert rows(look.get("/requests/").content.decode()) == ["bad-2", "ok-1"]
    assert rows(look.get("/requests/?status=5xx", **HTMX).content.decode()) == ["bad-2"]
    assert rows(look.get("/requests/?key=agent&slower_than=2s", **HTMX).content.decode()) == ["ok-1"]
    assert "No requests match" in look.get("/requests/?model=none", **HTMX).content.decode()


def test_a_request_is_shown_whole_and_a_filter_it_cannot_read_is_said(look):
    body = look.get("/requests/?id=ok-1").content.decode()
    assert 'data-request="ok-1"' in body and "ab" * 16 in body and "/v1/messages streamed" in body
    assert "310.0 ms" in body and "40 prompt (30 cached), 9 completion" in body
    # why that replica, its timeline in words and drawn: the queue, the failed attempt, the prompt, the generation
    assert "prefix; passed over qwen-b (tried: answered 503)" in body and "entered at position 2" in body
    assert re.findall(r'data-kind="(\w+)"', body) == ["queue", "failed", "prompt", "generation"]
    assert "replica qwen-a chosen: prefix" in body and "first token" in body
    # its replicas' events, and a link to all of them
    assert "replica qwen-a failed: exited with code -9" in body and "replica qwen-c ready" not in body
    assert 'href="/events/?subject=qwen-a"' in body and 'href="/events/?subject=qwen-b"' in body
    assert "no request with id &#x27;nope&#x27; is on record" in look.get("/requests/?id=nope").content.decode()
    said = look.get("/requests/?slower_than=soon").content.decode()
    assert "slower than: a time such as 2s" in said and not rows(said)


def test_a_replicas_failure_event_names_the_requests_it_broke(look):
    body = look.get("/events/").content.decode()
    assert 'broke 1 request: <a class="mono" href="/requests/?id=bad-2">bad-2</a>' in body


def test_only_an_admin_sees_the_bodies_on_the_page(look):
    from tests.factories import session_for

    RequestRecord.objects.filter(request_id="ok-1").update(request_body='{"model": "qwen", "messages": []}',
                                                           response_body="data: [DONE]")
    assert "Request body" not in look.get("/requests/?id=ok-1").content.decode()
    body = session_for("admin").get("/requests/?id=ok-1").content.decode()
    assert "Request body" in body and "&quot;messages&quot;: []" in body and "data: [DONE]" in body


def test_a_resumed_request_is_marked_filtered_and_its_resumes_said(look):
    RequestRecord.objects.filter(request_id="ok-1").update(resumes=1, resumed_prompt_tokens=957, tries=[
        ["qwen-b", 50.0, 60.0, "went silent for 30s after 12 tokens; resumed"], ["qwen-a", 70.0, 300.0, "answered 200"]])
    listed = look.get("/requests/").content.decode()
    assert "(1 resumed)" in listed
    assert rows(look.get("/requests/?resumed=true", **HTMX).content.decode()) == ["ok-1"]
    body = look.get("/requests/?id=ok-1").content.decode()
    assert "1 time on another replica" in body and "prompt tokens the fleet paid, not its key: 957" in body
    assert "resumed on qwen-a, the answer going on from where qwen-b broke off" in body


def test_the_events_page_links_the_answers_a_replica_made_resume(look):
    Event.objects.create(kind="replica.broke_off", actor="gateway", subject="qwen-b", data={
        "answers": 1, "reasons": {"silent": 1}, "requests": ["ok-1"]},
        message="replica qwen-b: 1 answer resumed elsewhere after it broke off (went silent)")
    body = look.get("/events/?subject=qwen-b").content.decode()
    assert "1 answer resumed elsewhere after it broke off (went silent)" in body
    assert 'resumed elsewhere: <a class="mono" href="/requests/?id=ok-1">ok-1</a>' in body
