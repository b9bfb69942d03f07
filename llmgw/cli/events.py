"""`ctl events`: the event log, oldest first, and following it."""

from __future__ import annotations

import time

from llmgw.cli.args import parse_when
from llmgw.cli.client import CliError
from llmgw.cli.output import as_json, moment

FOLLOW_EVERY = 1.0  # seconds between looks at the log


def events_list(o, out):
    api = o["api"]
    if o.get("json") and o.get("follow"):
        raise CliError("--json and --follow do not go together")
    if not 1 <= o["limit"] <= 10_000:
        raise CliError(f"--limit: from 1 to 10000, not {o['limit']}")
    filters = {"kind_prefix": o.get("kind"), "subject": o.get("subject"),
               "since": parse_when(o.get("since"), "--since")}
    events = api.get("events/", **filters, limit=o["limit"])["results"][::-1]
    if o.get("json"):
        return as_json(events, out)
    for e in events:
        print_event(e, out)
    if not o.get("follow"):
        return
    last = events[-1]["id"] if events else _newest(api)
    try:
        while True:
            time.sleep(FOLLOW_EVERY)
            last = follow(api, last, out, **filters)
    except KeyboardInterrupt:
        return


def follow(api, after: int, out, on_event=None, **filters) -> int:
    """Print the events after the one with id `after`, oldest first; the last id printed."""
    page = api.get("events/", **filters, after=after, limit=10_000)["results"]
    for e in sorted(page, key=lambda e: e["id"]):
        print_event(e, out)
        if on_event:
            on_event(e)
        after = e["id"]
    out.flush()
    return after


def _newest(api) -> int:
    newest = api.get("events/", limit=1)["results"]
    return newest[0]["id"] if newest else 0


def print_event(e: dict, out) -> None:
    out.write(f"{moment(e['created_at']):%Y-%m-%d %H:%M:%S}  {e['kind']:<20} {e['actor']:<16} {e['message']}\n")
