"""What every `llmgw` subcommand shares: one-line argument errors, and arguments parsed into one-line errors
(sizes, dates, durations). Django-free."""

from __future__ import annotations

import argparse
from datetime import datetime

from ground.units import parse_duration, parse_size
from llmgw.cli.client import CliError

# as cluster.operations and cluster.roles have them (tests/test_cli_remote.py checks they agree)
ROUTINGS = ("prefix", "least-inflight")
ROLES = ("admin", "operator", "viewer")
PRIORITIES = ("interactive", "standard", "batch")  # gateway.admission.CLASSES
DEFAULT_PRIORITY = "standard"
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_CHOICES = 8


class OneLineParser(argparse.ArgumentParser):
    """Argument errors are one line and exit code 1, like every other error. No abbreviations: argparse would
    take a typo (`--replica`) for the option it begins (`--replicas`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise CliError(f"{self.prog}: {message}")


def parse_size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def parse_when(text: str | None, flag: str) -> str | None:
    """A date (midnight) or a date and time, as ISO 8601 for the API; None for nothing given."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.strip().replace("z", "Z")).isoformat()
    except ValueError:
        raise CliError(f"{flag} wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, not {text!r}") from None


UNSET = object()  # an option not given, where None means something ("no cap")


def cap_arg(least: int):
    """A cap given as `N` (at least `least`) or `none` (no cap), for argparse: a bad value is its one-line error."""

    def parse(text: str) -> int | None:
        if text.strip().lower() == "none":
            return None
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or none") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {least}")
        return value

    return parse


max_tokens_arg = cap_arg(1)  # `--max-tokens N|none`
max_choices_arg = cap_arg(1)  # `--max-choices N|none`
max_logprobs_arg = cap_arg(0)  # `--max-logprobs N|none` (0: no log-probabilities at all)
limit_arg = cap_arg(1)  # a key's `--rpm N|none`, `--tpm N|none`, `--max-concurrency N|none`


def budget_arg(text: str) -> tuple[int, str] | None:
    """A key's `--budget 2M/day`: (tokens, period) as gateway.budgets parses it; `none`: no budget."""
    from ground.units import parse_budget as parse

    if text.strip().lower() == "none":
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def models_arg(text: str) -> list[str]:
    """A key's `--models qwen,smollm2`: the names, comma-separated (the server checks each); `all`: every model."""
    if text.strip().lower() == "all":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name models, comma-separated, or all")
    return names


def aliases_arg(text: str) -> list[str]:
    """`--alias claude-sonnet-4-5,gpt-5-codex`: the names, comma-separated (the server checks each); `''` or
    `none`: no aliases."""
    if text.strip().lower() == "none":
        return []
    return [alias.strip() for alias in text.split(",") if alias.strip()]


def serves_arg(text: str) -> list[str]:
    """`--serves chat,embeddings`: what a command engine serves, of ground.engines.CAPABILITIES; `''` or `none`:
    nothing declared (whatever a request asks)."""
    from ground.engines import CAPABILITIES

    if text.strip().lower() == "none":
        return []
    serves = [word.strip() for word in text.split(",") if word.strip()]
    for word in serves:
        if word not in CAPABILITIES:
            raise argparse.ArgumentTypeError(f"unknown capability {word!r} (known: {', '.join(CAPABILITIES)})")
    return serves


def duration_arg(text: str) -> int:
    """`--idle-after 15m`: seconds, for argparse (a bad value is its one-line error)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def or_default(parse):
    """An option that also takes `default`: None, the cluster's default (`--queue-limit N|default`)."""

    def parse_or_default(text: str):
        if text.strip().lower() == "default":
            return None
        return parse(text)

    return parse_or_default


def _queue_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or default") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


queue_limit_arg = or_default(_queue_limit)  # `--queue-limit N|default`
max_wait_arg = or_default(duration_arg)  # `--max-wait 30s|default`


def percent_arg(text: str) -> float:
    """A share given as a percent, `10%` or `10` alike (both ten percent; `0.5` is half a percent), for argparse:
    the fraction the API takes (0.1), from 0% to 100%."""
    number = text.strip().removesuffix("%").strip()
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percent (write e.g. 10%)") from None
    if not 0 <= value <= 100:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: a percent from 0% to 100%")
    return round(value / 100, 6)


def ratio_arg(text: str) -> float:
    """`--max-ttft-ratio 1.5`: a ratio of the canary's median to the current replicas' (1 to 1000)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 1.5)") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r}: a ratio from 1 to 1000")
    return value
