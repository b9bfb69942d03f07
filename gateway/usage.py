"""Usage from Redis into the database: per key, model and hour; and each key's last use."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone

from django.db import transaction
from django.db.models import F

from cluster.locks import redis_client
from gateway.accounting import LAST_USED_HASH, USAGE_HASH
from gateway.models import ApiKey, Usage


def flush() -> int:
    """Move what the web processes counted into the database. Returns the rows touched."""
    r = redis_client()
    moving = f"{USAGE_HASH}:flushing:{secrets.token_hex(4)}"
    rows: dict[tuple[int, int, str], dict[str, int]] = {}
    try:
        r.rename(USAGE_HASH, moving)  # atomic: counts arriving meanwhile start a new hash
    except Exception:  # nothing to move (no such key)
        moving = None
    if moving:
        for field, value in r.hgetall(moving).items():
            hour, key_id, rest = field.decode().split("|", 2)
            model, kind = rest.rsplit("|", 1)
            rows.setdefault((int(hour), int(key_id), model), {})[kind] = int(value)
    last_used = {int(k): float(v) for k, v in r.hgetall(LAST_USED_HASH).items()}
    existing = set(ApiKey.objects.filter(pk__in={k for _, k, _ in rows} | set(last_used)).values_list("pk", flat=True))
    with transaction.atomic():
        for (hour, key_id, model), counts in rows.items():
            if key_id not in existing:
                continue
            when = datetime.fromtimestamp(hour, tz=timezone.utc)
            row, _ = Usage.objects.get_or_create(key_id=key_id, model=model, hour=when)
            Usage.objects.filter(pk=row.pk).update(
                requests=F("requests") + counts.get("requests", 0),
                prompt_tokens=F("prompt_tokens") + counts.get("prompt", 0),
                completion_tokens=F("completion_tokens") + counts.get("completion", 0),
            )
        for key_id, ts in last_used.items():
            if key_id in existing:
                ApiKey.objects.filter(pk=key_id).update(last_used_at=datetime.fromtimestamp(ts, tz=timezone.utc))
    if moving:
        r.delete(moving)
    if last_used:
        r.hdel(LAST_USED_HASH, *[str(k) for k in last_used])
    return len(rows)
