"""Writing Events and kicking the reconciler: the two things every change of state does."""

import logging

from celery import current_app
from django.db import transaction

from cluster import notify
from cluster.models import Event

log = logging.getLogger("llmgw.events")

RECONCILE_TASK = "cluster.tasks.reconcile"  # sent by name: the tasks module sits above everything that kicks


def record(kind: str, actor: str, message: str, subject: str = "", **data) -> Event:
    log.info("%s %s: %s", actor, kind, message)
    # the columns' widths (a user name may be 150 characters; PostgreSQL refuses what does not fit)
    event = Event.objects.create(kind=kind[:64], actor=actor[:120], subject=subject[:120], message=message[:1000],
                                 data=data)
    notify.dashboard_changed(kind)
    return event


def ask_reconciler() -> None:
    """Run the reconciler now (no transaction to wait for): what a gateway does for a request that asks for a
    replica of a model that has none."""
    try:
        current_app.send_task(RECONCILE_TASK, retry=False, expires=30)
    except Exception as exc:
        log.warning("could not kick the reconciler (%s); its next tick will pick the request up", exc)


def kick_reconciler() -> None:
    """Run the reconciler soon after this transaction commits, and have the gateways reload. If the broker is
    away, beat's next tick runs it."""

    def send():
        try:
            current_app.send_task(RECONCILE_TASK, retry=False, expires=30)
        except Exception as exc:  # the broker is down: the change is saved; beat catches up when it is back
            log.warning("could not kick the reconciler (%s); its next tick will pick the change up", exc)

    transaction.on_commit(send)
    notify.routing_changed()
