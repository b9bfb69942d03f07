"""The cluster settings row and its engine key, made once when the database is set up (with an Event), rather
than by whichever process first reads the settings. ClusterSettings.load() still makes them, once, where the row
is gone (a flushed database)."""

import hashlib
import secrets

from django.db import migrations
from django.utils import timezone


def forwards(apps, schema_editor):
    ClusterSettings = apps.get_model("cluster", "ClusterSettings")
    Event = apps.get_model("cluster", "Event")
    row, made = ClusterSettings.objects.get_or_create(pk=1)
    if row.engine_key:
        return
    key = "lek_" + secrets.token_urlsafe(32)
    if ClusterSettings.objects.filter(pk=1, engine_key="").update(engine_key=key):
        fingerprint = hashlib.sha256(key.encode()).hexdigest()[:12]
        Event.objects.create(
            created_at=timezone.now(), kind="engine_key.created", actor="system",
            message=f"engine key created (fingerprint {fingerprint}): every engine requires it",
        )


class Migration(migrations.Migration):
    dependencies = [("cluster", "0003_node_drain")]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
