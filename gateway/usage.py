"""Usage from Redis into the database: per key, model and hour; and each key's last use.

The web processes add to two hashes (gateway.accounting). A flush renames each (atomic: what arrives meanwhile
starts a new hash, for the next flush), writes what it took in one transaction, and only then deletes it: a batch
the database refused stays in Redis and the next flush takes it again. One flush at a time, under a lock, so no
batch is counted twice.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timezone

import redis
from django.db import transaction
from django.db.models import F, Q

from cluster.locks import redis_client
from gateway.accounting import LAST_USED_HASH, USAGE_HASH
from gateway.models import ApiKey, Usage

log = logging.getLogger("llmgw.gateway")
LOCK_KEY = "llmgw:usage:lock"
LOCK_TTL = 300
BATCH = ":flushing:"


def flush() -> int:
    """Move what the web processes counted into the database. Returns the usage rows written (0 while another
    flush runs)."""
    r = redis_client()
    lock = r.lock(LOCK_KEY, timeout=LOCK_TTL, blocking=False)
    if not lock.acquire():
        return 0
    try:
        return _flush(r)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # it expired under a very slow flush; nothing of ours to release
            pass


def _take(r, name: str) -> list[str]:
    """This flush's batch of the hash `name`, and any batch an earlier flush left behind."""
    try:
        r.rename(name, f"{name}{BATCH}{secrets.token_hex(4)}")
    except redis.exceptions.ResponseError:  # no such key: nothing counted since the last flush
        pass
    return sorted(k.decode() for k in r.scan_iter(match=f"{name}{BATCH}*", count=100))


def _flush(r) -> int:
    usage_batches = _take(r, USAGE_HASH)
    last_used_batches = _take(r, LAST_USED_HASH)
    if not usage_batches and not last_used_batches:
        return 0
    rows: dict[tuple[int, int, str], dict[str, int]] = {}
    for batch in usage_batches:
        for field, value in r.hgetall(batch).items():
            try:
                hour, key_id, rest = field.decode().split("|", 2)
                model, kind = rest.rsplit("|", 1)
                where, n = (int(hour), int(key_id), model), int(value)
            except ValueError:  # not ours; skipping it keeps one bad field from blocking every flush
                log.warning("usage: skipping the malformed field %r in %s", field, batch)
                continue
            counts = rows.setdefault(where, {})
            counts[kind] = counts.get(kind, 0) + n
    last_used: dict[int, float] = {}
    for batch in last_used_batches:
        for key_id, when in r.hgetall(batch).items():
            try:
                key_id, when = int(key_id), float(when)
            except ValueError:
                continue
            last_used[key_id] = max(when, last_used.get(key_id, 0.0))
    written = 0
    with transaction.atomic():
        wanted = {k for _, k, _ in rows} | set(last_used)
        existing = set(ApiKey.objects.filter(pk__in=wanted).values_list("pk", flat=True))  # deleted keys: dropped
        for (hour, key_id, model), counts in rows.items():
            if key_id not in existing:
                continue
            row, _ = Usage.objects.get_or_create(
                key_id=key_id, model=model, hour=datetime.fromtimestamp(hour, tz=timezone.utc)
            )
            Usage.objects.filter(pk=row.pk).update(
                requests=F("requests") + counts.get("requests", 0),
                prompt_tokens=F("prompt_tokens") + counts.get("prompt", 0),
                completion_tokens=F("completion_tokens") + counts.get("completion", 0),
            )
            written += 1
        for key_id, ts in last_used.items():
            if key_id in existing:
                when = datetime.fromtimestamp(ts, tz=timezone.utc)
                ApiKey.objects.filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=when), pk=key_id).update(
                    last_used_at=when
                )
    r.delete(*usage_batches, *last_used_batches)
    return written
