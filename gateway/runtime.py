"""The gateway's per-process state: the routing table cache, in-flight counts, the upstream HTTP pool.

One instance per event loop (daphne runs one loop per process). In-flight counts are shared across web
processes through Redis: each process keeps its own counts in a hash that expires unless the process keeps it
alive, so a process that dies takes its counts with it instead of leaking them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import secrets
import socket
import time
import weakref
from collections import Counter

import aiohttp
import redis.asyncio as aioredis
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from gateway import table as routing
from gateway.accounting import Ledger

log = logging.getLogger("llmgw.gateway")
GROUP = "gateway"
INFLIGHT_PREFIX = "llmgw:inflight:"
INFLIGHT_TTL = 15  # seconds a dead process's counts survive it
FLUSH_INTERVAL = 0.25
SHARED_INTERVAL = 1.0

_runtimes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime() -> Gateway:
    loop = asyncio.get_running_loop()
    gw = _runtimes.get(loop)
    if gw is None:
        gw = _runtimes[loop] = Gateway()
    return gw


def _background(coro) -> asyncio.Task:
    """A task of the process, not of the request that happened to start it: in a context of its own, so it holds
    nothing of that request's (under Django's default handler, a thread pool that is gone once the request is)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class Gateway:
    def __init__(self):
        self.table: routing.Table | None = None
        self.changed = asyncio.Condition()
        self._refreshing: asyncio.Task | None = None
        self._first_load: asyncio.Task | None = None
        self._stale = True
        self.local: Counter[str] = Counter()
        self.shared: dict[str, int] = {}
        self._dirty = True
        self.proc_key = f"{INFLIGHT_PREFIX}{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=3)
        # aiohttp, not httpx: on this project's 2-core test machine httpx spent 1.7 ms of CPU per proxied request
        # at concurrency 1 and 4 ms at 64 (its connection pool walks every connection per request); aiohttp
        # 0.4 and 0.3 (bench/README.md)
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=False),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=settings.LLMGW_UPSTREAM_CONNECT_TIMEOUT, sock_read=settings.LLMGW_UPSTREAM_TIMEOUT
            ),
            auto_decompress=False,  # the engine's bytes go to the client as they are
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            trust_env=False,
        )
        self._tasks: list[asyncio.Task] = []
        self._spawned: set[asyncio.Task] = set()
        self.ledger = Ledger()
        self._unknown_key_reload = 0.0

    def spawn(self, coro) -> None:
        """Run `coro` in the background, holding on to it until it ends (the loop keeps only weak references)."""
        task = _background(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def aclose(self) -> None:
        """Stop this process's gateway: its background tasks, upstream pool and Redis client (tests; shutdown)."""
        # cancelled again until they end: redis-py's asyncio client now and then swallows a cancellation
        while not all(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=0.5)
        await self.http.close()
        await self.redis.aclose()

    def may_reload_for_unknown_key(self) -> bool:
        """At most one reload a second for keys this process has not seen (not one per bad request)."""
        now = time.monotonic()
        if now - self._unknown_key_reload < 1.0:
            return False
        self._unknown_key_reload = now
        return True

    # the routing table

    async def current(self) -> routing.Table:
        if self.table is None:
            # the first requests of a process share one load (not one each) and start the background tasks once
            # in this request's context: under sync middleware its database work must run on the request's thread
            if self._first_load is None or self._first_load.done():
                self._first_load = asyncio.get_running_loop().create_task(self.refresh())
            await asyncio.shield(self._first_load)
            if not self._tasks:
                self._start_background()
        elif self._stale or time.monotonic() - self.table.loaded_at > settings.LLMGW_GATEWAY_REFRESH:
            self._refresh_soon()
        return self.table

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = _background(self.refresh())

    async def refresh(self) -> None:
        self._stale = False
        try:
            table = await database_sync_to_async(routing.load)()
        except Exception:  # keep routing with what we had; the timer tries again
            log.exception("could not refresh the routing table")
            if self.table is None:
                raise
            return
        self.table = table
        async with self.changed:
            self.changed.notify_all()

    async def wait_for_change(self, timeout: float) -> None:
        """Until the table is next refreshed (a replica came, went or changed), or the timeout."""
        self._refresh_soon_after(0.5)
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                pass

    def _refresh_soon_after(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(delay, self._refresh_soon, context=contextvars.Context())

    def _start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [_background(self._listen()), _background(self._keep_inflight())]

    async def _listen(self) -> None:
        """Channel-layer events say when to reload: replicas, models, keys or the system state changed."""
        delay = 1.0
        while True:
            try:
                layer = get_channel_layer()
                channel = await layer.new_channel()
                await layer.group_add(GROUP, channel)
                delay = 1.0
                while True:
                    await layer.receive(channel)
                    self._stale = True
                    self._refresh_soon()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the timer still refreshes; listen again shortly
                log.warning("gateway change feed interrupted (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    # in-flight counts

    def start(self, replica: str) -> None:
        self.local[replica] += 1
        self._dirty = True

    def end(self, replica: str) -> None:
        self.local[replica] -= 1
        if self.local[replica] <= 0:
            del self.local[replica]
        self._dirty = True

    def load_of(self, replica: str) -> int:
        return self.local.get(replica, 0) + self.shared.get(replica, 0)

    def pick(self, upstreams, exclude=()) -> routing.Upstream | None:
        candidates = [u for u in upstreams if u.replica not in exclude]
        if not candidates:
            return None
        least = min(self.load_of(u.replica) for u in candidates)
        return random.choice([u for u in candidates if self.load_of(u.replica) == least])

    async def _keep_inflight(self) -> None:
        last_shared = last_alive = 0.0
        while True:
            try:
                now = time.monotonic()
                if self._dirty or now - last_alive > INFLIGHT_TTL / 3:
                    self._dirty = False
                    snapshot = dict(self.local)
                    async with self.redis.pipeline(transaction=True) as pipe:
                        pipe.delete(self.proc_key)
                        if snapshot:
                            pipe.hset(self.proc_key, mapping=snapshot)
                        pipe.expire(self.proc_key, INFLIGHT_TTL)
                        await pipe.execute()
                    last_alive = now
                if now - last_shared > SHARED_INTERVAL:
                    self.shared = await self._others()
                    await self.ledger.flush(self.redis)
                    last_shared = now
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not share in-flight counts (%s)", exc)
                self._dirty = True
                await asyncio.sleep(1)
            await asyncio.sleep(FLUSH_INTERVAL)

    async def _others(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        async for key in self.redis.scan_iter(match=INFLIGHT_PREFIX + "*", count=100):
            if key.decode() == self.proc_key:
                continue
            for replica, n in (await self.redis.hgetall(key)).items():
                totals[replica.decode()] += int(n)
        return dict(totals)


def inflight_totals(client) -> dict[str, int]:
    """Requests in flight per replica across every live web process (sync; for the reconciler's drains)."""
    totals: Counter[str] = Counter()
    for key in client.scan_iter(match=INFLIGHT_PREFIX + "*", count=100):
        for replica, n in client.hgetall(key).items():
            totals[replica.decode()] += int(n)
    return dict(totals)


def notify_change() -> None:
    """After commit, tell every web process to reload its routing table."""
    from asgiref.sync import async_to_sync
    from django.db import transaction

    def send():
        try:
            async_to_sync(get_channel_layer().group_send)(GROUP, {"type": "routing.changed"})
        except Exception as exc:  # the gateways' timer catches up
            log.warning("could not tell the gateways about a change: %s", exc)

    transaction.on_commit(send)
