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
                      completion_tokens=120, client="10.0.0.7", trace_id="4bf92f3577b34da6a3ce929d0e0e4736"),
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
                 "first     240ms", "total     2.40s", "900 prompt, 120 completion", "from 10.0.0.7"):
        assert said in shown, shown


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
