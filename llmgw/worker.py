"""What only the Celery worker loads (`CELERY_WORKER_CONSUMER`): Celery's worker modules cost 0.2 s to import,
which every other llmgw process, loading llmgw.celery with Django, is spared."""

import logging

from celery.worker import consumer

log = logging.getLogger("llmgw.worker")


class Consumer(consumer.Consumer):
    """Celery's consumer, but for one failure when the broker goes away.

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
