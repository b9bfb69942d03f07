"""What every `llmgw` subcommand shares: one-line argument errors, the actor its changes are recorded under, and
arguments parsed into one-line errors (sizes, dates)."""

from __future__ import annotations

import argparse
import socket
from datetime import date, datetime, time as dtime

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from agents.facts import parse_size
from agents.units import parse_duration

CLI_ACTOR = "cli"


class OneLineParser(CommandParser):
    """Argument errors are one line and exit code 1, like every other error."""

    def error(self, message):
        raise CommandError(f"{self.prog}: {message}")


def parse_size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def server_url() -> str:
    return settings.LLMGW_PUBLIC_URL or f"http://{socket.gethostname()}:8000"


def parse_when(text: str | None, flag: str):
    """A date (midnight) or a date and time, timezone-aware; None for nothing given."""
    if not text:
        return None
    when = parse_datetime(text)
    if when is None:
        try:
            when = datetime.combine(date.fromisoformat(text), dtime.min)
        except ValueError:
            raise CommandError(f"{flag} wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, not {text!r}") from None
    return timezone.make_aware(when) if timezone.is_naive(when) else when


UNSET = object()  # an option not given, where None means something ("no cap")


def max_tokens_arg(text: str) -> int | None:
    """`--max-tokens N` or `none` (no cap), for argparse: a bad value is its one-line error."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or none") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def duration_arg(text: str) -> int:
    """`--idle-after 15m`: seconds, for argparse (a bad value is its one-line error)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
