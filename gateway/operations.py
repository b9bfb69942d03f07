"""Client keys for /v1/ and the usage they run up: created (the secret shown once), changed, revoked, reported.

Operations like cluster.operations: each validates, changes state in one transaction, writes an Event, and
tells every web process's gateway to reload its routing table after commit.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypedDict

from django.db import transaction
from django.db.models import F, Sum
from django.db.models.functions import TruncDay
from django.utils import timezone

from cluster import notify
from cluster.errors import Conflict, NotFound, OperationError
from cluster.events import record
from cluster.models import Model
from cluster.operations.validation import Bounds, check_name, created, get_named
from gateway import budgets
from gateway.admission import CLASSES, DEFAULT_CLASS
from gateway.models import USAGE_BY, ApiKey, Usage

# what set_key changes
KEY_SETTINGS = ("priority", "rpm", "tpm", "max_tokens", "models", "expires_at", "budget_tokens", "budget_period",
                "max_concurrency", "log_bodies")
# the settings counted alike, with their names in a refusal
COUNTS: tuple[tuple[Literal["rpm", "tpm", "max_tokens"], str], ...] = (
    ("rpm", "rpm"), ("tpm", "tpm"), ("max_tokens", "max tokens"))
# a key's limits: requests and tokens per minute, a completion's tokens; requests at once; budget tokens
KEY_LIMIT = Bounds(1)
CONCURRENCY = Bounds(1, 100_000)
BUDGET_TOKENS = Bounds(1, 10**15)


class KeyFields(TypedDict, total=False):
    """ApiKey's fields as the operations set them, checked."""

    priority: str
    rpm: int | None
    tpm: int | None
    max_tokens: int | None
    allowed_models: list[str]
    expires_at: datetime | None
    max_concurrency: int | None
    budget_tokens: int | None
    budget_period: str
    log_bodies: bool


# and the CSV's header
USAGE_COLUMNS = ("key", "model", "hour", "requests", "prompt_tokens", "completion_tokens", "resumed_prompt_tokens")


class UsageRow(TypedDict):
    key: str
    model: str
    hour: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int
    resumed_prompt_tokens: int  # the prompts of its answers' resumes on other replicas: the fleet's cost, not the key's


def _check_budget(tokens: int | str | None, period: str | None, had_period: str = "") -> KeyFields:
    """The budget's fields from what was given (None: not given; tokens 0 or "" : no budget)."""
    if tokens is None and period is None:
        return {}
    if tokens in (0, "") or (tokens is None and period == ""):
        return {"budget_tokens": None, "budget_period": ""}
    period = period if period is not None else had_period
    if period not in budgets.PERIODS:
        raise OperationError(f"a budget's period is one of {', '.join(budgets.PERIODS)}, not {str(period)[:20]!r}")
    clean: KeyFields = {"budget_period": period}
    if tokens is not None:
        clean["budget_tokens"] = BUDGET_TOKENS.check("budget tokens", tokens)
    return clean


def _check_priority(priority: object) -> str:
    if not isinstance(priority, str) or priority not in CLASSES:
        raise OperationError(f"priority is one of {', '.join(CLASSES)}, not {str(priority)[:40]!r}")
    return priority


def _check_models(models: object) -> list[str]:
    if not isinstance(models, (list, tuple)) or not all(isinstance(m, str) for m in models):
        raise OperationError("models must be a list of model names")
    for model_name in models:
        check_name("model", model_name)
    return sorted(set(models))


def _check_log_bodies(log_bodies: object) -> bool:
    if not isinstance(log_bodies, bool):  # a real bool: "false" or 0 from a careless front door would mislead
        raise OperationError(f"log_bodies is true or false, not {str(log_bodies)[:40]!r}")
    return log_bodies


def _check_expiry(expires_at: datetime | None) -> datetime | None:
    if expires_at is not None and expires_at <= timezone.now():
        raise OperationError(f"the expiry {expires_at:%Y-%m-%d %H:%M} is in the past")
    return expires_at


def _check_models_exist(models: list[str]) -> None:
    known = set(Model.objects.filter(name__in=models).values_list("name", flat=True))
    missing = [m for m in models if m not in known]
    if missing:  # a typo would make a key for no model at all
        raise NotFound(f"no model{'s' if len(missing) > 1 else ''} named {', '.join(map(repr, missing))}")


def create_key(
    name: str,
    actor: str,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    expires_at: datetime | None = None,
    max_tokens: int | None = None,
    priority: str = DEFAULT_CLASS,
    budget_tokens: int | None = None,
    budget_period: str | None = None,
    max_concurrency: int | None = None,
    log_bodies: bool = False,
) -> tuple[ApiKey, str]:
    """A new client key for /v1/. The secret is returned once and stored only as a hash."""
    check_name("key", name)
    models = _check_models(models or [])
    if rpm is not None:
        KEY_LIMIT.check("rpm", rpm)
    if tpm is not None:
        KEY_LIMIT.check("tpm", tpm)
    if max_tokens is not None:
        KEY_LIMIT.check("max tokens", max_tokens)
    _check_priority(priority)
    _check_expiry(expires_at)
    budget = _check_budget(budget_tokens, budget_period)
    if budget.get("budget_period") and not budget.get("budget_tokens"):
        raise OperationError("a budget needs its tokens, e.g. 2M/day")
    if max_concurrency is not None:
        CONCURRENCY.check("max concurrency", max_concurrency)
    _check_log_bodies(log_bodies)
    secret = ApiKey.new_secret()
    with transaction.atomic():
        if ApiKey.objects.filter(name=name).exists():
            raise Conflict(f"a key named {name!r} already exists")
        _check_models_exist(models)
        key: ApiKey = created(f"a key named {name!r} already exists", lambda: ApiKey.objects.create(
            name=name,
            prefix=secret[:14],
            key_hash=ApiKey.hash(secret),
            allowed_models=models,
            rpm=rpm,
            tpm=tpm,
            max_tokens=max_tokens,
            priority=priority,
            expires_at=expires_at,
            max_concurrency=max_concurrency,
            log_bodies=log_bodies,
            **budget,
        ))
        limits = ", ".join(
            part
            for part in (
                f"models {', '.join(models)}" if models else "all models",
                f"{rpm} requests/min" if rpm else "",
                f"{tpm} tokens/min" if tpm else "",
                f"at most {max_tokens} tokens per completion" if max_tokens else "",
                f"expires {expires_at:%Y-%m-%d %H:%M}" if expires_at else "",
                f"priority {priority}" if priority != DEFAULT_CLASS else "",
                _setting_shown("budget_tokens", key.budget_tokens, key.budget_period) if key.budget_tokens else "",
                f"at most {max_concurrency} requests at once" if max_concurrency else "",
                _setting_shown("log_bodies", True) if log_bodies else "",  # off, the default, goes unsaid
            )
            if part
        )
        record("key.created", actor, f"key {name} ({key.prefix}…) created: {limits}", subject=name)
        notify.routing_changed()
    return key, secret


def set_key(name: str, actor: str, **values: Any) -> ApiKey:
    """Change what is given of KEY_SETTINGS; what is left out stays. None for rpm, tpm, max_tokens or expires_at
    is no limit (never expires); an empty (or None) models list is every model. A revoked key stays as it is.
    `values` as a front door parsed them: each is checked here."""
    unknown = sorted(set(values) - set(KEY_SETTINGS))
    if unknown:
        raise OperationError(f"a key has no setting {', '.join(unknown)} (it has {', '.join(KEY_SETTINGS)})")
    clean: KeyFields = {}
    if "priority" in values:
        clean["priority"] = _check_priority(values["priority"])
    for count, label in COUNTS:
        if count in values:
            clean[count] = None if values[count] is None else KEY_LIMIT.check(label, values[count])
    if "models" in values:
        clean["allowed_models"] = _check_models(values["models"] or [])
    if "expires_at" in values:
        clean["expires_at"] = _check_expiry(values["expires_at"])
    if "max_concurrency" in values:
        n = values["max_concurrency"]
        clean["max_concurrency"] = None if n is None else CONCURRENCY.check("max concurrency", n)
    if "log_bodies" in values:
        clean["log_bodies"] = _check_log_bodies(values["log_bodies"])
    with transaction.atomic():
        key: ApiKey = get_named(ApiKey.objects.select_for_update(), "key", name)
        if key.revoked_at is not None:
            raise Conflict(f"key {name} is revoked: create a new one")
        if "budget_tokens" in values or "budget_period" in values:
            clean.update(_check_budget(values.get("budget_tokens"), values.get("budget_period"), key.budget_period))
            if clean.get("budget_period") and not (clean.get("budget_tokens") or key.budget_tokens):
                raise OperationError("a budget needs its tokens, e.g. 2M/day")
        if "allowed_models" in clean:
            _check_models_exist(clean["allowed_models"])
        changed = {field: value for field, value in clean.items() if getattr(key, field) != value}
        if not changed:
            return key
        # conditional: a revocation that commits meanwhile wins, and this change is refused
        if not ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(**changed):
            raise Conflict(f"key {name} is revoked: create a new one")
        for field, value in changed.items():
            setattr(key, field, value)
        shown = ", ".join(_setting_shown(field, value, key.budget_period) for field, value in changed.items()
                          if field != "budget_period" or "budget_tokens" not in changed)
        record("key.edited", actor, f"key {name} ({key.prefix}…) edited: {shown}", subject=name)
        notify.routing_changed()
    return key


def _setting_shown(field: str, value: object, period: str = "") -> str:
    """A changed setting in the key.edited Event, in the key.created Event's words: `rpm no limit`, `all models`."""
    if field in ("budget_tokens", "budget_period"):
        tokens = value if field == "budget_tokens" and isinstance(value, int) else None
        if field == "budget_period":
            return f"budget per {value}" if value else "no budget"
        return f"budget {budgets.shown(tokens)}/{period}" if tokens else "no budget"
    if field == "max_concurrency":
        return f"at most {value} requests at once" if value else "requests at once no limit"
    if field == "log_bodies":
        return "bodies logged" if value else "bodies not logged"
    if field == "allowed_models" and isinstance(value, list):
        return f"models {', '.join(value)}" if value else "all models"
    if field == "expires_at":
        return f"expires {value:%Y-%m-%d %H:%M}" if value else "never expires"
    label = {"max_tokens": "max tokens"}.get(field, field)
    if value is None:
        return f"{label} the model's" if field == "max_tokens" else f"{label} no limit"
    return f"{label} {value}"


def revoke_key(name: str, actor: str) -> ApiKey:
    with transaction.atomic():
        key: ApiKey = get_named(ApiKey, "key", name)
        if key.revoked_at is not None:
            raise Conflict(f"key {name} is already revoked")
        now = timezone.now()
        # conditional: of two revocations at once, one revokes and the other is told it is already revoked
        if not ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now):
            raise Conflict(f"key {name} is already revoked")
        key.revoked_at = now
        record("key.revoked", actor, f"key {name} ({key.prefix}…) revoked", subject=name)
        notify.routing_changed()
    return key


def usage_report(key: str | None = None, model: str | None = None, since: datetime | None = None, by: str = "hour",
                 limit: int | None = 5000) -> list[UsageRow]:
    """Requests and tokens per key, model and hour, newest first; `by="day"`: per day (its `hour` the day's start,
    UTC). At most `limit` rows (None: every row, as the dashboard's plots sum them)."""
    if by not in USAGE_BY:
        raise OperationError(f"usage is summed by {' or '.join(USAGE_BY)}, not {by!r}")
    rows = Usage.objects.all()
    if key:
        if not ApiKey.objects.filter(name=key).exists():
            raise NotFound(f"no key named {key!r}")
        rows = rows.filter(key__name=key)
    if model:
        rows = rows.filter(model=model)
    if since:
        rows = rows.filter(hour__gte=since.replace(minute=0, second=0, microsecond=0))
    start = TruncDay("hour", tzinfo=UTC) if by == "day" else F("hour")
    summed = (rows.annotate(start=start).values("key__name", "model", "start")
              .annotate(r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"),
                        f=Sum("resumed_prompt_tokens"))
              .order_by("-start", "key__name", "model"))
    return [
        {
            "key": r["key__name"],
            "model": r["model"],
            "hour": r["start"],
            "requests": r["r"],
            "prompt_tokens": r["p"],
            "completion_tokens": r["c"],
            "resumed_prompt_tokens": r["f"],
        }
        for r in (summed if limit is None else summed[:limit])
    ]


def usage_csv(rows: Iterable[Mapping[str, object]]) -> str:
    """Usage rows (usage_report's, or the API's as serialized) as CSV: the header row, then a row each; an hour in
    ISO 8601 UTC as the API writes it (2026-12-05T10:00:00Z)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(USAGE_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(row[column]) for column in USAGE_COLUMNS])
    return out.getvalue()


def _csv_value(value: object) -> object:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return value
