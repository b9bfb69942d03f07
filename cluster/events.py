"""Writing Events and kicking the reconciler: the two things every change of state does."""

import logging

from celery import current_app
from django.db import transaction

from cluster import notify
from cluster.locks import redis_client
from cluster.models import Event

log = logging.getLogger("llmgw.events")

RECONCILE_TASK = "cluster.tasks.reconcile"  # sent by name: the tasks module sits above everything that kicks
# A run asked for and not yet begun: while it is there, a kick sends no other task (the queued run will see the
# change). Hundreds of agents reporting at once made hundreds of runs one after another, each reading the whole
# cluster; now they make one, and one more for what came while it ran. The run deletes it as it begins; it
# lapses by itself should no worker take the task (beat's tick runs the reconciler anyway).
RECONCILE_QUEUED = "llmgw:reconcile:queued"
QUEUED_TTL = 10


def record(kind: str, actor: str, message: str, subject: str = "", **data) -> Event:
    log.info("%s %s: %s", actor, kind, message)
    # the columns' widths (a user name may be 150 characters; PostgreSQL refuses what does not fit)
    event = Event.objects.create(kind=kind[:64], actor=actor[:120], subject=subject[:120], message=message[:1000],
                                 data=data)
    notify.dashboard_changed(kind)
    return event


def record_all(events: list[Event]) -> None:
    """Several Events (unsaved) written in one statement, with one notice to the dashboards: a batch's, such as
    the gateway's request records', off a request's path."""
    for event in events:
        log.info("%s %s: %s", event.actor, event.kind, event.message)
        event.kind, event.actor, event.subject = event.kind[:64], event.actor[:120], event.subject[:120]
        event.message = event.message[:1000]
    Event.objects.bulk_create(events)
    for kind in sorted({event.kind for event in events}):
        notify.dashboard_changed(kind)


def ask_reconciler() -> None:
    """Run the reconciler now (no transaction to wait for): what a gateway does for a request that asks for a
    replica of a model that has none."""
    try:
        current_app.send_task(RECONCILE_TASK, retry=False, expires=30)
    except Exception as exc:
        log.warning("could not kick the reconciler (%s); its next tick will pick the request up", exc)


def kick_reconciler(routing: bool = True) -> None:
    """Run the reconciler soon after this transaction commits, and have the gateways reload (unless `routing` is
    False: the change moves no route, such as an agent connecting again from the same address; what the
    reconciler then changes reloads them itself). If the broker is away, beat's next tick runs it."""

    def send():
        try:
            if not redis_client().set(RECONCILE_QUEUED, 1, nx=True, ex=QUEUED_TTL):
                return  # a run is queued and has not begun: it reads this change
        except Exception as exc:  # Redis away: send the task anyway
            log.debug("could not check for a queued reconcile (%s)", exc)
        try:
            current_app.send_task(RECONCILE_TASK, retry=False, expires=30)
        except Exception as exc:  # the broker is down: the change is saved; beat catches up when it is back
            log.warning("could not kick the reconciler (%s); its next tick will pick the change up", exc)

    transaction.on_commit(send)
    if routing:
        notify.routing_changed()
