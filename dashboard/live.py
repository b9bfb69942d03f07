"""Live pages: every Event (cluster.events.record) tells the open dashboards what kind of thing changed.

After the writing transaction commits, one message per transaction goes to the channel-layer group `dashboard`
with the Event kinds' families (`replica`, `node`, `model`, `system`, ...). Each browser's DashboardConsumer
passes them on over its websocket; the page's partials that show that family fetch themselves again (htmx).
A failure to reach the channel layer never fails the change: the pages also refresh on a slow timer.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction

GROUP = "dashboard"
log = logging.getLogger("llmgw.dashboard")


def changed(kind: str) -> None:
    """Tell the open dashboards, once this transaction commits, that something of `kind` (an Event kind such as
    `replica.ready`) changed. Several changes in one transaction make one message."""
    family = kind.split(".", 1)[0]
    pending = getattr(connection, "_llmgw_dashboard", None)
    # still waiting for this transaction's commit (not run, not discarded by a rollback): add to it
    if pending is not None and connection.in_atomic_block and any(f is pending for _, f, _ in connection.run_on_commit):
        pending.families.add(family)
        return

    def send():
        try:
            async_to_sync(get_channel_layer().group_send)(
                GROUP, {"type": "dashboard.changed", "families": sorted(send.families)})
        except Exception as exc:  # the pages' timer catches up
            log.warning("could not tell the dashboards about a change: %s", exc)

    send.families = {family}
    connection._llmgw_dashboard = send
    transaction.on_commit(send)
