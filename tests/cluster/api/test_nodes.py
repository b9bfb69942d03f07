"""The REST API for nodes: add (the token and the agent command), list, show, remove."""

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.models import Event, Node, Replica
from tests.factories import (
    make_node,
    make_replica,
    row_counts,
)
from tests.rest import API, refused

# Nodes


def test_add_node_returns_its_token_and_agent_command(operator):
    response = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json")
    assert response.status_code == 201
    body = response.json()
    token = body["token"]
    assert body["name"] == "gpu-1" and body["connected"] is False and body["replica_count"] == 0
    assert body["agent_command"] == f"LLMGW_AGENT_TOKEN={token} llmgw agent --server http://testserver"
    assert Node.objects.get(name="gpu-1").token_hash == hashlib.sha256(token.encode()).hexdigest()
    event = Event.objects.get(kind="node.added")
    assert event.actor.startswith("user:operator-")


def test_agent_command_uses_the_public_url(operator, settings):
    settings.LLMGW_PUBLIC_URL = "https://llmgw.example.org/"
    body = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json").json()
    assert body["agent_command"].endswith(" llmgw agent --server https://llmgw.example.org")


def test_a_forged_host_never_reaches_an_agent_command(operator, client):
    """Only a Host this server answers to (settings.ALLOWED_HOSTS) is built into what an operator copies to a node;
    any other is a 400 in the API's shape, and nothing is added."""
    refused = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json", HTTP_HOST="attacker.example")
    assert refused.status_code == 400 and refused["Content-Type"] == "application/json"
    assert refused.json() == {"detail": "the Host header attacker.example is not one this server answers to"}
    page = client.get("/login/", HTTP_HOST="attacker.example")
    assert page.status_code == 400 and b"not one this server answers to" in page.content
    assert not Node.objects.exists()
    body = operator.post(f"{API}/nodes/", {"name": "gpu-1"}, format="json", HTTP_HOST="127.0.0.1:8000").json()
    assert body["agent_command"].endswith(" llmgw agent --server http://127.0.0.1:8000")


def test_the_allowed_hosts_are_this_machines_names_and_what_the_operator_adds(monkeypatch):
    import socket

    import psutil

    from llmgw.hostnames import this_machine

    hosts = this_machine("https://LLMGW.example.org:8443/", "fd00::7")
    assert {"localhost", "127.0.0.1", "[::1]", socket.gethostname().lower(), "llmgw.example.org", "[fd00::7]"} <= set(hosts)
    addresses = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    assert addresses <= set(hosts)
    assert "*" not in hosts and "attacker.example" not in hosts


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"name": "gpu-1"}, 409, ["already exists"]),
        ({"name": "GPU 2"}, 400, ["use lower-case letters"]),
        ({"name": ""}, 400, ["name"]),
        ({}, 400, ["name", "required"]),
        ({"name": ["gpu-2"]}, 400, ["name", "must be a string"]),
        ({"name": "gpu-2", "extra": 1}, 400, ["extra", "unknown field"]),
    ],
)
def test_add_node_refusals(cluster, operator, body, status, words):
    before = row_counts()
    refused(operator.post(f"{API}/nodes/", body, format="json"), status, *words)
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
    refused(operator.delete(f"{API}/nodes/gpu-1/"), 409, "still has 1 replica")
    refused(operator.delete(f"{API}/nodes/gpu-1/?force=perhaps"), 400, "force", "true or false")
    assert row_counts() == before
    assert operator.delete(f"{API}/nodes/gpu-1/?force=true").status_code == 204
    assert not Node.objects.exists()
    assert Replica.objects.get().state == Replica.State.FAILED
    refused(operator.delete(f"{API}/nodes/gpu-1/"), 404, "no node named 'gpu-1'")


def test_nodes_cannot_be_edited_over_put(cluster, operator):
    assert operator.put(f"{API}/nodes/gpu-1/", {"name": "x"}, format="json").status_code == 405
