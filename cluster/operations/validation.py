"""What every operation checks its input with: names, counts, and finding a row by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict

from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from cluster.errors import Conflict, NotFound, OperationError
from cluster.models import NAME_HINT, NAME_RE
from ground.units import MAX_DURATION

MAX_REPLICAS = 1000
MAX_MEMORY = 2**50  # a PiB: anything above is a typo
MAX_QUEUE_LIMIT = 100_000  # requests that may wait for a model's slots (its own bound, or the cluster's default)
MAX_WAIT_SECONDS = 3600  # seconds a request may wait for a slot
INT_MAX = 2**31 - 1
DAY = 86400


class Limits(TypedDict):
    """A range as DRF's and Django's IntegerField both take it."""

    min_value: int
    max_value: int


@dataclass(frozen=True)
class Bounds:
    """The one rule for a whole number an operator gives: from `low` to `high`. The operations check it (`check`,
    whose refusal the dashboard's form shows as it is), and the API's serializer fields take it as their range
    (`limits`, which the schema publishes), so the three front doors refuse the same numbers."""

    low: int
    high: int = INT_MAX

    @property
    def limits(self) -> Limits:
        return {"min_value": self.low, "max_value": self.high}

    def check(self, label: str, value: object) -> int:
        return check_count(label, value, self.low, self.high)


# A model's
REPLICAS = Bounds(0, MAX_REPLICAS)  # fixed, and an autoscaled model's least (0: on demand)
MOST_REPLICAS = Bounds(1, MAX_REPLICAS)  # an autoscaled model's most
MEMORY = Bounds(0, MAX_MEMORY)  # per replica; 0: estimated from the file
WAIT_SECONDS = Bounds(0, 3600)
TARGET_INFLIGHT = Bounds(1, 10_000)
QUEUE_LIMIT = Bounds(1, MAX_QUEUE_LIMIT)  # also the cluster's default
MAX_WAIT = Bounds(1, MAX_WAIT_SECONDS)  # also the cluster's default
RESUME_LIMIT = Bounds(0, 10)  # times one answer may be resumed on another replica (0: never)
STREAM_IDLE_TIMEOUT = Bounds(1, 3600)  # seconds a streaming engine may send nothing before its answer is resumed
MAX_TOKENS = Bounds(1)
MAX_LOGPROBS = Bounds(0)  # 0: a request may ask for none
MAX_CHOICES = Bounds(1)
SCALING_SECONDS = Bounds(0, MAX_DURATION)  # idle after, scale-down delay
# The cluster's settings
DRAIN_GRACE = Bounds(0, DAY)
RECONCILE_INTERVAL = Bounds(1, 3600)
MIN_RESIDENT = Bounds(0, DAY)


def check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_RE, name):  # fullmatch: `$` would let "a\n" in
        raise OperationError(
            f"invalid {kind} name {name!r}: use {NAME_HINT}"
        )


def get_named(model_cls, kind: str, name: str):
    """The row named `name` of a model class (or of a queryset, e.g. one locked for update); NotFound if none."""
    rows = model_cls if isinstance(model_cls, QuerySet) else model_cls.objects
    try:
        return rows.get(name=name)
    except rows.model.DoesNotExist:
        raise NotFound(f"no {kind} named {name!r}") from None


def check_count(label: str, value: object, minimum: int = 0, maximum: int = INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise OperationError(f"{label} must be a whole number from {minimum} to {maximum}, not {value!r}")
    return value


def created(refusal: str, create):
    """`create()` in a savepoint: a unique name taken meanwhile by another process (two adds at once, each
    having checked first) is the one-line refusal, not an IntegrityError; the outer transaction goes on."""
    try:
        with transaction.atomic():
            return create()
    except IntegrityError:
        raise Conflict(refusal) from None
