"""The engine key is made once, with an Event: by the migrations when the database is set up, or by the first
read where the row is gone; never again by a read (two processes at once: tests/cluster/test_races.py)."""

import importlib

from django.apps import apps

from cluster.models import ClusterSettings, Event


def made() -> int:
    return Event.objects.filter(kind="engine_key.created").count()


def test_the_migration_makes_the_key_once_with_an_event(db):
    ClusterSettings.objects.filter(pk=1).update(engine_key="")
    migration = importlib.import_module("cluster.migrations.0004_engine_key")
    migration.forwards(apps, None)
    key = ClusterSettings.objects.get().engine_key
    assert key.startswith("lek_") and made() == 1
    migration.forwards(apps, None)  # again (a second `migrate`, seed_defaults): nothing changes
    assert ClusterSettings.objects.get().engine_key == key and made() == 1
    [event] = Event.objects.filter(kind="engine_key.created")
    assert ClusterSettings.fingerprint(key) in event.message and key not in event.message


def test_a_read_makes_a_missing_key_once_and_then_only_reads(db):
    ClusterSettings.objects.all().delete()
    key = ClusterSettings.load().engine_key
    assert key.startswith("lek_") and made() == 1
    assert [ClusterSettings.load().engine_key for _ in range(3)] == [key] * 3 and made() == 1
