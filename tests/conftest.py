"""Fixtures shared by the test packages: the database every test starts from, REST API clients by role."""

import asyncio

import pytest

from tests.factories import client_for


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """The migrated test database with an empty event log, so that every Event a test sees is one its own
    actions wrote (the migrations write one: the engine key made, migration 0004)."""
    from cluster.models import Event

    with django_db_blocker.unblock():
        Event.objects.all().delete()


@pytest.fixture(scope="session")
def _postgresql_test_database(postgresql_server, django_db_setup, django_db_blocker):
    from tests.postgres import make_test_database

    with django_db_blocker.unblock():
        return make_test_database(postgresql_server)


@pytest.fixture
def on_postgresql(request, transactional_db, django_db_blocker):
    """The test runs on PostgreSQL (row locks, concurrent writers): the run's database when it is PostgreSQL,
    else a migrated test database on the run's own server, emptied after the test as a transactional test's is."""
    from django.db import connection

    if connection.vendor == "postgresql":
        yield
        return
    from tests.postgres import default_database, flush_test_database

    database = request.getfixturevalue("_postgresql_test_database")
    try:
        with default_database(database):
            yield
    finally:
        flush_test_database(database)


@pytest.fixture
def operator(db):
    return client_for("operator")


@pytest.fixture
def viewer(db):
    return client_for("viewer")


@pytest.fixture
def admin(db):
    return client_for("admin")


@pytest.fixture
def a_swallowed_cancel(monkeypatch):
    """The channel layer's receive as redis-py now and then makes it (redis/redis-py#2028): a cancellation at the
    wrong moment is swallowed and the receive goes on waiting for a message. Here: every time (and a second
    cancellation ends it, so a failing test does not hang the run)."""
    from channels_redis.core import RedisChannelLayer

    original = RedisChannelLayer.receive

    async def receive(self, channel):
        try:
            return await original(self, channel)
        except asyncio.CancelledError:
            return await original(self, channel)

    monkeypatch.setattr(RedisChannelLayer, "receive", receive)


@pytest.fixture
def channel_layer_at(settings):
    """Point the project's channel layer at a Redis of the test's choosing (the layers are made again from the
    setting): `channel_layer_at(url)`; with no URL, a port nothing listens on (the layer away)."""
    from channels.layers import channel_layers

    from ground.ports import free_port

    def point(url: str | None = None) -> None:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "llmgw.channel_layer.RedisChannelLayer", "CONFIG": {
            "hosts": [{"address": url or f"redis://127.0.0.1:{free_port()}/0", "socket_connect_timeout": 1}]}}}
        assert channel_layers.backends == {}

    return point


@pytest.fixture
def this_control_plane(settings, tmp_path):
    """The test process as control plane cp-1 (needs the database), its token in an LLMGW_HOME of its own, as an
    installation keeps it: the file `control-plane-token`."""
    from cluster import peers

    home = tmp_path / "cp-1-home"
    home.mkdir()
    (home / peers.TOKEN_FILE).write_text(f"lcp_cp-1-{tmp_path.name}")
    settings.LLMGW_HOME = home
    settings.LLMGW_CONTROL_PLANE_URL = "http://cp-1.test:8000"
    settings.LLMGW_CONTROL_PLANE_NAME = "cp-1"
    return peers.me()
