"""Model factories as plain functions: rows as the tests need them, written directly (not through operations).

The migrations seed the `default` profile and the engines `xllamacpp`, `llama.cpp`, `llama.cpp-gpu`, `vllm`.
"""

import hashlib
import itertools
import struct

from django.contrib.auth.models import User
from django.utils import timezone

from cluster import operations, peers
from cluster.models import (
    ControlPlane,
    EngineVersion,
    Event,
    FileCopy,
    Model,
    ModelFile,
    Node,
    Profile,
    Replica,
    RevokedControlPlaneToken,
)

_seq = itertools.count(1)
EMPTY_GGUF = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)  # a valid GGUF v3 header with no tensors and no metadata

SMALL_GGUF = {
    "architecture": "llama",
    "block_count": 30,
    "context_length": 8192,
    "embedding_length": 576,
    "head_count": 9,
    "head_count_kv": 3,
}


def make_user(role: str = "operator", name: str | None = None):
    """(user, API token), through the real operation so the role group is set as in production."""
    return operations.add_user(name or f"{role}-{next(_seq)}", role, "test")


def client_for(role: str | None, scheme: str = "Bearer"):
    """A REST API client with a new user's token of `role` (None: anonymous)."""
    from rest_framework.test import APIClient

    client = APIClient()
    if role:
        _, token = make_user(role)
        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
    return client


def session_for(role: str):
    """A Django test client logged in (by session, as a browser is) as a new user of `role`."""
    from django.test import Client

    user, _ = make_user(role)
    client = Client()
    client.force_login(user)
    return client


def make_node(name: str | None = None, alive: bool = True, memory_bytes: int = 16 * 1024**3, **fields) -> Node:
    name = name or f"node-{next(_seq)}"
    fields.setdefault("token_hash", Node.hash_token(f"token-{name}"))
    if alive:
        fields.setdefault("connected", True)
        fields.setdefault("last_seen", timezone.now())
    return Node.objects.create(name=name, memory_bytes=memory_bytes, **fields)


def make_file(name: str | None = None, size: int = 100 * 1024**2, gguf: dict | None = None, **fields) -> ModelFile:
    name = name or f"file-{next(_seq)}.gguf"
    fields.setdefault("sha256", hashlib.sha256(f"{name}-{next(_seq)}".encode()).hexdigest())
    fields.setdefault("format", "gguf" if gguf is not False else "other")
    gguf = dict(SMALL_GGUF) if gguf is None else (gguf or {})
    return ModelFile.objects.create(name=name, size=size, gguf=gguf, **fields)


def make_control_plane(name: str, token: str | None = None, holds: tuple[ModelFile, ...] = (),
                       **fields) -> ControlPlane:
    """Another control plane (token `lcp_<name>` unless given), holding `holds`."""
    fields.setdefault("seen_at", timezone.now())
    fields.setdefault("url", f"http://{name}.test:8000")
    plane = ControlPlane.objects.create(name=name, token_hash=peers.hash_token(token or f"lcp_{name}"), **fields)
    for model_file in holds:
        FileCopy.objects.create(file=model_file, control_plane=plane, verified_at=timezone.now())
    return plane


def make_profile(name: str | None = None, **fields) -> Profile:
    return Profile.objects.create(name=name or f"profile-{next(_seq)}", **fields)


def make_engine(name: str | None = None, kind: str = "llama.cpp", **fields) -> EngineVersion:
    return EngineVersion.objects.create(name=name or f"engine-{next(_seq)}", kind=kind, **fields)


def make_model(
    name: str | None = None,
    file: ModelFile | None = None,
    engine: str = "llama.cpp",
    profile: str = "default",
    **fields,
) -> Model:
    return Model.objects.create(
        name=name or f"model-{next(_seq)}",
        file=file or make_file(),
        engine=EngineVersion.objects.get(name=engine),
        profile=Profile.objects.get(name=profile),
        **fields,
    )


def make_replica(model: Model, node: Node | None = None, state: str = Replica.State.READY, **fields) -> Replica:
    fields.setdefault("port", 20000 + next(_seq) if node else None)
    fields.setdefault("memory_bytes", 1024**3)
    return Replica.objects.create(name=Replica.new_name(model.name), model=model, node=node, state=state, **fields)


def row_counts() -> dict[str, int]:
    """Rows of everything an operation could change: equal before and after a refused request."""
    tables = (Node, Profile, EngineVersion, ModelFile, Model, Replica, Event, User, ControlPlane, FileCopy,
              RevokedControlPlaneToken)
    return {cls.__name__: cls.objects.count() for cls in tables}


def node_facts(
    memory_bytes: int = 16 * 1024**3, engines: dict | None = None, port_range=(21000, 21009), **fields
) -> dict:
    """Facts as an agent's hello gives them (already in the shape reports._clean_facts keeps)."""
    facts = {
        "hostname": "host-test",
        "cpu_count": 8,
        "memory_bytes": memory_bytes,
        "memory_total_bytes": memory_bytes,
        "gpus": [],
        "engines": {"llama.cpp": "b4000"} if engines is None else engines,
        "port_range": list(port_range),
        "agent_version": "test",
    }
    facts.update(fields)
    return facts


def make_agent_node(name: str | None = None, memory_bytes: int = 16 * 1024**3, **facts) -> Node:
    """A connected node that has said hello: facts with engines and a port range, memory as offered."""
    return make_node(name, memory_bytes=memory_bytes, facts=node_facts(memory_bytes=memory_bytes, **facts))


def seed_defaults() -> None:
    """What migrations 0002 and 0004 seed (the `default` profile, the engines, the role groups, the engine key),
    again: a transactional test's flush removes it. Idempotent."""
    import importlib

    from django.apps import apps

    importlib.import_module("cluster.migrations.0002_defaults").forwards(apps, None)
    importlib.import_module("cluster.migrations.0004_engine_key").forwards(apps, None)
    Event.objects.filter(kind="engine_key.created").delete()  # as every test starts: see tests/conftest.py


def put_waiting(client, model: str, *waited: float, lapsed: int = 0) -> list[str]:
    """Requests waiting in `model`'s admission queue in Redis, one per number of seconds it has waited, written as
    the gateway's admission writes them (cluster.inflight: per class, ticket -> when enqueued; ticket -> when it
    lapses); `lapsed` more whose process is gone (not counted). The keys, for the test to delete."""
    from cluster.inflight import queue_keys

    seconds, micro = client.time()
    now_ms = seconds * 1000 + micro // 1000
    classes, lapses = queue_keys(model)
    client.delete(*classes, lapses)
    for i, waited_for in enumerate(waited):
        client.zadd(classes[1], {f"t{i}": now_ms - waited_for * 1000})
        client.zadd(lapses, {f"t{i}": now_ms + 60_000})
    for i in range(lapsed):
        client.zadd(classes[1], {f"gone{i}": now_ms - 99_000})
        client.zadd(lapses, {f"gone{i}": now_ms - 1000})
    return [*classes, lapses]
