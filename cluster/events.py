"""Writing Events and kicking the reconciler: the two things every change of state does."""

import logging

from django.db import transaction

from cluster.models import Event
from dashboard.live import changed as dashboard_changed

log = logging.getLogger("llmgw.events")


def record(kind: str, actor: str, message: str, subject: str = "", **data) -> Event:
    log.info("%s %s: %s", actor, kind, message)
    event = Event.objects.create(kind=kind, actor=actor, subject=subject, message=message[:1000], data=data)
    dashboard_changed(kind)
    return event


def kick_reconciler() -> None:
    """Run the reconciler soon after this transaction commits. If the broker is away, beat's next tick will."""

    def send():
        from cluster.tasks import reconcile

        try:
            reconcile.apply_async(retry=False, expires=30)
        except Exception as exc:  # the broker is down: the change is saved; beat catches up when it is back
            log.warning("could not kick the reconciler (%s); its next tick will pick the change up", exc)

    transaction.on_commit(send)
    from gateway.runtime import notify_change  # here, not at the top: the CLI need not load the gateway's aiohttp

    notify_change()
