"""Fixtures of the gateway's view tests: the test engines, the cluster the gateway routes by, a client with a key,
and this loop's gateway stopped after each test."""

import asyncio
from types import SimpleNamespace

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.db import connections

from cluster.models import ClusterSettings, Profile, Replica
from gateway import operations as gateway_operations
from gateway import runtime as gateway_runtime
from tests.factories import make_model, make_node, make_replica, seed_defaults
from tests.gateway.views.harness import ANSWER, ENGINE_KEY, SLOW_ANSWER, Engine, key_client, ready_replica


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    started = Engine(tmp_path_factory.mktemp("engine"), "--answer", ANSWER, "--echo-body")
    yield started
    started.stop()


@pytest.fixture
def slow_engine(tmp_path):
    """One token every 50 ms: a stream that is still running when the test acts on it."""
    started = Engine(tmp_path, "--answer", SLOW_ANSWER, "--delay-ms", "50")
    yield started
    started.stop()


@pytest.fixture
def lingering_engine(tmp_path):
    """Ends each stream half a second after its [DONE], as an engine that closes a moment late."""
    started = Engine(tmp_path, "--answer", ANSWER, "--linger-ms", "500")
    yield started
    started.stop()


@pytest.fixture
def cluster(transactional_db, engine):
    """A node on loopback with model `qwen` (llama.cpp with --embeddings) ready on the engine, model `empty` with
    no replica that can be placed, and key `ci`."""
    seed_defaults()  # the transactional flush removed the migrations' profile and engines
    ClusterSettings.load()
    ClusterSettings.objects.filter(pk=1).update(engine_key=ENGINE_KEY)
    node = make_node("local", address="127.0.0.1")
    # tests/engine.py serves embeddings too; a llama.cpp model does with --embeddings
    Profile.objects.create(name="embeds", parallel=2, extra_args=["--embeddings"])
    model = make_model("qwen", profile="embeds")
    replica = ready_replica(model, node, engine.port)
    # the state the reconciler leaves a model in when no node has room for it
    make_replica(make_model("empty"), None, state=Replica.State.PENDING, reason="needs 64.0 GiB RAM")
    _, secret = gateway_operations.create_key("ci", "test")
    return SimpleNamespace(node=node, model=model, replica=replica, secret=secret, engine=engine)


@pytest_asyncio.fixture(autouse=True)
async def gateway(transactional_db):
    """After each test: stop this loop's gateway (its tasks, upstream pool, Redis) and close the database
    connection of the thread its table loads on, which Django's own clean-up never visits."""
    yield
    gw = gateway_runtime._runtimes.get(asyncio.get_running_loop())
    if gw is not None:
        await gw.aclose()
    await sync_to_async(connections.close_all)()


@pytest.fixture
def client(cluster):
    return key_client(cluster.secret)
