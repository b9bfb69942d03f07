"""The request records: one row per request through /v1/ (gateway.models.RequestRecord), what it was and what
became of it. A web process keeps them in memory as its requests end and writes them with its usage, every
second, in one statement (gateway.runtime's books): a request never waits for its record. At most KEPT records
wait in memory (a database away for long): past that the oldest are dropped, and said once.

Beat prunes them every ten minutes (`prune`, gateway/tasks.py): older than LLMGW_REQUEST_LOG_DAYS days, and past
the newest LLMGW_REQUEST_LOG_ROWS rows, so a busy fleet does not fill its disk."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import re
from collections import deque
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Field, QuerySet
from django.db.models.functions import TruncDay, TruncHour
from django.utils import timezone

from cluster import events
from cluster.models import Event
from gateway.metrics import RESUME_REASONS
from gateway.models import RequestRecord

log = logging.getLogger("llmgw.gateway")
KEPT = 100_000  # records a process holds while the database is away


class Why(NamedTuple):
    """Why a request went to its replica (gateway/explain.py): the routing's policy, whether its prefix's or its
    session's replica took it, the one chosen (with its load), and those passed over before it, each with why."""

    policy: str  # "prefix" or "least in flight"
    hit: str  # "prefix", "session" (the replica its key maps to took it) or "" (another, or no such key)
    chosen: str  # "replica (N in flight)"
    passed: tuple[tuple[str, str], ...]  # (replica, why passed over)

    def shown(self) -> dict[str, object]:
        return {"policy": self.policy, "hit": self.hit, "chosen": self.chosen, "passed": [list(p) for p in self.passed]}


class Try(NamedTuple):
    """One replica a request was sent to: when (ms from its arrival), and what became of it."""

    replica: str
    started_ms: float
    ended_ms: float
    outcome: str  # "answered 200", "answered 503", "failed: …", "did not accept the connection", "did not answer in
    # time", "cancelled: the client went away" (gateway/sending.py)


RESUMED = "; resumed"  # how the outcome of a try that broke off and was resumed on another replica ends


class Row(NamedTuple):
    """A record as a request's end leaves it: plain values, in the order of the columns `write` fills (a model
    instance per request, made as it ended, cost the gateway a tenth of its requests per second)."""

    request_id: str
    trace_id: str
    at: float  # Unix time it arrived
    key_id: int | None
    model: str
    asked: str
    surface: str
    streamed: bool
    status: int
    error: str
    priority: str
    waited_ms: float | None
    replica: str
    attempts: int
    ttft_ms: float | None
    total_ms: float
    prompt_tokens: int
    completion_tokens: int
    client: str
    span_id: str
    parent_id: str
    position: int | None  # where it entered its model's queue (None: it did not queue)
    route: Why | None
    tries: tuple[Try, ...]
    cached_tokens: int
    prompt_ms: float | None
    generation_ms: float | None
    request_body: str  # what the client sent, when its key logs bodies (else "")
    response_body: str  # what it was answered, as far as kept
    resumes: int = 0  # times its answer was resumed on another replica (each such try's outcome ends RESUMED)
    resumed_prompt_tokens: int = 0  # the continuation requests' prompts: the fleet's cost, not the key's
    shadow: bool = False  # a copy sent to a rollout's canary, its answer discarded (gateway/shadow.py)


class Records:
    """This process's records not written yet."""

    def __init__(self) -> None:
        self.waiting: deque[Row] = deque(maxlen=KEPT)
        self.dropped = 0

    def add(self, record: Row) -> None:
        if len(self.waiting) == KEPT:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("request records are not being written: the oldest are dropped past %d", KEPT)
        self.waiting.append(record)

    def take(self) -> list[Row]:
        taken = list(self.waiting)
        self.waiting.clear()
        return taken

    def keep(self, taken: list[Row]) -> None:
        """Records whose write failed, back first in line for the next (the oldest dropped past KEPT)."""
        self.waiting.extendleft(reversed(taken))


# as the API's schema says them (JSON Schema's patterns: anchored, in what ECMA and Python read alike)
STATUS_FILTER = re.compile(r"^[1-5](?:xx|[0-9]{2})$")
SLOWER_THAN = re.compile(r"^([0-9]{1,9}(?:[.][0-9]{1,6})?)(ms|s|m)?$")
_TO_MS = {"ms": 1.0, "s": 1000.0, None: 1000.0, "m": 60_000.0}


class FilterError(ValueError):
    """A filter that cannot be read: which, and why."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name, self.message = name, message


def listed(key: str = "", model: str = "", status: str | None = None, slower_than: str | None = None,
           since: dt.datetime | None = None, replica: str = "", resumed: str | None = None) -> QuerySet[RequestRecord]:
    """The records newest first, those of a key (its name), a model, an answer's status (429) or class (5xx),
    slower than a time (2s, 500ms; a number: seconds), from a time on (None: not asked; "" is asked and wrong),
    answered by a replica (the last it was sent to), resumed on another replica or not ("true", "false");
    FilterError for one it cannot read. The API, the CLI (through it) and the dashboard filter alike."""
    found = RequestRecord.objects.select_related("key").order_by("-at", "-id")
    if key:
        found = found.filter(key__name=key)
    if model:
        found = found.filter(model=model)
    if replica:
        found = found.filter(replica=replica)
    if status is not None:
        wanted = status.lower()
        if not STATUS_FILTER.fullmatch(wanted):
            raise FilterError("status", f"a status such as 429 or a class such as 5xx, not {status[:40]!r}")
        low = int(wanted[0]) * 100 if wanted.endswith("xx") else int(wanted)
        found = found.filter(status__gte=low, status__lte=low + 99 if wanted.endswith("xx") else low)
    if slower_than is not None:
        said = SLOWER_THAN.fullmatch(slower_than.lower())
        if said is None:
            raise FilterError("slower_than", f"a time such as 2s, 500ms or 1.5, not {slower_than[:40]!r}")
        found = found.filter(total_ms__gt=float(said[1]) * _TO_MS[said[2]])
    if since is not None:
        found = found.filter(at__gte=since)
    if resumed is not None:
        if resumed not in RESUMED_FILTER:
            raise FilterError("resumed", f"true or false, not {resumed[:40]!r}")
        found = found.filter(resumes__gt=0) if resumed == "true" else found.filter(resumes=0)
    return found


RESUMED_FILTER = ("true", "false")


BROKEN_BEFORE = dt.timedelta(seconds=60)  # a failure Event is written after what it broke: the agent said it
BROKEN_AFTER = dt.timedelta(seconds=10)
LONGEST = dt.timedelta(hours=1)  # the longest request a failure is looked for in


def broken_by(replica: str, when: dt.datetime, limit: int = 50) -> list[str]:
    """The requests a replica's failure at `when` broke, as their records say: answered 5xx from it, their end
    from a minute before the failure's Event to a few seconds after (the newest first, at most `limit`)."""
    ids = []
    for rid, at, total_ms in (listed(replica=replica, status="5xx")
                              .filter(at__gte=when - LONGEST, at__lte=when + BROKEN_AFTER)
                              .values_list("request_id", "at", "total_ms")):
        if at + dt.timedelta(milliseconds=total_ms) >= when - BROKEN_BEFORE:
            ids.append(rid)
            if len(ids) == limit:
                break
    return ids


def errors_per(by: str, since: dt.datetime, key: str = "", model: str = "") -> dict[dt.datetime, int]:
    """The answers of 400 and more per hour or day (`by`; its start, UTC) from `since` on, of a key (its name) and
    a model if given: the errors, which the usage (gateway.models.Usage) does not count."""
    found = RequestRecord.objects.filter(at__gte=since, status__gte=400)
    if key:
        found = found.filter(key__name=key)
    if model:
        found = found.filter(model=model)
    start = TruncDay("at", tzinfo=dt.UTC) if by == "day" else TruncHour("at", tzinfo=dt.UTC)
    counted = found.annotate(start=start).values("start").annotate(n=Count("id")).order_by()
    return {row["start"]: row["n"] for row in counted}


def write(taken: list[Row]) -> None:
    """The rows in one statement run for them all, as cheaply as it can be on the web process's thread (at its
    rate, a model instance per record cost a tenth of its CPU; Django's adapting of each value, a tenth more): the
    time as Django keeps it in this database, the JSON columns as text, a choice's reasons encoded once for all
    the requests that had the same. PostgreSQL takes them with COPY (a row written by psycopg's C code, not a
    statement's parameters adapted one by one: a quarter of the CPU)."""
    quote = connection.ops.quote_name
    columns = ", ".join(quote(field.column) for name in Row._fields
                        if isinstance(field := RequestRecord._meta.get_field(name), Field) and field.column)
    sqlite = connection.vendor == "sqlite"
    at, route = Row._fields.index("at"), Row._fields.index("route")
    values: list[Any] = [(*row[:at], _time(row.at, sqlite), *row[at + 1:route], _route(row.route),
                          _tries(row.tries), *row[route + 2:]) for row in taken]
    table = quote(RequestRecord._meta.db_table)
    resumed = [row for row in taken if row.resumes]
    with transaction.atomic():
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                    for value in values:
                        copy.write_row(value)
            else:
                cursor.executemany(
                    f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * len(Row._fields))})", values)
        if resumed:  # written with the records, so a write tried again says them once
            events.record_all(resume_events(resumed))


# what a resumed try's outcome says (gateway/sending.py's words), read as a reason of metrics.RESUME_REASONS
_REASON_WORDS = (("silent", ("went silent", "silent")), ("lost", ("left the fleet", "lost")),
                 ("closed", ("closed", "eof", "reset")), ("error", ("error",)))
RESUME_SAID = {"closed": "closed the connection", "silent": "went silent", "lost": "left the fleet",
               "error": "answered an error mid-stream"}  # each of metrics.RESUME_REASONS (tests/gateway/test_records.py)


def resume_reason(outcome: str) -> str:
    """The reason (metrics.RESUME_REASONS) a resumed try's outcome gives: `closed` where it names none."""
    said = outcome.lower()
    return next((reason for reason, words in _REASON_WORDS if any(word in said for word in words)), "closed")


def resume_events(rows: list[Row]) -> list[Event]:
    """An Event (unsaved) per replica the rows' answers were resumed away from, as their tries say: how many
    answers, and why they broke off (`replica.broke_off`, on the replica's Events)."""
    away: dict[str, dict[str, str]] = {}  # replica -> {request id: reason}, in order
    for row in rows:
        for t in row.tries:
            if t.outcome.endswith(RESUMED):
                away.setdefault(t.replica, {}).setdefault(row.request_id, resume_reason(t.outcome))
    out = []
    for replica, answers in away.items():
        reasons = {reason: list(answers.values()).count(reason) for reason in RESUME_REASONS
                   if reason in answers.values()}
        n = len(answers)
        out.append(Event(kind="replica.broke_off", actor="gateway", subject=replica, data={
            "answers": n, "reasons": reasons, "requests": list(answers)[:20]}, message=(
            f"replica {replica}: {n} answer{'s' if n != 1 else ''} resumed elsewhere after it broke off "
            f"({' / '.join(RESUME_SAID[r] for r in reasons)})")))
    return out


_encode = json.JSONEncoder(separators=(",", ":")).encode


@functools.lru_cache(maxsize=4096)
def _route(why: Why | None) -> str:
    return _encode(why.shown()).replace("\\u0000", "\\ufffd") if why else "{}"  # no NUL in PostgreSQL's JSON


def _tries(tries: tuple[Try, ...]) -> str:
    return "[" + ",".join(f"[{_json_string(t.replica)},{t.started_ms!r},{t.ended_ms!r},{_json_string(t.outcome)}]"
                          for t in tries) + "]"


@functools.lru_cache(maxsize=4096)
def _json_string(value: str) -> str:
    return _encode(value.replace("\x00", "\ufffd"))  # PostgreSQL's JSON holds no NUL


def _time(at: float, sqlite: bool) -> dt.datetime | str:
    """A Unix time as Django writes a DateTimeField: in SQLite the UTC time as text, elsewhere the time itself."""
    when = dt.datetime.fromtimestamp(at, dt.UTC)
    return str(when.replace(tzinfo=None)) if sqlite else when


def prune(now: dt.datetime | None = None) -> int:
    """Records older than LLMGW_REQUEST_LOG_DAYS and past the newest LLMGW_REQUEST_LOG_ROWS, deleted; how many."""
    now = now or timezone.now()
    gone, _ = RequestRecord.objects.filter(at__lt=now - dt.timedelta(days=settings.LLMGW_REQUEST_LOG_DAYS)).delete()
    last = RequestRecord.objects.order_by("-at", "-id").values_list("at", "id")[
        settings.LLMGW_REQUEST_LOG_ROWS:settings.LLMGW_REQUEST_LOG_ROWS + 1].first()
    if last is not None:
        at, pk = last
        over, _ = RequestRecord.objects.filter(at__lte=at).exclude(at=at, id__gt=pk).delete()
        gone += over
    return gone
