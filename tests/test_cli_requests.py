"""`llmgw ctl requests` and `ctl requests show ID`: the request records as an operator reads them, through the
REST API (here the host's own, in process)."""

import io
import json
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from gateway.models import ApiKey, RequestRecord

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def recorded():
    key = ApiKey.objects.create(name="agent", prefix="sk-llmgw-ag", key_hash="3" * 64)
    now = timezone.now()
    RequestRecord.objects.bulk_create([
        RequestRecord(request_id="turn/1", at=now - timedelta(seconds=30), key=key, model="qwen", asked="fast",
                      surface="chat/completions", streamed=True, status=200, priority="interactive", waited_ms=3.0,
                      replica="qwen-a", attempts=1, ttft_ms=240.0, total_ms=2400.0, prompt_tokens=900,
                      completion_tokens=120, client="10.0.0.7", trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
                      span_id="00f067aa0ba902b7", position=3, cached_tokens=850, prompt_ms=180.0, generation_ms=2100.0,
                      route={"policy": "prefix", "hit": "", "chosen": "qwen-a (1 in flight)",
                             "passed": [["qwen-b", "tried: failed: connection refused"]]},
                      tries=[["qwen-b", 2.0, 2.5, "failed: connection refused"], ["qwen-a", 3.0, 30.0, "answered 200"]],
                      request_body='{"model": "fast",\n "stream": true}', response_body="data: [DONE]"),
        RequestRecord(request_id="req_0123", at=now - timedelta(seconds=10), key=key, model="qwen",
                      surface="messages", status=503, error="no_replica_ready", total_ms=5000.0, attempts=0),
    ])


def test_the_list_is_newest_first_and_filtered(recorded):
    shown = run("ctl", "requests")
    assert shown.index("req_0123") < shown.index("turn/1")
    assert "503 no_replica_ready" in shown and "chat/completions (stream)" in shown and "900+120" in shown
    assert "turn/1" not in run("ctl", "requests", "--status", "5xx")
    assert "req_0123" not in run("ctl", "requests", "--slower-than", "1s", "--status", "2xx")
    assert [r["request_id"] for r in json.loads(run("ctl", "requests", "--key", "agent", "--json"))] == [
        "req_0123", "turn/1"]


def test_show_prints_one_requests_figures(recorded):
    shown = run("ctl", "requests", "show", "turn/1")
    assert "request turn/1  trace 4bf92f3577b34da6a3ce929d0e0e4736" in shown
    for said in ("agent (interactive)", "qwen (asked as fast), /v1/chat/completions streamed", "replica   qwen-a after 1",
                 "first     240ms", "total     2.40s", "900 prompt (850 cached), 120 completion", "from 10.0.0.7",
                 "span 00f067aa0ba902b7", "(queued at position 3)", "engine    prompt 180ms, generation 2.10s"):
        assert said in shown, shown
    # the timeline: arrived → queued → admitted → each attempt, the replica chosen and why → first token → end
    told = shown[shown.index("timeline\n"):shown.index("request body\n")].splitlines()[1:]
    assert [line.split(None, 1)[1] for line in told] == [
        "arrived from 10.0.0.7: /v1/chat/completions streamed for qwen (asked as fast), class interactive",
        "queued at position 3 in its model's queue",
        "admitted: a replica and a slot after 2 ms",
        "attempt 1: sent to qwen-b",
        "attempt 1: qwen-b failed: connection refused",
        "replica qwen-a chosen: prefix; passed over qwen-b (tried: failed: connection refused)",
        "attempt 2: sent to qwen-a",
        "attempt 2: qwen-a answered 200",
        "first token",
        "the engine: 900 prompt tokens (850 from its cache) in 180 ms, 120 generated in 2.10 s",
        "ended: 200 after 2.40 s, 900+120 tokens",
    ], told
    assert told[0].split()[0] == "0ms" and told[-1].split()[0] == "2.40s"
    assert shown.endswith('request body\n  {"model": "fast",\n   "stream": true}\nresponse body\n  data: [DONE]\n')


@pytest.mark.parametrize("args, said", [
    (("ctl", "requests", "shw", "x"), "ctl requests takes filters, or `show ID`"),
    (("ctl", "requests", "show", "nope"), "no request with id 'nope' is on record"),
    (("ctl", "requests", "--slower-than", "soon"), "slower_than"),
    (("ctl", "requests", "--status", "6xx"), "status"),
])
def test_what_it_cannot_do_is_said_in_one_line(recorded, args, said):
    with pytest.raises(CommandError) as refused:
        run(*args)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_resumed_requests_are_marked_listed_alone_and_said_in_show(recorded):
    RequestRecord.objects.filter(request_id="turn/1").update(
        resumes=1, resumed_prompt_tokens=957,
        tries=[["qwen-b", 2.0, 900.0, "broke off after 57 tokens: the engine closed the connection (EOF); resumed"],
               ["qwen-a", 901.0, 2400.0, "answered 200"]])
    listed = run("ctl", "requests")
    assert "qwen-a (1 resumed)" in listed
    resumed = run("ctl", "requests", "--resumed")
    assert "turn/1" in resumed and "req_0123" not in resumed
    (one,) = json.loads(run("ctl", "requests", "--resumed", "--json"))
    assert (one["resumes"], one["resumed_prompt_tokens"]) == (1, 957)
    shown = run("ctl", "requests", "show", "turn/1")
    assert "resumed: 1 (prompt tokens the fleet paid: 957)" in shown
    assert "attempt 2: resumed on qwen-a, the answer going on from where qwen-b broke off" in shown
    assert "resumed:" not in run("ctl", "requests", "show", "req_0123")
