"""What every operation checks its input with: names, counts, and finding a row by name."""

from __future__ import annotations

import re

from django.db import IntegrityError, transaction

from cluster.errors import Conflict, NotFound, OperationError
from cluster.models import NAME_HINT, NAME_RE

MAX_REPLICAS = 1000
MAX_MEMORY = 2**50  # a PiB: anything above is a typo
INT_MAX = 2**31 - 1


def check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_RE, name):  # fullmatch: `$` would let "a\n" in
        raise OperationError(
            f"invalid {kind} name {name!r}: use {NAME_HINT}"
        )


def get_named(model_cls, kind: str, name: str):
    try:
        return model_cls.objects.get(name=name)
    except model_cls.DoesNotExist:
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
