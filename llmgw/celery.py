import os
import sys

from celery import Celery
from celery.signals import beat_init, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

_path = list(sys.path)
app = Celery("llmgw")
# Celery's Django fix-up, installed as the app is made, puts the current directory first on the import path (for a
# project run from its own directory); llmgw's packages are found without it, and a directory holding an
# `agents.py` (a `cluster.py`, …) must not take their place (tests/test_package.py)
sys.path[:] = _path
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _worker_ready(**kwargs):
    from cluster import control, peers, system
    from cluster.mirror import sync

    control.start("worker", system.successor_started)  # register with the control plane; obey `llmgw restart`
    peers.start()  # this control plane heard from by the others
    sync.start()  # this control plane's mirror: what it lacks, pulled from the others


@beat_init.connect
def _beat_init(**kwargs):
    from cluster import control, system

    control.start("beat", system.successor_started)
