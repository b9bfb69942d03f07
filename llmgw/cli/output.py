"""Aligned tables, sizes and ages for the terminal (sizes and ages as agents.units writes them everywhere)."""

from __future__ import annotations

import json
import sys
from datetime import datetime

from django.utils import timezone

from agents.units import format_age, format_size as size

__all__ = ["age", "as_json", "size", "table"]


def age(when: datetime | None, now: datetime | None = None) -> str:
    """How long ago, as agents.units.format_age writes it; "never" for None."""
    if when is None:
        return "never"
    return format_age(((now or timezone.now()) - when).total_seconds())


def table(headers: list[str], rows: list[list], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def as_json(data, out=None) -> None:
    (out or sys.stdout).write(json.dumps(data, indent=2, default=str) + "\n")
