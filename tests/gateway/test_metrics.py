"""The gateway's Prometheus metrics: every label takes a bounded set of values (the models llmgw serves and one
`unknown`, a status code, a kind of token), so the series do not grow with what changes all the time (replica
names: each replica ever started would be a series of its own, for ever)."""

from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from cluster.models import Replica
from gateway import admission, metrics
from gateway.call import Call
from tests.factories import make_model, make_node, make_replica, seed_defaults
from tests.gateway.views.harness import Client

# priority: 3 classes; reason: 4 refusals; state: a replica's 8
BOUNDED = {"model", "status", "kind", "priority", "reason", "state"}
S = Replica.State


def test_every_metric_has_bounded_labels():
    found = {name: m for name, m in vars(metrics).items() if isinstance(m, MetricWrapperBase)}
    assert len(found) >= 7, found
    unbounded = {name: set(m._labelnames) - BOUNDED for name, m in found.items() if set(m._labelnames) - BOUNDED}
    assert not unbounded, unbounded


def _requests(model: str) -> list:
    return [s for family in REGISTRY.collect() if family.name == "llmgw_requests" for s in family.samples
            if s.name == "llmgw_requests_total" and s.labels["model"] == model]


def test_requests_served_by_many_replicas_are_one_series():
    for replica in ("bounded-1", "bounded-2", "bounded-3"):
        call = Call()
        call.model, call.known, call.way.replica = "bounded", True, replica
        call.finish(200)
    (series,) = _requests("bounded")
    assert series.labels == {"model": "bounded", "status": "200"} and series.value == 3


def test_a_model_has_its_queues_series_from_its_first_request():
    assert metrics.PRIORITIES == admission.CLASSES
    metrics.of("never-waited")
    waiting = {s.labels["priority"]: s.value for family in REGISTRY.collect() for s in family.samples
               if s.name == "llmgw_queue_waiting_requests" and s.labels["model"] == "never-waited"}
    assert waiting == {"interactive": 0, "standard": 0, "batch": 0}


def test_a_models_resumes_are_counted_by_reason_with_every_reason_at_0_from_its_first_request():
    model = metrics.of("resumed-model")
    model.resumes("silent").inc()
    model.resumed_prompt.inc(957)
    counted = {s.labels["reason"]: s.value for family in REGISTRY.collect() for s in family.samples
               if s.name == "llmgw_resumes_total" and s.labels["model"] == "resumed-model"}
    assert counted == {"closed": 0, "silent": 1, "lost": 0, "error": 0}
    assert REGISTRY.get_sample_value("llmgw_resumed_prompt_tokens_total", {"model": "resumed-model"}) == 957
    with pytest.raises(KeyError):  # a reason of its own would be a series of its own
        model.resumes("gone")


def test_the_replicas_by_state_are_one_series_per_model_and_state():
    body = metrics.exposition({"a": {"ready": 2, "failed": 0}, "b": {"ready": 0, "failed": 1}}).decode()
    (family,) = [f for f in text_string_to_metric_families(body) if f.name == "llmgw_replicas"]
    assert family.type == "gauge"
    assert {(s.labels["model"], s.labels["state"]): s.value for s in family.samples} == {
        ("a", "ready"): 2, ("a", "failed"): 0, ("b", "ready"): 0, ("b", "failed"): 1}
    assert all(set(s.labels) <= BOUNDED for s in family.samples)
    assert "llmgw_requests_total" in body  # this process's series come first, as before


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_metrics_count_the_fleets_replicas_by_state_at_each_scrape(settings):
    """Read from the database when scraped: every model, every state (0: none), as `ctl replicas` lists them."""
    settings.LLMGW_METRICS_TOKEN = "scrape-me"
    await sync_to_async(a_fleet)()
    assert (await Client().get("/metrics")).status_code == 401
    assert (await Client(Authorization="Bearer wrong").get("/metrics")).status_code == 401
    answered = await Client(Authorization="Bearer scrape-me").get("/metrics")
    assert answered.status_code == 200
    (family,) = [f for f in text_string_to_metric_families(answered.content.decode()) if f.name == "llmgw_replicas"]
    counted = {(s.labels["model"], s.labels["state"]): s.value for s in family.samples}
    assert len(counted) == 2 * len(S.values)
    assert {k: n for k, n in counted.items() if n} == {
        ("chat", "ready"): 2, ("chat", "draining"): 1, ("chat", "failed"): 1, ("idle", "pending"): 1}
    await sync_to_async(Replica.objects.filter(state=S.DRAINING).update)(state=S.STOPPED)
    answered = await Client(Authorization="Bearer scrape-me").get("/metrics")
    (family,) = [f for f in text_string_to_metric_families(answered.content.decode()) if f.name == "llmgw_replicas"]
    assert {(s.labels["model"], s.labels["state"]): s.value for s in family.samples}[("chat", "draining")] == 0


def a_fleet() -> None:
    seed_defaults()  # a transactional test before this one flushed the migrations' profile and engines
    node, chat, idle = make_node("n1"), make_model("chat"), make_model("idle")
    for state in (S.READY, S.READY, S.DRAINING, S.FAILED, S.STOPPED):
        make_replica(chat, node, state)
    long_ago = make_replica(chat, node, S.FAILED)  # over: no longer listed
    Replica.objects.filter(pk=long_ago.pk).update(state_changed_at=timezone.now() - timedelta(hours=1))
    make_replica(idle, None, S.PENDING)


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_metrics_go_out_with_the_database_away(settings, tmp_path, caplog):
    """A failover: the process's own series still go out, without the replicas it cannot count."""
    settings.LLMGW_METRICS_TOKEN = "scrape-me"
    database = connections.settings["default"]
    name = database["NAME"]
    await sync_to_async(connections.close_all)()
    database["NAME"] = str(tmp_path / "gone" / "db.sqlite3")  # a directory that is not there: no connection
    try:
        answered = await Client(Authorization="Bearer scrape-me").get("/metrics")
    finally:
        await sync_to_async(connections.close_all)()
        database["NAME"] = name
    assert answered.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(answered.content.decode())}
    assert "llmgw_requests" in families and not families["llmgw_replicas"].samples
    assert "no replicas by state, the database is away" in caplog.text
