"""SQLite's "database is locked": a write that waited its busy timeout out is tried again, whole, for a while.

The embedded control plane keeps everything in one SQLite file (WAL, a busy timeout, transactions that take
the write lock as they begin: llmgw/settings.py). One writer at a time: a long write (a reconciler run placing
hundreds of replicas on a starved machine) can hold the lock past another's busy timeout. An agent's report
that fails so must not be lost, or its node, silent, is marked disconnected and then lost, and every replica on
it fails: the agents' writes (cluster.reports) are tried again here until LOCK_RETRY_SECONDS have passed.
"""

from __future__ import annotations

import functools
import logging
import random
import time

from django.db import OperationalError, connection

log = logging.getLogger("llmgw.db")

LOCK_RETRY_SECONDS = 120.0  # beyond the node-lost grace (60 s): a lock that long is a fault to see, not to hide
LOCKED = ("database is locked", "database table is locked")


def is_lock(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and any(text in str(exc) for text in LOCKED)


def retry_on_lock(func):
    """Call `func` again (a fresh transaction each time) while SQLite says the database is locked. Inside a
    transaction of the caller's, nothing is tried again: the caller's transaction is what failed."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        deadline = time.monotonic() + LOCK_RETRY_SECONDS
        delay = 0.05
        tries = 0
        while True:
            try:
                return func(*args, **kwargs)
            except OperationalError as exc:
                if not is_lock(exc) or connection.in_atomic_block or time.monotonic() >= deadline:
                    raise
                tries += 1
                if tries == 1 or tries % 20 == 0:
                    log.warning("%s: %s; trying again (%d)", func.__qualname__, exc, tries)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(1.0, delay * 2)

    return wrapper
