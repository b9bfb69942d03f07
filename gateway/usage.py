"""Usage into the database: per key, model and hour, and each key's last use; written by every web process once a
second (gateway/runtime.py), in one transaction, never a write per request.

What a process counted stays in the process until its write commits: a write the database refused (a lock, a
failover) is tried again with whatever came since. The keys' budgets are held to this (gateway/spend.py): after
writing, the spend of each budget the write touched is read back in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from django.db import transaction
from django.db.models import F, Q

from gateway import budgets
from gateway.models import ApiKey, Usage


def record(rows: dict[tuple[int, int, str], list[int]], last_used: dict[int, float],
           spends: Iterable[tuple[int, str, datetime]] = ()) -> dict[tuple[int, str, datetime], int]:
    """Add `rows` ((hour, key id, model) -> [requests, prompt tokens, completion tokens, resumed prompt tokens]) to
    the usage, set each key's last use, and read back what each of `spends` ((key id, period, start)) has spent. A deleted key's
    usage is dropped."""
    with transaction.atomic():
        wanted = {k for _, k, _ in rows} | set(last_used)
        existing = set(ApiKey.objects.filter(pk__in=wanted).values_list("pk", flat=True))
        for (hour, key_id, model), (requests, prompt, completion, resumed) in rows.items():
            if key_id not in existing:
                continue
            row, _ = Usage.objects.get_or_create(
                key_id=key_id, model=model, hour=datetime.fromtimestamp(hour, tz=UTC))
            Usage.objects.filter(pk=row.pk).update(
                requests=F("requests") + requests, prompt_tokens=F("prompt_tokens") + prompt,
                completion_tokens=F("completion_tokens") + completion,
                resumed_prompt_tokens=F("resumed_prompt_tokens") + resumed)
        for key_id, ts in last_used.items():
            if key_id in existing:
                when = datetime.fromtimestamp(ts, tz=UTC)
                ApiKey.objects.filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=when), pk=key_id).update(
                    last_used_at=when)
        return {(key_id, period, start): budgets.spent(key_id, period, start) for key_id, period, start in spends}
