"""Aligned tables, sizes and ages for the terminal."""

from __future__ import annotations

import json
import sys
from datetime import datetime

from django.utils import timezone


def size(n: int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age(when: datetime | None, now: datetime | None = None) -> str:
    if when is None:
        return "never"
    seconds = int(((now or timezone.now()) - when).total_seconds())
    if seconds < 0:
        seconds = 0
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit}"
    return f"{seconds}s"


def table(headers: list[str], rows: list[list], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def as_json(data, out=None) -> None:
    (out or sys.stdout).write(json.dumps(data, indent=2, default=str) + "\n")
