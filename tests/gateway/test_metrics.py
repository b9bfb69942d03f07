"""The gateway's Prometheus metrics: every label takes a bounded set of values (the models llmgw serves and one
`unknown`, a status code, a kind of token), so the series do not grow with what changes all the time (replica
names: each replica ever started would be a series of its own, for ever)."""

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from gateway import metrics
from gateway.call import Call

BOUNDED = {"model", "status", "kind", "priority", "reason"}  # priority: 3 classes; reason: 4 refusals


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
