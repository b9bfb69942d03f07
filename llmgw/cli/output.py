"""Aligned tables, sizes, ages and JSON for the terminal, from what the API answers (sizes and ages as
ground.units writes them everywhere). Django-free."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

from ground.units import format_age
from ground.units import format_size as size
from llmgw.cli.client import dumps

__all__ = ["age", "as_json", "moment", "size", "table"]


def moment(text: str | None) -> datetime | None:
    """An ISO 8601 time from the API (None stays None)."""
    if not text:
        return None
    when = datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def now() -> datetime:
    return datetime.now(UTC)


def age(when: str | datetime | None, at: datetime | None = None) -> str:
    """How long ago, as ground.units.format_age writes it; "never" for None."""
    if isinstance(when, str):
        when = moment(when)
    if when is None:
        return "never"
    return format_age(((at or now()) - when).total_seconds())


def table(headers: list[str], rows: list[list], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def as_json(data, out=None) -> None:
    """What the API answered, as JSON: `--json` is the API's own representation (its schema at /api/v1/schema/)."""
    (out or sys.stdout).write(dumps(data) + "\n")
