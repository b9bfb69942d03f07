import logging
import os

from celery import Celery
from celery.signals import beat_init, worker_ready
from celery.worker import consumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
log = logging.getLogger("llmgw.celery")


class Consumer(consumer.Consumer):
    """Celery's consumer (settings: CELERY_WORKER_CONSUMER), but for one failure when the broker goes away.

    Celery 5.7.0, on losing the broker, first collects the connection (which forgets its transport's settings),
    then closes it; kombu's Redis channel, in that close, puts back the messages delivered to this worker and not
    yet acknowledged (a task waiting behind one that runs), and to reach Redis reads the settings just forgotten:
    an AttributeError, which Celery takes for an unrecoverable error, and the worker exits. Seen when PostgreSQL
    held a task up while Redis restarted (tests/integration/test_fleet.py; tests/integration/test_worker.py
    reproduces it). Those messages are gone with a Redis restarted empty; with a Redis that kept them, they are
    in its unacknowledged set, which workers put back after the visibility timeout."""

    def on_connection_error_after_connected(self, exc):
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError as error:
            log.warning("the broker connection was lost with messages not yet acknowledged (%s); Redis puts "
                        "them back after its visibility timeout; connecting again", error)


@worker_ready.connect
def _worker_ready(**kwargs):
    from cluster import control, system

    control.start("worker", system.successor_started)  # register with the control plane; obey `llmgw restart`


@beat_init.connect
def _beat_init(**kwargs):
    from cluster import control, system

    control.start("beat", system.successor_started)
