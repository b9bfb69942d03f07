"""The REST API for replicas: list with filters, show, read only; a list costs a few queries, not one per row."""


import pytest

from cluster.models import Replica
from tests.factories import make_model, make_node, make_replica
from tests.rest import API, refused

# Replicas


def test_replica_list_filters_and_detail(cluster, viewer):
    model, node = cluster["model"], cluster["node"]
    other = make_model("llama")
    make_replica(other, make_node("gpu-2"), state=Replica.State.DOWNLOADING, download_done=5, download_total=10)
    unplaced = make_replica(other, None, state=Replica.State.PENDING, reason="no node has 8 GiB free")
    make_replica(model, node, state=Replica.State.FAILED, log_tail="boom")

    body = viewer.get(f"{API}/replicas/").json()
    assert body["count"] == 4
    first = body["results"][0]
    assert first["model"] == "llama"
    assert set(first) == {
        "name",
        "model",
        "node",
        "gpu_index",
        "state",
        "restart",
        "stale",
        "canary",
        "port",
        "pid",
        "reason",
        "memory_bytes",
        "snapshot",
        "created_at",
        "state_changed_at",
        "download_done",
        "download_total",
    }

    def names(query):
        return sorted(r["name"] for r in viewer.get(f"{API}/replicas/?{query}").json()["results"])

    assert names("model=qwen2.5-7b") == sorted(r.name for r in model.replica_set.all())
    assert names("node=gpu-2") == [r.name for r in other.replica_set.filter(node__name="gpu-2")]
    assert names("state=pending") == [unplaced.name]
    assert names("model=llama&state=downloading") == [r.name for r in other.replica_set.filter(state="downloading")]

    detail = viewer.get(f"{API}/replicas/{unplaced.name}/").json()
    assert (detail["node"], detail["reason"], detail["log_tail"]) == (None, "no node has 8 GiB free", "")
    failed = model.replica_set.get(state="failed")
    assert viewer.get(f"{API}/replicas/{failed.name}/").json()["log_tail"] == "boom"
    refused(viewer.get(f"{API}/replicas/qwen-00000000/"), 404, "no replica named")


@pytest.mark.parametrize(
    "query, status, words",
    [
        ("model=nope", 422, ["model", "no model named 'nope'"]),
        ("node=nope", 422, ["node", "no node named 'nope'"]),
        ("model=", 400, ["model", "name a model"]),
        ("node=gpu%00", 400, ["node", "NUL character"]),
        ("state=running", 400, ["state", "unknown state 'running'", "ready"]),
    ],
)
def test_replica_filter_refusals(cluster, viewer, query, status, words):
    """400: the query is malformed; 422: well formed, but it names what is not there."""
    refused(viewer.get(f"{API}/replicas/?{query}"), status, *words)


def test_replicas_are_read_only(cluster, operator):
    name = Replica.objects.get().name
    assert operator.post(f"{API}/replicas/", {"name": "x"}, format="json").status_code == 405
    assert operator.delete(f"{API}/replicas/{name}/").status_code == 405
    assert operator.patch(f"{API}/replicas/{name}/", {"state": "ready"}, format="json").status_code == 405


def test_replica_list_query_count_does_not_grow(db, viewer, django_assert_max_num_queries):
    nodes = [make_node(f"gpu-{i}") for i in range(4)]
    for i in range(5):
        model = make_model(f"m{i}")
        for node in nodes:
            make_replica(model, node)
    make_replica(model, None, state=Replica.State.PENDING)
    from cluster.models import ClusterSettings

    ClusterSettings.load()  # its row exists in a running system
    # token, role, cluster settings (for `stale`), count, page
    with django_assert_max_num_queries(5):
        response = viewer.get(f"{API}/replicas/")
    assert response.json()["count"] == 21


def test_model_and_node_lists_query_count_does_not_grow(db, viewer, django_assert_max_num_queries):
    nodes = [make_node(f"gpu-{i}") for i in range(4)]
    for i in range(5):
        model = make_model(f"m{i}")
        for node in nodes:
            make_replica(model, node)
    with django_assert_max_num_queries(5):  # and one for the cluster's queue defaults
        assert viewer.get(f"{API}/models/").json()["count"] == 5
    with django_assert_max_num_queries(5):  # and one for the memory their replicas hold
        assert viewer.get(f"{API}/nodes/").json()["count"] == 4
