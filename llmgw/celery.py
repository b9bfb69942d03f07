import os

from celery import Celery
from celery.signals import beat_init, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _worker_ready(**kwargs):
    from cluster import control, system

    control.start("worker", system.successor_started)  # register with the control plane; obey `llmgw restart`


@beat_init.connect
def _beat_init(**kwargs):
    from cluster import control, system

    control.start("beat", system.successor_started)
