"""The REST API for profiles and engines: add, edit, remove; refusals change nothing."""


import pytest

from cluster.models import Event, Profile
from tests.factories import row_counts
from tests.rest import API, refused

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
    "body, status, words",
    [
        ({"name": "default"}, 409, ["already exists"]),
        ({"name": "Long"}, 400, ["use lower-case letters"]),
        ({"name": "p", "context_size": 0}, 400, ["context_size"]),
        ({"name": "p", "context_size": "big"}, 400, ["context_size", "must be a whole number"]),
        ({"name": "p", "context_size": 2**31}, 400, ["context_size", "less than or equal"]),
        ({"name": "p", "gpu_layers": -2}, 400, ["gpu_layers"]),
        ({"name": "p", "extra_args": "--flash-attn"}, 400, ["extra_args"]),
        ({"name": "p", "extra_args": [{"a": 1}]}, 400, ["extra_args"]),
        ({"name": "p", "parallel": None}, 400, ["parallel", "null"]),
        ({"context_size": 8192}, 400, ["name", "required"]),
    ],
)
def test_profile_create_refusals(db, operator, body, status, words):
    before = row_counts()
    refused(operator.post(f"{API}/profiles/", body, format="json"), status, *words)
    assert row_counts() == before


def test_profile_edit_and_remove_refusals(cluster, operator):
    before = row_counts()
    refused(operator.patch(f"{API}/profiles/default/", {"threads": 0}, format="json"), 400, "threads")
    refused(operator.patch(f"{API}/profiles/nope/", {"threads": 2}, format="json"), 404, "no profile named 'nope'")
    refused(operator.delete(f"{API}/profiles/default/"), 409, "the default profile cannot be removed")
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
    "body, status, words",
    [
        ({"name": "o", "kind": "ollama"}, 400, ["kind", "not a valid choice"]),
        ({"name": "c", "kind": "command"}, 422, ["needs --command"]),
        ({"name": "c", "kind": "command", "command": "serve --port {prot}"}, 422, ["unknown placeholder {prot}"]),
        ({"name": "c", "kind": "command", "command": "serve 'unclosed"}, 422, ["cannot be split"]),
        ({"name": "v", "kind": "vllm", "device": "tpu"}, 400, ["device"]),
        ({"name": "vllm", "kind": "vllm"}, 409, ["already exists"]),
        ({"name": "VLLM", "kind": "vllm"}, 400, ["use lower-case letters"]),
        ({"name": "c", "kind": "command", "command": "x {port}", "serves": ["chats"]}, 400, ["serves", "chats"]),
        ({"name": "c", "kind": "command", "command": "x {port}", "serves": "chat"}, 400, ["serves", "list"]),
        ({"name": "v", "kind": "vllm", "serves": ["rerank"]}, 422, ["only a command engine declares"]),
    ],
)
def test_engine_create_refusals(db, operator, body, status, words):
    before = row_counts()
    refused(operator.post(f"{API}/engines/", body, format="json"), status, *words)
    assert row_counts() == before


def test_what_a_command_engine_serves_is_declared_and_changed(db, operator):
    body = {"name": "ranker", "kind": "command", "command": "{python} r.py --port {port}", "serves": ["rerank"]}
    created = operator.post(f"{API}/engines/", body, format="json")
    assert created.status_code == 201 and created.json()["serves"] == ["rerank"], created.content
    assert operator.get(f"{API}/engines/vllm/").json()["serves"] == []  # read from its models' profiles

    changed = operator.patch(f"{API}/engines/ranker/", {"serves": ["responses", "chat"]}, format="json")
    assert changed.status_code == 200 and changed.json()["serves"] == ["chat", "responses"], changed.content
    assert Event.objects.filter(kind="engine.edited", subject="ranker").count() == 1

    before = row_counts()
    refused(operator.patch(f"{API}/engines/ranker/", {"serves": ["telepathy"]}, format="json"), 400, "serves")
    refused(operator.patch(f"{API}/engines/ranker/", {"kind": "vllm"}, format="json"), 400, "kind")
    refused(operator.patch(f"{API}/engines/vllm/", {"serves": ["chat"]}, format="json"), 422, "only a command engine")
    refused(operator.patch(f"{API}/engines/nope/", {"serves": ["chat"]}, format="json"), 404, "no engine named")
    assert row_counts() == before
    assert operator.get(f"{API}/engines/ranker/").json()["serves"] == ["chat", "responses"]


def test_engines_cannot_be_removed_over_the_api(db, operator):
    assert operator.delete(f"{API}/engines/vllm/").status_code == 405
