"""Sizes and durations as operators write and read them: "2GiB" in, "2.0 GiB" out, "3h" for an age.

A leaf: the agent program, the planner's reasons, the CLI and the dashboard all format with these, so the same
number reads the same everywhere (binary units, named as such: KiB, MiB, GiB, TiB).
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BINARY = ("KiB", "MiB", "GiB", "TiB")


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G" (decimal) or "1073741824"."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 2GiB, 512MiB, 1.5G or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int | float | None) -> str:
    """"512 B", "316.5 MiB", "2.0 GiB", "1.5 TiB"; "-" for None."""
    if n is None:
        return "-"
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in _BINARY:
        value /= 1024
        if abs(value) < 1024 or unit == _BINARY[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_age(seconds: float) -> str:
    """How long, short: "12s", "4m", "3h", "2d" (whole units, rounded down; never negative)."""
    seconds = max(0, int(seconds))
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit}"
    return f"{seconds}s"


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|)\s*$", re.IGNORECASE)
_SPANS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION = 30 * 86400


def parse_duration(text: str | int) -> int:
    """Whole seconds from "90s", "15m", "2h", "1d" or "300" (seconds), at most 30 days."""
    if isinstance(text, int) and not isinstance(text, bool):
        seconds = text
    else:
        match = _DURATION_RE.match(str(text))
        if not match:
            raise ValueError(f"not a duration: {str(text)[:40]!r} (write e.g. 90s, 15m, 2h or a number of seconds)")
        seconds = int(float(match.group(1)) * _SPANS[match.group(2).lower()])
    if not 0 <= seconds <= MAX_DURATION:
        raise ValueError(f"a duration from 0 to 30 days, not {seconds} seconds")
    return seconds


def format_duration(seconds: int | float) -> str:
    """The duration as an operator writes it: "90s", "15m", "2h", "1d", or "1h30m"."""
    seconds = max(0, int(seconds))
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span and seconds % span == 0:
            return f"{seconds // span}{unit}"
    if seconds >= 3600 and seconds % 60 == 0:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds}s"


# A key's token budget in text (`2M/day`): what the CLI parses and shows, and the gateway enforces
# (gateway/budgets.py); here, Django-free, in every install's wheel.
BUDGET_PERIODS = ("day", "week", "month")


def parse_budget(text: str) -> tuple[int, str]:
    """`2M/day`, `500000/week`, `1.5G/month`: (tokens, period); ValueError with a one-line message."""
    amount, slash, period = text.strip().partition("/")
    period = period.strip().lower()
    if not slash or period not in BUDGET_PERIODS:
        raise ValueError(f"a budget is TOKENS/PERIOD with PERIOD one of {', '.join(BUDGET_PERIODS)}, e.g. 2M/day, "
                         f"not {text!r}")
    amount = amount.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(amount[-1:], 1)
    number = amount[:-1] if scale > 1 else amount
    try:
        tokens = int(float(number) * scale) if "." in number else int(number) * scale
    except ValueError:
        raise ValueError(f"a budget's tokens are a number (with K, M or G), not {amount!r}") from None
    if tokens < 1:
        raise ValueError(f"a budget is at least 1 token, not {text!r}")
    return tokens, period


def shown_tokens(tokens: int) -> str:
    """2000000 -> 2M; 1500 -> 1.5K."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= scale:
            value = tokens / scale
            return f"{value:g}{unit}" if value == round(value, 3) else f"{tokens}"
    return str(tokens)


def about(tokens: int) -> str:
    """A figure at a glance, rounded: 123456 -> 123K, 1234567 -> 1.2M (what a key spent; shown_tokens is exact)."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= scale - scale // 2000:  # 999.5K is 1M, not 1000K
            value = tokens / scale
            return f"{value:.1f}".removesuffix(".0") + unit if value < 9.95 else f"{value:.0f}{unit}"
    return str(tokens)
