"""The REST API for models: add, list with replica counts, edit, remove; refusals change nothing."""

import pytest

from cluster.models import Event, Model, Replica
from tests.factories import make_model, make_replica, put_waiting, row_counts
from tests.rest import API, refused

# Models


def test_add_model_with_defaults(cluster, operator):
    model_file = cluster["model"].file
    body = {"name": "qwen-small", "file": model_file.sha256[:10], "engine": "llama.cpp"}
    response = operator.post(f"{API}/models/", body, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    assert shown["file"] == {"sha256": model_file.sha256, "name": "qwen.gguf"}
    assert (shown["engine"], shown["profile"], shown["replicas"], shown["nodes"]) == ("llama.cpp", "default", 1, [])
    assert shown["memory_estimated"] is True
    assert shown["memory_bytes"] == Model.objects.get(name="qwen-small").memory_estimate()
    assert (shown["wait_seconds"], shown["removing"], shown["placement_note"]) == (30, False, "")
    assert shown["counting"] == 0 and shown["replica_states"]["ready"] == 0
    assert Event.objects.get(kind="model.added").subject == "qwen-small"


def test_add_model_with_everything(cluster, operator):
    body = {
        "name": "qwen-gpu",
        "file": "qwen.gguf",
        "engine": "llama.cpp-gpu",
        "profile": "spare",
        "replicas": 3,
        "memory_bytes": 4 * 1024**3,
        "nodes": ["gpu-1"],
        "wait_seconds": 5,
    }
    shown = operator.post(f"{API}/models/", body, format="json").json()
    assert (shown["engine"], shown["profile"], shown["replicas"]) == ("llama.cpp-gpu", "spare", 3)
    assert (shown["memory_bytes"], shown["memory_estimated"]) == (4 * 1024**3, False)
    assert (shown["nodes"], shown["wait_seconds"]) == (["gpu-1"], 5)


def test_add_model_imports_a_server_path(cluster, operator, gguf_file):
    body = {"name": "tiny", "file": str(gguf_file), "engine": "xllamacpp"}
    response = operator.post(f"{API}/models/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["file"]["name"] == "tiny.gguf"


def test_import_outside_the_import_dirs_is_refused_and_changes_nothing(cluster, operator, settings, tmp_path):
    settings.LLMGW_IMPORT_DIRS = [str(tmp_path / "imports")]
    before = row_counts()
    for response in (
        operator.post(f"{API}/model-files/", {"path": "/etc/passwd"}, format="json"),
        operator.post(f"{API}/models/", {"name": "x", "file": "/etc/passwd", "engine": "xllamacpp"}, format="json"),
    ):
        assert response.status_code == 422
        assert "import directories" in response.json()["detail"]
    assert row_counts() == before


@pytest.mark.parametrize(
    "changes, status, words",
    [
        ({"engine": "nope"}, 422, ["no engine named 'nope'"]),
        ({"profile": "nope"}, 422, ["no profile named 'nope'"]),
        ({"file": "nope.gguf"}, 422, ["no model file 'nope.gguf'"]),
        ({"file": "/no/such/file.gguf"}, 422, ["import directories"]),
        ({"name": "qwen2.5-7b"}, 409, ["already exists"]),
        ({"name": "Qwen 7B"}, 400, ["use lower-case letters"]),
        ({"name": "new\n"}, 400, ["use lower-case letters"]),  # no trailing newline slips past the pattern
        ({"name": 7}, 400, ["name", "must be a string"]),
        ({"replicas": -1}, 400, ["replicas", "greater than or equal to 0"]),
        ({"replicas": "three"}, 400, ["replicas", "must be a whole number"]),
        ({"replicas": "3"}, 400, ["replicas", "must be a whole number"]),  # JSON types are kept: no "3" for 3
        ({"replicas": 2.5}, 400, ["replicas", "must be a whole number"]),
        ({"replicas": True}, 400, ["replicas", "must be a whole number"]),
        ({"replicas": 2**40}, 400, ["replicas", "less than or equal"]),
        ({"memory_bytes": -1}, 400, ["memory_bytes"]),
        ({"nodes": "gpu-1"}, 400, ["nodes", "list"]),
        ({"nodes": [1, ["x"]]}, 400, ["nodes"]),
        ({"wait_seconds": -3}, 400, ["wait_seconds"]),
        ({"file": None}, 400, ["file", "null"]),
        ({"engine": ""}, 400, ["engine", "blank"]),
        ({"colour": "red"}, 400, ["colour", "unknown field"]),
        ({"routing": "fastest"}, 400, ["routing", "not a valid choice"]),
        ({"routing": None}, 400, ["routing", "null"]),
    ],
)
def test_add_model_refusals_change_nothing(cluster, operator, changes, status, words):
    """400: the body is not what the schema says; 409: it clashes with what exists; 422: well formed, but it
    names what is not there or asks what cannot be done."""
    body = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    before = row_counts()
    refused(operator.post(f"{API}/models/", body, format="json"), status, *words)
    assert row_counts() == before


def test_non_gguf_file_with_a_gguf_engine_is_refused(cluster, operator, text_file):
    response = operator.post(f"{API}/model-files/", {"path": str(text_file)}, format="json")
    assert response.status_code == 201 and response.json()["format"] == "other"
    before = row_counts()
    body = {"name": "notes", "file": "notes.txt", "engine": "xllamacpp"}
    refused(operator.post(f"{API}/models/", body, format="json"), 422, "is not GGUF", "xllamacpp")
    body = {"engine": "xllamacpp", "file": "notes.txt"}
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", body, format="json"), 422, "is not GGUF")
    assert row_counts() == before
    assert Model.objects.get(name="qwen2.5-7b").engine.name == "llama.cpp"


def test_model_list_and_retrieve_with_replica_counts(cluster, viewer):
    model, node = cluster["model"], cluster["node"]
    make_replica(model, node, state=Replica.State.STARTING)
    make_replica(model, node, state=Replica.State.READY, restart=Replica.Restart.REPLACING)
    make_replica(model, node, state=Replica.State.FAILED)
    body = viewer.get(f"{API}/models/").json()
    assert body["count"] == 1
    shown = body["results"][0]
    assert shown["name"] == "qwen2.5-7b"
    assert shown["replica_states"] == {
        "pending": 0,
        "downloading": 0,
        "starting": 1,
        "ready": 2,
        "draining": 0,
        "stopping": 0,
        "stopped": 0,
        "failed": 1,
    }
    assert shown["counting"] == 2  # the ready one being replaced no longer counts
    assert viewer.get(f"{API}/models/qwen2.5-7b/").json() == shown
    refused(viewer.get(f"{API}/models/qwen2/"), 404, "no model named 'qwen2'")


@pytest.mark.parametrize("method", ["patch", "put"])
def test_edit_model(cluster, operator, method):
    response = getattr(operator, method)(
        f"{API}/models/qwen2.5-7b/", {"replicas": 2, "memory_bytes": 1024**3, "profile": "spare"}, format="json"
    )
    assert response.status_code == 200, response.content
    shown = response.json()
    assert (shown["replicas"], shown["memory_bytes"], shown["profile"]) == (2, 1024**3, "spare")
    assert shown["replica_states"]["ready"] == 1
    event = Event.objects.get(kind="model.edited")
    assert event.subject == "qwen2.5-7b" and event.actor.startswith("user:operator-")
    shown = operator.patch(f"{API}/models/qwen2.5-7b/", {"memory_bytes": None}, format="json").json()
    assert shown["memory_estimated"] is True


def test_edit_model_refusals(cluster, operator):
    before = row_counts()
    refused(operator.patch(f"{API}/models/nope/", {"replicas": 2}, format="json"), 404, "no model named 'nope'")
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"replicas": -2}, format="json"), 400, "replicas")
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"engine": "nope"}, format="json"), 422, "no engine")
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"name": "renamed"}, format="json"), 400, "unknown field")
    assert row_counts() == before


def test_remove_model_is_accepted_and_shows_removing(cluster, operator):
    response = operator.delete(f"{API}/models/qwen2.5-7b/")
    assert response.status_code == 202
    assert response.json()["removing"] is True and response.json()["replica_states"]["ready"] == 1
    assert Model.objects.get().removing
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"replicas": 3}, format="json"), 409, "being removed")
    body = {"name": "qwen2.5-7b", "file": "qwen.gguf", "engine": "llama.cpp"}
    refused(operator.post(f"{API}/models/", body, format="json"), 409, "being removed")
    assert row_counts() == before
    refused(operator.delete(f"{API}/models/nope/"), 404, "no model named 'nope'")


def test_routing_is_prefix_for_new_models_and_changes_over_patch(cluster, operator):
    body = {"name": "routed", "file": "qwen.gguf", "engine": "llama.cpp"}
    response = operator.post(f"{API}/models/", body, format="json")
    assert response.status_code == 201 and response.json()["routing"] == "prefix"
    response = operator.patch(f"{API}/models/routed/", {"routing": "least-inflight"}, format="json")
    assert response.status_code == 200 and response.json()["routing"] == "least-inflight"
    assert Model.objects.get(name="routed").routing == "least-inflight"
    assert "routing=least-inflight" in Event.objects.filter(kind="model.edited").latest("id").message
    refused(operator.patch(f"{API}/models/routed/", {"routing": "sticky"}, format="json"), 400, "routing")


# Autoscaled and on demand


def test_an_autoscaled_model_through_the_api(cluster, operator):
    body = {"name": "lazy", "file": "qwen.gguf", "engine": "llama.cpp", "min_replicas": 0, "max_replicas": 2,
            "target_inflight": 2, "idle_after_seconds": 600, "scale_down_delay_seconds": 120}
    response = operator.post(f"{API}/models/", body, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    assert (shown["min_replicas"], shown["max_replicas"], shown["target_inflight"]) == (0, 2, 2)
    assert shown["scaling"]["mode"] == "on-demand" and shown["scaling"]["wanted"] == 0
    assert shown["scaling"]["idle_after_seconds"] == 600 and shown["scaling"]["idle_at"] is None
    changed = operator.patch(f"{API}/models/lazy/", {"replicas": 2}, format="json").json()
    assert changed["scaling"] == {**changed["scaling"], "mode": "fixed", "wanted": 2, "min_replicas": None}


@pytest.mark.parametrize("changes, status, words", [
    ({"replicas": 1, "min_replicas": 0, "max_replicas": 2}, 422, ["either a fixed number"]),
    ({"min_replicas": 2, "max_replicas": 1}, 422, ["is above max replicas"]),
    ({"min_replicas": -1, "max_replicas": 1}, 400, ["min_replicas"]),
    ({"max_replicas": 2}, 422, ["give both min and max"]),
    ({"target_inflight": 0, "min_replicas": 0, "max_replicas": 1}, 400, ["target_inflight"]),
])
def test_bad_scaling_is_refused_and_changes_nothing(cluster, operator, changes, status, words):
    body = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    before = row_counts()
    refused(operator.post(f"{API}/models/", body, format="json"), status, *words)
    assert row_counts() == before


# Admission queue


@pytest.fixture
def queued_tickets():
    """Put waiting requests in a model's admission queue in Redis (tests.factories.put_waiting); gone after."""
    from cluster.locks import redis_client

    used = []
    yield lambda model, *waited, **kw: used.append(put_waiting(redis_client(), model, *waited, **kw))
    for keys in used:
        redis_client().delete(*keys)


def test_queue_bounds_default_to_the_cluster_and_change_over_the_api(cluster, operator):
    shown = operator.get(f"{API}/models/qwen2.5-7b/").json()
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (None, None)
    assert shown["queue"] == {"waiting": 0, "longest_wait_seconds": None, "queue_limit": 512, "max_wait_seconds": 120}
    body = {"queue_limit": 10, "max_wait_seconds": 30}
    shown = operator.patch(f"{API}/models/qwen2.5-7b/", body, format="json").json()
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (10, 30)
    assert (shown["queue"]["queue_limit"], shown["queue"]["max_wait_seconds"]) == (10, 30)
    assert "queue_limit=10" in Event.objects.get(kind="model.edited").message
    shown = operator.patch(f"{API}/models/qwen2.5-7b/", {"queue_limit": None}, format="json").json()
    assert (shown["queue_limit"], shown["queue"]["queue_limit"], shown["max_wait_seconds"]) == (None, 512, 30)
    body = {"name": "bounded", "file": "qwen.gguf", "engine": "llama.cpp", "queue_limit": 5, "max_wait_seconds": 60}
    shown = operator.post(f"{API}/models/", body, format="json").json()
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (5, 60)


@pytest.mark.parametrize("changes, words", [
    ({"queue_limit": 0}, ["queue_limit", "greater than or equal to 1"]),
    ({"queue_limit": 100_001}, ["queue_limit", "less than or equal to 100000"]),
    ({"max_wait_seconds": 0}, ["max_wait_seconds", "greater than or equal to 1"]),
    ({"max_wait_seconds": 3601}, ["max_wait_seconds", "less than or equal to 3600"]),
    ({"queue_limit": "10"}, ["queue_limit", "must be a whole number"]),
])
def test_bad_queue_bounds_are_refused_and_change_nothing(cluster, operator, changes, words):
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", changes, format="json"), 400, *words)
    body = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    refused(operator.post(f"{API}/models/", body, format="json"), 400, *words)
    assert row_counts() == before
    assert Model.objects.get(name="qwen2.5-7b").queue_limit is None


def test_resuming_defaults_and_changes_over_the_api(cluster, operator):
    shown = operator.get(f"{API}/models/qwen2.5-7b/").json()
    assert (shown["resume_limit"], shown["stream_idle_timeout_seconds"]) == (2, 30)
    body = {"resume_limit": 0, "stream_idle_timeout_seconds": 120}
    shown = operator.patch(f"{API}/models/qwen2.5-7b/", body, format="json").json()
    assert (shown["resume_limit"], shown["stream_idle_timeout_seconds"]) == (0, 120)
    assert "resume_limit=0, stream_idle_timeout_seconds=120" in Event.objects.get(kind="model.edited").message
    body = {"name": "resumed", "file": "qwen.gguf", "engine": "llama.cpp", "resume_limit": 10,
            "stream_idle_timeout_seconds": 1}
    shown = operator.post(f"{API}/models/", body, format="json").json()
    assert (shown["resume_limit"], shown["stream_idle_timeout_seconds"]) == (10, 1)
    body = {"name": "defaults", "file": "qwen.gguf", "engine": "llama.cpp", "resume_limit": None}  # null: default
    shown = operator.post(f"{API}/models/", body, format="json").json()
    assert (shown["resume_limit"], shown["stream_idle_timeout_seconds"]) == (2, 30)


@pytest.mark.parametrize("changes, words", [
    ({"resume_limit": -1}, ["resume_limit", "greater than or equal to 0"]),
    ({"resume_limit": 11}, ["resume_limit", "less than or equal to 10"]),
    ({"resume_limit": "2"}, ["resume_limit", "must be a whole number"]),
    ({"stream_idle_timeout_seconds": 0}, ["stream_idle_timeout_seconds", "greater than or equal to 1"]),
    ({"stream_idle_timeout_seconds": 3601}, ["stream_idle_timeout_seconds", "less than or equal to 3600"]),
    ({"stream_idle_timeout_seconds": "30s"}, ["stream_idle_timeout_seconds", "must be a whole number"]),
])
def test_bad_resuming_is_refused_and_changes_nothing(cluster, operator, changes, words):
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", changes, format="json"), 400, *words)
    body = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    refused(operator.post(f"{API}/models/", body, format="json"), 400, *words)
    assert row_counts() == before
    model = Model.objects.get(name="qwen2.5-7b")
    assert (model.resume_limit, model.stream_idle_timeout_seconds) == (2, 30)


def test_a_models_resuming_is_not_cleared_by_null(cluster, operator):
    """PATCH null is refused (there is no "the cluster's" to fall back to), naming the field."""
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"resume_limit": None}, format="json"), 400, "resume_limit")


def test_queue_shows_the_requests_waiting_for_every_model_of_a_page(cluster, viewer, queued_tickets):
    make_model("other")
    queued_tickets("qwen2.5-7b", 4.2, 1.0, 0.5, lapsed=2)
    page = viewer.get(f"{API}/models/").json()["results"]
    queues = {m["name"]: m["queue"] for m in page}
    assert queues["other"] == {"waiting": 0, "longest_wait_seconds": None, "queue_limit": 512, "max_wait_seconds": 120}
    shown = queues["qwen2.5-7b"]
    assert shown["waiting"] == 3 and 4.2 <= shown["longest_wait_seconds"] < 10
    assert viewer.get(f"{API}/models/qwen2.5-7b/").json()["queue"]["waiting"] == 3


def test_queue_read_once_for_a_page(cluster, viewer, monkeypatch):
    from cluster import queries

    read = []
    real = queries.queues
    monkeypatch.setattr(queries, "queues", lambda names: read.append(list(names)) or real(names))
    make_model("other")
    viewer.get(f"{API}/models/")
    assert read == [["other", "qwen2.5-7b"]]


def test_queue_waiting_is_null_when_redis_cannot_be_read(cluster, viewer, monkeypatch):
    import redis

    class Away:
        def pipeline(self, **kw):
            raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr("cluster.locks.redis_client", lambda: Away())
    response = viewer.get(f"{API}/models/")
    assert response.status_code == 200
    queue = response.json()["results"][0]["queue"]
    assert queue == {"waiting": None, "longest_wait_seconds": None, "queue_limit": 512, "max_wait_seconds": 120}
