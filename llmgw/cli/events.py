"""`ctl events`: the event log, oldest first, and following it."""

from __future__ import annotations

import time

from django.core.management.base import CommandError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from cluster.models import Event
from llmgw.cli.output import as_json

def events_list(o, out):
    qs = Event.objects.all()
    if o.get("kind"):
        qs = qs.filter(kind__startswith=o["kind"])
    if o.get("subject"):
        qs = qs.filter(subject=o["subject"])
    if o.get("since"):
        since = parse_datetime(o["since"])
        if since is None:
            raise CommandError(f"--since wants an ISO date and time such as 2026-11-29T12:00:00Z, not {o['since']!r}")
        if timezone.is_naive(since):
            since = timezone.make_aware(since)
        qs = qs.filter(created_at__gte=since)
    events = list(qs.order_by("-id")[: o["limit"]])[::-1]
    if o.get("json"):
        if o.get("follow"):
            raise CommandError("--json and --follow do not go together")
        return as_json([{"id": e.pk, "at": e.created_at, "kind": e.kind, "actor": e.actor, "subject": e.subject,
                         "message": e.message, "data": e.data} for e in events], out)
    for e in events:
        _print_event(e, out)
    if not o.get("follow"):
        return
    last = events[-1].pk if events else (Event.objects.order_by("-id").values_list("id", flat=True).first() or 0)
    try:
        while True:
            time.sleep(1)
            for e in qs.filter(pk__gt=last).order_by("id"):
                _print_event(e, out)
                last = e.pk
            out.flush()
    except KeyboardInterrupt:
        return


def _print_event(e: Event, out) -> None:
    out.write(f"{e.created_at:%Y-%m-%d %H:%M:%S}  {e.kind:<20} {e.actor:<16} {e.message}\n")
