"""A change that adds many replicas at once is confirmed first: a typo (`--replicas 1000` for 10) once started
every engine the memory allowed and took the cluster down.

The rule: a model's ceiling is the most replicas it may run (its fixed count, or its autoscaled maximum); a
change (adding a model, or setting its replicas or range) that raises the ceiling by more than CONFIRM_ABOVE
asks to be confirmed: `--yes` on the CLI, a second click on the dashboard. The REST API takes what it is sent
as meant (a program asked for it).

A leaf, Django-free: the CLI (an HTTP client, installed on laptops without the server) applies the same rule
to what it is about to send as the dashboard (cluster.operations.confirmation_needed) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONFIRM_ABOVE = 8


def ceiling(replicas: int | None, min_replicas: int | None, max_replicas: int | None) -> int:
    """The most replicas a model of these values may run."""
    if min_replicas is None and max_replicas is None:
        return replicas if replicas is not None else 1
    return max(min_replicas or 0, max_replicas or 0)


def ceiling_after(current: Mapping[str, Any] | None, values: Mapping[str, Any]) -> int:
    """The model's ceiling once `values` (a change's fields: replicas, min_replicas, max_replicas) apply to
    `current` (the model's fields now; None: a new model)."""
    current = current or {}
    if values.get("replicas") is not None:  # a fixed count (an autoscaled model becomes fixed)
        return int(values["replicas"])
    low, high = values.get("min_replicas"), values.get("max_replicas")
    if low is None and high is None:
        if not current:
            return 1  # a new model's default
        return ceiling(current.get("replicas"), current.get("min_replicas"), current.get("max_replicas"))
    low = low if low is not None else current.get("min_replicas")
    high = high if high is not None else current.get("max_replicas")
    return max(low or 0, high or 0)


def replicas_added(current: Mapping[str, Any] | None, values: Mapping[str, Any]) -> int:
    """How many replicas the change may add at once (0 when it adds none)."""
    before = 0 if not current else ceiling(current.get("replicas"), current.get("min_replicas"),
                                           current.get("max_replicas"))
    return max(0, ceiling_after(current, values) - before)


def needs_confirmation(current: Mapping[str, Any] | None, values: Mapping[str, Any]) -> str:
    """'' when the change may go ahead as it is; else why it is confirmed first, in a line."""
    added = replicas_added(current, values)
    if added <= CONFIRM_ABOVE:
        return ""
    return (f"this adds up to {added} replicas at once (to {ceiling_after(current, values)}); more than "
            f"{CONFIRM_ABOVE} at once is confirmed first")
