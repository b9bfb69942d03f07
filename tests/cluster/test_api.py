"""The REST API's own part: parsing, status codes, fields, who may do what. The operations have their own tests."""

import hashlib
import struct
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from cluster import operations
from cluster.api import exception_handler
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from tests.factories import client_for, make_file, make_model, make_node, make_replica, make_user, row_counts

API = "/api/v1"
EMPTY_GGUF = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)  # a valid GGUF v3 header with no tensors and no metadata


@pytest.fixture(autouse=True)
def _import_dirs(settings, tmp_path):
    """Over the API, imports by path come only from LLMGW_IMPORT_DIRS; the tests' files live in tmp_path."""
    settings.LLMGW_IMPORT_DIRS = [str(tmp_path)]


@pytest.fixture
def cluster(db):
    """A node with a model on it, a spare profile and a GGUF file."""
    node = make_node("gpu-1")
    model = make_model("qwen2.5-7b", file=make_file("qwen.gguf"))
    make_replica(model, node)
    Profile.objects.create(name="spare")
    return {"node": node, "model": model}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"not a model\n")
    return path


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(EMPTY_GGUF)
    return path


def refused(response, status: int, *words: str):
    """The status, and an error body whose text names every word."""
    assert response.status_code == status, response.content
    text = str(response.json())
    for word in words:
        assert word in text, text


# Authentication and roles

LISTS = ["nodes", "models", "replicas", "profiles", "engines", "model-files", "events", "status"]


@pytest.mark.parametrize("resource", LISTS)
def test_anonymous_gets_401_with_a_challenge(db, resource):
    response = APIClient().get(f"{API}/{resource}/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_anonymous_write_gets_401_and_changes_nothing(db):
    before = row_counts()
    assert APIClient().post(f"{API}/nodes/", {"name": "gpu-9"}, format="json").status_code == 401
    assert row_counts() == before


@pytest.mark.parametrize("scheme", ["Bearer", "Token", "bearer"])
def test_token_schemes(db, scheme):
    assert client_for("viewer", scheme=scheme).get(f"{API}/nodes/").status_code == 200


@pytest.mark.parametrize("header", ["Bearer nope", "Bearer a b", "Token nope", "Bearer"])
def test_bad_tokens_get_401(db, header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert client.get(f"{API}/nodes/").status_code == 401


def test_session_login_works(db):
    user, _ = make_user("viewer")
    client = APIClient()
    client.force_login(user)
    assert client.get(f"{API}/models/").status_code == 200


def test_user_without_a_role_may_not_look(db):
    from django.contrib.auth.models import User

    client = APIClient()
    client.force_login(User.objects.create(username="nobody"))
    assert client.get(f"{API}/models/").status_code == 403


WRITES = [
    ("post", "nodes/", {"name": "gpu-9"}),
    ("delete", "nodes/gpu-1/?force=true", None),
    ("post", "models/", {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp"}),
    ("patch", "models/qwen2.5-7b/", {"replicas": 2}),
    ("put", "models/qwen2.5-7b/", {"replicas": 2}),
    ("delete", "models/qwen2.5-7b/", None),
    ("post", "profiles/", {"name": "long"}),
    ("patch", "profiles/default/", {"context_size": 8192}),
    ("delete", "profiles/spare/", None),
    ("post", "engines/", {"name": "vllm-2", "kind": "vllm"}),
    ("post", "model-files/", {"path": "/etc/hostname"}),
    ("post", "users/", {"name": "eve", "role": "admin"}),
]


@pytest.mark.parametrize("method, path, body", WRITES)
def test_viewer_may_not_write(cluster, viewer, method, path, body):
    before = row_counts()
    response = getattr(viewer, method)(f"{API}/{path}", body, format="json")
    refused(response, 403, "role")
    assert row_counts() == before


@pytest.mark.parametrize("method, path, body", WRITES)
def test_anonymous_may_not_write(cluster, method, path, body):
    before = row_counts()
    assert getattr(APIClient(), method)(f"{API}/{path}", body, format="json").status_code == 401
    assert row_counts() == before


def test_bad_json_is_a_400(operator):
    response = operator.post(f"{API}/nodes/", "{not json", content_type="application/json")
    refused(response, 400, "JSON parse error")


@pytest.mark.parametrize("body", [[], ["gpu-1"], "gpu-1", 5, None])
def test_a_body_that_is_not_an_object_is_a_400(operator, body):
    response = operator.post(f"{API}/nodes/", body, format="json")
    assert response.status_code == 400
    assert not Node.objects.exists()


def test_unknown_field_is_a_400(cluster, operator):
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"replica": 2}, format="json"), 400, "replica", "unknown")
    assert row_counts() == before


# Nodes


def test_add_node_returns_its_token_and_agent_command(operator):
    response = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json")
    assert response.status_code == 201
    body = response.json()
    token = body["token"]
    assert body["name"] == "gpu-1" and body["connected"] is False and body["replica_count"] == 0
    assert body["agent_command"] == f"python manage.py llmgw agent --server http://testserver --token {token}"
    assert Node.objects.get(name="gpu-1").token_hash == hashlib.sha256(token.encode()).hexdigest()
    event = Event.objects.get(kind="node.added")
    assert event.actor.startswith("user:operator-")


def test_agent_command_uses_the_public_url(operator, settings):
    settings.LLMGW_PUBLIC_URL = "https://llmgw.example.org/"
    body = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json").json()
    assert "--server https://llmgw.example.org --token" in body["agent_command"]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"name": "gpu-1"}, ["already exists"]),
        ({"name": "GPU 2"}, ["invalid node name"]),
        ({"name": ""}, ["name"]),
        ({}, ["name", "required"]),
        ({"name": ["gpu-2"]}, ["name", "Not a valid string"]),
    ],
)
def test_add_node_refusals(cluster, operator, body, words):
    before = row_counts()
    refused(operator.post(f"{API}/nodes/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_node_list_and_retrieve(cluster, viewer):
    make_node("gpu-2", alive=False)
    make_node("gpu-3", last_seen=timezone.now() - timedelta(minutes=5))
    make_replica(cluster["model"], cluster["node"], state=Replica.State.STOPPED)
    body = viewer.get(f"{API}/nodes/").json()
    assert body["count"] == 3
    rows = {n["name"]: n for n in body["results"]}
    assert {name: n["connected"] for name, n in rows.items()} == {"gpu-1": True, "gpu-2": False, "gpu-3": False}
    assert rows["gpu-1"]["replica_count"] == 1
    assert set(rows["gpu-1"]) >= {
        "name",
        "address",
        "connected",
        "last_seen",
        "schedulable",
        "draining",
        "memory_bytes",
        "facts",
        "replica_count",
    }
    assert "token_hash" not in rows["gpu-1"] and "token" not in rows["gpu-1"]
    assert viewer.get(f"{API}/nodes/gpu-1/").json()["replica_count"] == 1
    refused(viewer.get(f"{API}/nodes/gpu-9/"), 404, "no node named 'gpu-9'")
    refused(viewer.get(f"{API}/nodes/Not A Node/"), 404, "no node named")


def test_remove_node(cluster, operator):
    before = row_counts()
    refused(operator.delete(f"{API}/nodes/gpu-1/"), 400, "still has 1 replica")
    refused(operator.delete(f"{API}/nodes/gpu-1/?force=perhaps"), 400, "force", "true or false")
    assert row_counts() == before
    assert operator.delete(f"{API}/nodes/gpu-1/?force=true").status_code == 204
    assert not Node.objects.exists()
    assert Replica.objects.get().state == Replica.State.FAILED
    refused(operator.delete(f"{API}/nodes/gpu-1/"), 404, "no node named 'gpu-1'")


def test_nodes_cannot_be_edited_over_put(cluster, operator):
    assert operator.put(f"{API}/nodes/gpu-1/", {"name": "x"}, format="json").status_code == 405


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
        assert response.status_code == 400
        assert "import directories" in response.json()["detail"]
    assert row_counts() == before


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"engine": "nope"}, ["no engine named 'nope'"]),
        ({"profile": "nope"}, ["no profile named 'nope'"]),
        ({"file": "nope.gguf"}, ["no model file 'nope.gguf'"]),
        ({"file": "/no/such/file.gguf"}, ["import directories"]),
        ({"name": "qwen2.5-7b"}, ["already exists"]),
        ({"name": "Qwen 7B"}, ["invalid model name"]),
        ({"replicas": -1}, ["replicas", "greater than or equal to 0"]),
        ({"replicas": "three"}, ["replicas", "valid integer"]),
        ({"replicas": 2.5}, ["replicas", "valid integer"]),
        ({"replicas": True}, ["replicas", "valid integer"]),
        ({"replicas": 2**40}, ["replicas", "less than or equal"]),
        ({"memory_bytes": -1}, ["memory_bytes"]),
        ({"nodes": "gpu-1"}, ["nodes", "list"]),
        ({"nodes": [1, ["x"]]}, ["nodes"]),
        ({"wait_seconds": -3}, ["wait_seconds"]),
        ({"file": None}, ["file", "null"]),
        ({"engine": ""}, ["engine", "blank"]),
        ({"colour": "red"}, ["colour", "unknown field"]),
    ],
)
def test_add_model_refusals_change_nothing(cluster, operator, changes, words):
    body = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    before = row_counts()
    refused(operator.post(f"{API}/models/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_non_gguf_file_with_a_gguf_engine_is_refused(cluster, operator, text_file):
    response = operator.post(f"{API}/model-files/", {"path": str(text_file)}, format="json")
    assert response.status_code == 201 and response.json()["format"] == "other"
    before = row_counts()
    body = {"name": "notes", "file": "notes.txt", "engine": "xllamacpp"}
    refused(operator.post(f"{API}/models/", body, format="json"), 400, "is not GGUF", "xllamacpp")
    body = {"engine": "xllamacpp", "file": "notes.txt"}
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", body, format="json"), 400, "is not GGUF")
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
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"engine": "nope"}, format="json"), 400, "no engine")
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"name": "renamed"}, format="json"), 400, "unknown field")
    assert row_counts() == before


def test_remove_model_is_accepted_and_shows_removing(cluster, operator):
    response = operator.delete(f"{API}/models/qwen2.5-7b/")
    assert response.status_code == 202
    assert response.json()["removing"] is True and response.json()["replica_states"]["ready"] == 1
    assert Model.objects.get().removing
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"replicas": 3}, format="json"), 400, "being removed")
    body = {"name": "qwen2.5-7b", "file": "qwen.gguf", "engine": "llama.cpp"}
    refused(operator.post(f"{API}/models/", body, format="json"), 400, "being removed")
    assert row_counts() == before
    refused(operator.delete(f"{API}/models/nope/"), 404, "no model named 'nope'")


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
    "query, words",
    [
        ("model=nope", ["model", "no model named 'nope'"]),
        ("node=nope", ["node", "no node named 'nope'"]),
        ("state=running", ["state", "unknown state 'running'", "ready"]),
    ],
)
def test_replica_filter_refusals(cluster, viewer, query, words):
    refused(viewer.get(f"{API}/replicas/?{query}"), 400, *words)


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
    with django_assert_max_num_queries(4):
        assert viewer.get(f"{API}/models/").json()["count"] == 5
    with django_assert_max_num_queries(4):
        assert viewer.get(f"{API}/nodes/").json()["count"] == 4


# Profiles


def test_profile_create_edit_remove(db, operator):
    body = {"name": "long", "context_size": 32768, "threads": 8, "gpu_layers": -1, "extra_args": ["--flash-attn"]}
    response = operator.post(f"{API}/profiles/", body, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    assert {k: shown[k] for k in body} == body
    assert (shown["parallel"], shown["batch_size"]) == (1, None)

    response = operator.patch(f"{API}/profiles/long/", {"threads": None, "parallel": 4}, format="json")
    assert response.status_code == 200
    assert (response.json()["threads"], response.json()["parallel"], response.json()["context_size"]) == (
        None,
        4,
        32768,
    )
    assert Event.objects.filter(kind="profile.edited", subject="long").count() == 1

    assert operator.delete(f"{API}/profiles/long/").status_code == 204
    assert not Profile.objects.filter(name="long").exists()
    assert operator.get(f"{API}/profiles/default/").json()["context_size"] == 4096


@pytest.mark.parametrize(
    "body, words",
    [
        ({"name": "default"}, ["already exists"]),
        ({"name": "Long"}, ["invalid profile name"]),
        ({"name": "p", "context_size": 0}, ["context_size"]),
        ({"name": "p", "context_size": "big"}, ["context_size", "valid integer"]),
        ({"name": "p", "gpu_layers": -2}, ["gpu_layers"]),
        ({"name": "p", "extra_args": "--flash-attn"}, ["extra_args"]),
        ({"name": "p", "extra_args": [{"a": 1}]}, ["extra_args"]),
        ({"name": "p", "parallel": None}, ["parallel", "null"]),
        ({"context_size": 8192}, ["name", "required"]),
    ],
)
def test_profile_create_refusals(db, operator, body, words):
    before = row_counts()
    refused(operator.post(f"{API}/profiles/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_profile_edit_and_remove_refusals(cluster, operator):
    before = row_counts()
    refused(operator.patch(f"{API}/profiles/default/", {"threads": 0}, format="json"), 400, "threads")
    refused(operator.patch(f"{API}/profiles/nope/", {"threads": 2}, format="json"), 404, "no profile named 'nope'")
    refused(operator.delete(f"{API}/profiles/default/"), 400, "the default profile cannot be removed")
    refused(operator.delete(f"{API}/profiles/nope/"), 404, "no profile named 'nope'")
    assert row_counts() == before


# Engines


def test_engine_list_retrieve_create(db, operator):
    names = [e["name"] for e in operator.get(f"{API}/engines/").json()["results"]]
    assert names == ["llama.cpp", "llama.cpp-gpu", "vllm", "xllamacpp"]
    assert operator.get(f"{API}/engines/llama.cpp-gpu/").json()["device"] == "gpu"
    body = {"name": "echo", "kind": "command", "command": "{python} server.py --port {port} --model {model_path}"}
    response = operator.post(f"{API}/engines/", body, format="json")
    assert response.status_code == 201, response.content
    assert {k: response.json()[k] for k in ("name", "kind", "device", "version")} == {
        "name": "echo",
        "kind": "command",
        "device": "cpu",
        "version": "",
    }
    assert Event.objects.filter(kind="engine.added", subject="echo").count() == 1


@pytest.mark.parametrize(
    "body, words",
    [
        ({"name": "o", "kind": "ollama"}, ["kind", "not a valid choice"]),
        ({"name": "c", "kind": "command"}, ["needs --command"]),
        ({"name": "c", "kind": "command", "command": "serve --port {prot}"}, ["unknown placeholder {prot}"]),
        ({"name": "c", "kind": "command", "command": "serve 'unclosed"}, ["cannot be split"]),
        ({"name": "v", "kind": "vllm", "device": "tpu"}, ["device"]),
        ({"name": "vllm", "kind": "vllm"}, ["already exists"]),
        ({"name": "VLLM", "kind": "vllm"}, ["invalid engine name"]),
    ],
)
def test_engine_create_refusals(db, operator, body, words):
    before = row_counts()
    refused(operator.post(f"{API}/engines/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_engines_cannot_be_removed_over_the_api(db, operator):
    assert operator.delete(f"{API}/engines/vllm/").status_code == 405


# Model files


def test_import_model_file_then_again(db, operator, gguf_file):
    response = operator.post(f"{API}/model-files/", {"path": str(gguf_file), "name": "tiny"}, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    sha = hashlib.sha256(EMPTY_GGUF).hexdigest()
    assert (shown["sha256"], shown["name"], shown["size"], shown["format"]) == (sha, "tiny", len(EMPTY_GGUF), "gguf")
    before = row_counts()
    again = operator.post(f"{API}/model-files/", {"path": str(gguf_file)}, format="json")
    assert again.status_code == 200 and again.json() == shown
    assert row_counts() == before
    assert operator.get(f"{API}/model-files/{sha}/").json() == shown
    assert operator.get(f"{API}/model-files/").json()["results"] == [shown]
    refused(operator.get(f"{API}/model-files/{'0' * 64}/"), 404, "no model file with sha256")


def test_upload_a_model_file_as_multipart(db, operator):
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("tiny.gguf", EMPTY_GGUF)
    response = operator.post(f"{API}/model-files/", {"file": upload}, format="multipart")
    assert response.status_code == 201, response.content
    shown = response.json()
    assert (shown["name"], shown["size"], shown["format"]) == ("tiny.gguf", len(EMPTY_GGUF), "gguf")
    assert shown["sha256"] == hashlib.sha256(EMPTY_GGUF).hexdigest()
    before = row_counts()
    both = {"file": SimpleUploadedFile("x.gguf", EMPTY_GGUF), "path": "/tmp/x"}
    refused(operator.post(f"{API}/model-files/", both, format="multipart"), 400, "either path")
    refused(operator.post(f"{API}/model-files/", {}, format="json"), 400, "either path")
    assert row_counts() == before


def test_import_garbage_that_says_gguf_is_a_clear_400(db, operator, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x07\x00\x00\x00" + b"garbage" * 50)
    before = row_counts()
    refused(operator.post(f"{API}/model-files/", {"path": str(path)}, format="json"), 400, "cannot be read")
    assert row_counts() == before


@pytest.mark.parametrize(
    "body, words",
    [
        ({"path": "/no/such/model.gguf"}, ["import directories"]),
        ({"path": "/"}, ["import directories"]),
        ({"path": "IMPORTS/missing.gguf"}, ["no such file"]),
        ({"path": "IMPORTS"}, ["not a regular file"]),
        ({"path": ""}, ["path", "blank"]),
        ({}, ["either path", "or file"]),
        ({"path": "/etc/hostname\x00x"}, ["path", "Null characters"]),
    ],
)
def test_import_refusals(db, operator, body, words, tmp_path):
    if "path" in body:
        body = {"path": body["path"].replace("IMPORTS", str(tmp_path))}
    before = row_counts()
    refused(operator.post(f"{API}/model-files/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_unreadable_file_is_a_400(db, operator, tmp_path, monkeypatch):
    path = tmp_path / "secret.gguf"
    path.write_bytes(EMPTY_GGUF)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("cluster.mirror.is_gguf", denied)
    refused(operator.post(f"{API}/model-files/", {"path": str(path)}, format="json"), 400, "Permission denied")
    assert not ModelFile.objects.exists()


# Events


def test_events_newest_first_and_filters(cluster, operator):
    Event.objects.all().delete()  # the fixtures' own
    old = Event.objects.create(
        kind="node.added", actor="system", subject="gpu-0", message="old", created_at=timezone.now() - timedelta(days=2)
    )
    operator.post(f"{API}/profiles/", {"name": "long"}, format="json")
    operator.patch(f"{API}/profiles/long/", {"threads": 4}, format="json")
    events = operator.get(f"{API}/events/").json()["results"]
    assert [e["kind"] for e in events] == ["profile.edited", "profile.added", "node.added"]
    assert set(events[0]) == {"id", "created_at", "kind", "actor", "subject", "message", "data"}

    def kinds(query):
        return [e["kind"] for e in operator.get(f"{API}/events/?{query}").json()["results"]]

    assert kinds("kind=profile.added") == ["profile.added"]
    assert kinds("subject=gpu-0") == ["node.added"]
    assert kinds("actor=system") == ["node.added"]
    since = (old.created_at + timedelta(hours=1)).isoformat()
    assert kinds("since=" + since.replace("+", "%2B")) == ["profile.edited", "profile.added"]
    assert kinds("since=2000-01-01T00:00:00") == ["profile.edited", "profile.added", "node.added"]
    assert kinds("since=2999-01-01T00:00:00Z") == []


@pytest.mark.parametrize("since", ["yesterday", "2025-13-01T00:00:00", "", "1700000000"])
def test_events_bad_since_is_a_400(db, viewer, since):
    refused(viewer.get(f"{API}/events/?since={since}"), 400, "since", "ISO 8601")


def test_events_are_read_only(db, operator):
    assert operator.post(f"{API}/events/", {"kind": "x"}, format="json").status_code == 405


# Status


def test_status(cluster, viewer):
    body = viewer.get(f"{API}/status/").json()
    assert body == {
        "serving": "serving",
        "nodes": {"total": 1, "connected": 1},
        "models": [{"name": "qwen2.5-7b", "replicas": 1, "ready": 1, "removing": False, "placement_note": ""}],
        "replicas": {"ready": 1},
    }


# Users


def test_admin_adds_a_user_whose_token_works(admin):
    response = admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["name"], body["role"]) == ("carol", "viewer")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['token']}")
    assert client.get(f"{API}/models/").status_code == 200
    refused(client.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json"), 403, "role")


def test_operator_may_not_add_users(operator):
    before = row_counts()
    refused(operator.post(f"{API}/users/", {"name": "mallory", "role": "admin"}, format="json"), 403, "role")
    assert row_counts() == before


@pytest.mark.parametrize(
    "body, words",
    [
        ({"name": "carol", "role": "owner"}, ["role", "not a valid choice"]),
        ({"name": "bob smith", "role": "viewer"}, ["invalid user name"]),
        ({"name": "carol", "role": "viewer", "password": "short"}, ["at least 8 characters"]),
        ({"role": "viewer"}, ["name", "required"]),
    ],
)
def test_add_user_refusals(admin, body, words):
    before = row_counts()
    refused(admin.post(f"{API}/users/", body, format="json"), 400, *words)
    assert row_counts() == before


def test_add_user_twice_is_refused(admin):
    assert admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json").status_code == 201
    before = row_counts()
    refused(admin.post(f"{API}/users/", {"name": "carol", "role": "viewer"}, format="json"), 400, "already exists")
    assert row_counts() == before


@pytest.mark.parametrize(
    "error, status",
    [(operations.NotFound("no model named 'x'"), 404), (operations.OperationError("model x is being removed"), 400)],
)
def test_exception_handler_maps_unwrapped_refusals(error, status):
    response = exception_handler(error, {})
    assert (response.status_code, response.data) == (status, {"detail": str(error)})


def test_api_root_lists_the_resources(viewer):
    body = viewer.get(f"{API}/").json()
    assert set(body) == {
        "nodes",
        "models",
        "replicas",
        "profiles",
        "engines",
        "model-files",
        "events",
        "users",
        "keys",
        "usage",
    }
