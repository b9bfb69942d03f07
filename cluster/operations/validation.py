"""What every operation checks its input with: names, counts, and finding a row by name."""

from __future__ import annotations

import re

from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from cluster.errors import Conflict, NotFound, OperationError
from cluster.models import NAME_HINT, NAME_RE

MAX_REPLICAS = 1000
MAX_MEMORY = 2**50  # a PiB: anything above is a typo
MAX_QUEUE_LIMIT = 100_000  # requests that may wait for a model's slots (its own bound, or the cluster's default)
MAX_WAIT_SECONDS = 3600  # seconds a request may wait for a slot
INT_MAX = 2**31 - 1


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


def check_count(label: str, value, minimum: int = 0, maximum: int = INT_MAX) -> int:
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
