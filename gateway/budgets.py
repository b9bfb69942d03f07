"""A key's token budget per period: the periods, their bounds, and what a key has spent in the current one.

Periods are calendar periods in UTC: a day from midnight, a week from Monday, a month from its first day. What a
key has spent is its usage in the database since the period began (gateway.models.Usage, per hour, flushed from
the gateways within a minute); the gateway enforces the budget on a running count in Redis (gateway.accounting),
seeded from this when Redis does not have it (a new period, a Redis that restarted), so spend survives a restart
and a period that changes begins from the usage of the new period, not the old one's count.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, TypedDict

from ground.units import BUDGET_PERIODS as PERIODS
from ground.units import about
from ground.units import parse_budget as parse
from ground.units import shown_tokens as shown

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from gateway.models import ApiKey

__all__ = ["PERIODS", "Status", "about", "parse", "period_end", "period_start", "shown", "spent", "status",
           "with_spent"]


class Status(TypedDict):
    """A key's budget as the API and the dashboard show it."""

    tokens: int
    period: str  # day, week or month
    spent: int  # in this period, as the database has it
    resets_at: dt.datetime


def period_start(period: str, now: dt.datetime) -> dt.datetime:
    """The start of the period `now` is in (UTC)."""
    now = now.astimezone(dt.UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day - dt.timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    raise ValueError(f"a budget period is one of {', '.join(PERIODS)}, not {period!r}")


def period_end(period: str, now: dt.datetime) -> dt.datetime:
    """When the period `now` is in ends, and the budget resets."""
    start = period_start(period, now)
    if period == "day":
        return start + dt.timedelta(days=1)
    if period == "week":
        return start + dt.timedelta(days=7)
    return (start + dt.timedelta(days=32)).replace(day=1)


def spent(key_id: int, period: str, now: dt.datetime) -> int:
    """Tokens the key used in the period `now` is in, as the database has them."""
    from django.db.models import Sum

    from gateway.models import Usage

    total = Usage.objects.filter(key_id=key_id, hour__gte=period_start(period, now)).aggregate(
        p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    return (total["p"] or 0) + (total["c"] or 0)


def with_spent(keys: QuerySet[ApiKey], now: dt.datetime) -> QuerySet[ApiKey]:
    """Keys (a queryset) with what each spent in its period as `budget_spent`, in the query that lists them:
    status() takes it from there instead of a query per key."""
    from django.db.models import BigIntegerField, Case, DateTimeField, F, OuterRef, Subquery, Sum, Value, When
    from django.db.models.functions import Coalesce

    from gateway.models import Usage

    starts = Case(*(When(budget_period=p, then=Value(period_start(p, now))) for p in PERIODS),
                  output_field=DateTimeField())
    used = (Usage.objects.filter(key=OuterRef("pk"), hour__gte=OuterRef("budget_start")).order_by().values("key")
            .annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))).values("total"))
    return keys.annotate(budget_start=starts).annotate(
        budget_spent=Coalesce(Subquery(used), Value(0), output_field=BigIntegerField()))


def status(key: ApiKey, now: dt.datetime) -> Status | None:
    """A key's budget as the API and the dashboard show it (None: it has none): tokens, period, spent in this
    period (as the database has it: the gateways' counts reach it within a minute), and when it resets."""
    if not key.budget_tokens or key.budget_period not in PERIODS:
        return None
    used = getattr(key, "budget_spent", None)  # with_spent's
    return {"tokens": key.budget_tokens, "period": key.budget_period,
            "spent": spent(key.id, key.budget_period, now) if used is None else used,
            "resets_at": period_end(key.budget_period, now)}
