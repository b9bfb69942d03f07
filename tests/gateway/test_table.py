"""What the gateway routes by: the ready replicas, and how many are worth waiting for; the keys' settings."""

from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.models import ClusterSettings, Replica
from gateway import operations, table
from gateway.models import ApiKey
from tests.factories import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    ClusterSettings.load()
    return make_node("n1", address="10.0.0.5")


def test_ready_replicas_are_routes_and_starting_ones_are_coming(node):
    model = make_model("m")
    ready = make_replica(model, node, state=Replica.State.READY)
    make_replica(model, node, state=Replica.State.STARTING)
    make_replica(model, node, state=Replica.State.DOWNLOADING)
    make_replica(model, node, state=Replica.State.DRAINING)  # takes no new requests
    route = table.load().models["m"]
    assert [u.replica for u in route.ready] == [ready.name]
    assert route.ready[0].base_url == f"http://10.0.0.5:{ready.port}"
    assert route.coming == 2


def test_an_agent_behind_a_proxy_is_reached_at_the_address_it_advertises(node):
    """Its stream comes from the proxy's address; its engines listen on its own."""
    node.facts = {**node.facts, "advertise_address": "198.18.0.12"}
    node.save(update_fields=["facts"])
    ready = make_replica(make_model("m"), node, state=Replica.State.READY)
    assert table.load().models["m"].ready[0].base_url == f"http://198.18.0.12:{ready.port}"


def test_an_unplaced_replica_is_not_coming(node):
    make_replica(make_model("m"), None, state=Replica.State.PENDING, reason="needs 2.0 GiB RAM")
    assert table.load().models["m"].coming == 0  # a request is answered 503 at once, not after the wait


@pytest.mark.parametrize("leaving", [Replica.State.DRAINING, Replica.State.STOPPING])
def test_an_unplaced_replacement_is_coming_while_its_model_makes_room(node, leaving):
    """A restart with no room for a second copy: the old replica drains and stops, and the new one takes its
    place. Requests meanwhile wait for it instead of failing."""
    model = make_model("m")
    make_replica(model, node, state=leaving, restart=Replica.Restart.REPLACING)
    make_replica(model, None, state=Replica.State.PENDING, reason="no room until the old replica stops")
    route = table.load().models["m"]
    assert route.ready == ()
    assert route.coming == 1


def test_an_unplaced_replacement_is_coming_just_after_the_old_one_stopped(node):
    """Between the old replica's stop and the reconcile that places the new one in its place."""
    model = make_model("m")
    old = make_replica(model, node, state=Replica.State.STOPPED, restart=Replica.Restart.REPLACING)
    make_replica(model, None, state=Replica.State.PENDING, reason="no room until the old replica stops")
    assert table.load().models["m"].coming == 1
    Replica.objects.filter(pk=old.pk).update(state_changed_at=timezone.now() - timedelta(seconds=table.FREED_RECENTLY + 1))
    assert table.load().models["m"].coming == 0  # long stopped: the replacement is simply unplaceable


def test_replicas_the_model_wants_but_that_do_not_exist_yet_are_coming(node):
    """A model just added or scaled up, or serving just started again: the reconciler's next run creates them."""
    model = make_model("m", replicas=2)
    make_replica(model, node, state=Replica.State.READY)
    assert table.load().models["m"].coming == 1
    ClusterSettings.objects.update(serving_stopped=True)
    assert table.load().models["m"].coming == 0


def test_a_model_is_found_by_name_then_by_alias_and_an_alias_never_shadows_a_name(node):
    make_model("coder", aliases=["claude-sonnet-4-5", "gpt-5-codex"])
    # as a race between two operations could leave them (each checks under a lock; a row written past it)
    make_model("gpt-5-codex", aliases=["claude-sonnet-4-5"])
    make_model("old", aliases=["old-alias"], removing=True)
    loaded = table.load()
    assert loaded.models["coder"].aliases == ("claude-sonnet-4-5", "gpt-5-codex")
    assert loaded.aliases == {"claude-sonnet-4-5": "coder", "gpt-5-codex": "coder"}
    assert loaded.find("coder").name == "coder"
    assert loaded.find("claude-sonnet-4-5").name == "coder"  # the first model by name has an alias two have
    assert loaded.find("gpt-5-codex").name == "gpt-5-codex"  # the model's own name, not coder's alias
    assert loaded.find("old-alias") is None and loaded.find("Coder") is None


def test_a_models_resuming_is_loaded_with_it(node):
    """How often an answer may be resumed elsewhere, and how long a stream may be silent: the model's (issue 38)."""
    make_model("m")
    make_model("off", resume_limit=0, stream_idle_timeout_seconds=90)
    models = table.load().models
    assert (models["m"].resume_limit, models["m"].stream_idle_timeout) == (2, 30.0)
    assert (models["off"].resume_limit, models["off"].stream_idle_timeout) == (0, 90.0)


def test_a_keys_settings_are_loaded_with_it(node):
    operations.create_key("plain", "test")
    operations.create_key("logged", "test", log_bodies=True, max_concurrency=3)
    keys = {k.name: k for k in table.load().keys.values()}
    assert (keys["plain"].log_bodies, keys["plain"].max_concurrency) == (False, None)
    assert (keys["logged"].log_bodies, keys["logged"].max_concurrency) == (True, 3)
    assert keys["logged"].id == ApiKey.objects.get(name="logged").pk
