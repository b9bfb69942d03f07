"""The gateway's per-process state: the routing table cache, in-flight counts, the upstream HTTP pool.

One instance per event loop (daphne runs one loop per process). In-flight counts are shared across web
processes through Redis: each process keeps its own counts in a hash that expires unless the process keeps it
alive, so a process that dies takes its counts with it instead of leaking them.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import logging
import os
import random
import secrets
import socket
import time
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any, TypeVar, cast

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DataError, IntegrityError
from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from cluster import events, inflight, notify, redis_options
from cluster.models import Model
from gateway import affinity, otel, records, usage
from gateway import table as routing
from gateway.accounting import Ledger
from gateway.admission import Admission, capacity
from gateway.engines_http import Pool
from gateway.explain import explain
from gateway.limits import Limits
from gateway.records import Records, Why
from gateway.redis_reach import Reach, RedisAway
from gateway.spend import Budgets

log = logging.getLogger("llmgw.gateway")
FLUSH_INTERVAL = 0.25
# the other web processes' in-flight counts are read this often: `prefix` routing's load bound weighs them, and a
# count seconds old moved conversations off their replica for requests that had ended (bench/routing.py)
SHARED_INTERVAL = 0.25
# a request's end is shared at once (not at the next FLUSH_INTERVAL): the next turn of a conversation comes right
# after its answer, perhaps to another web process, which must not find the replica still busy with it. Shares
# woken so are at least this far apart, so a busy process does not write Redis on every request
SHARE_GAP = 0.02
# how old the other processes' counts may be when `prefix` routing would move a request off its key's replica:
# older, they are read again first (a move costs the engine a cold prefill; a read, a Redis round trip)
RECHECK_AGE = 0.02
# a replica this process could not connect to (its node cut off, its engine gone) is passed over this long, while
# the model has another: a request does not wait out the connect timeout on it again and again. Then one request
# tries it; a replica that answers is taken back at once
UNREACHABLE_FOR = 10.0
LEDGER_INTERVAL = 1.0  # usage counted in this process goes to the database this often, its traffic to Redis
OVERHEAD_SEEN = 32  # prompts whose counted length against the estimate a model's overhead is learned from
CLOCK_EVERY = 30.0  # seconds between two measures of Redis's clock against this machine's
LOOK_AGAIN = 0.25  # seconds between reloads for a key or model not in the table (look_again)
# seconds a stopping process waits for what its ended requests left to do (settles, slots given back), and then for
# its last usage to reach Redis: a stop is bounded whatever Redis does
CLOSE_WAIT = 2.5
PREFIX = Model.Routing.PREFIX
T = TypeVar("T")

_runtimes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Gateway] = weakref.WeakKeyDictionary()


def runtime() -> Gateway:
    loop = asyncio.get_running_loop()
    gw = _runtimes.get(loop)
    if gw is None:
        gw = _runtimes[loop] = Gateway()
    return gw


async def close() -> None:
    """This event loop's gateway, if it has one, stopped with its books finished (`Gateway.aclose`)."""
    gw = _runtimes.pop(asyncio.get_running_loop(), None)
    if gw is not None:
        await gw.aclose()


async def lifespan(scope: dict[str, Any], receive: Callable[[], Awaitable[Mapping[str, Any]]],
                   send: Callable[[Mapping[str, Any]], Awaitable[None]]) -> None:
    """The ASGI lifespan of a web process (llmgw.asgi): nothing to do at startup; at shutdown, once the server has
    stopped serving, `close()`. uvicorn speaks it; under daphne, which has none, llmgw.web says it as daphne stops."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                await close()
            except Exception:  # the process stops anyway; said, not raised into the server's own stop
                log.exception("the gateway did not close cleanly")
            await send({"type": "lifespan.shutdown.complete"})
            return


def _background(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task of the process, not of the request that happened to start it: in a context of its own, so it holds
    nothing of that request's (under Django's default handler, a thread pool that is gone once the request is)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class Gateway:
    def __init__(self) -> None:
        self.table: routing.Table | None = None
        self.changed = asyncio.Condition()
        self.listening = asyncio.Event()  # set once this process hears `routing.changed`
        self._refreshing: asyncio.Task[None] | None = None
        self._first_load: asyncio.Task[None] | None = None
        self._stale = True
        self._loads = 0  # loads begun, in order; the newest one finished is the table
        self._installed = 0
        self.local: Counter[str] = Counter()
        # requests waiting for a replica of a model that has none ready: (how many, since when), and when each
        # model was last asked for; the autoscaler reads both (cluster.inflight)
        self.waiting: dict[str, tuple[int, float]] = {}
        self.asked: dict[str, float] = {}
        self._asked_dirty = False
        self.shared: dict[str, int] = {}
        self._shared_at = 0.0
        self._dirty = True
        self._wake = asyncio.Event()
        self.unreachable: dict[str, float] = {}  # replica -> until when it is passed over (monotonic)
        me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.proc_key = inflight.PREFIX + me
        self.waiting_key = inflight.WAITING_PREFIX + me
        # a dead pooled connection (Redis restarted) is replaced, the command sent again (cluster.redis_options)
        self.redis: Redis = redis_options.client(socket_timeout=5, asyncio=True)
        # the engines' connections (gateway/engines_http.py: httptools, not aiohttp, for the CPU per request)
        self.engines = Pool(settings.LLMGW_UPSTREAM_CONNECT_TIMEOUT, settings.LLMGW_UPSTREAM_TIMEOUT)
        # read once: Django's settings object costs a lookup of its own on every attribute
        self.refresh_every = settings.LLMGW_GATEWAY_REFRESH
        self.load_factor = settings.LLMGW_ROUTING_LOAD_FACTOR
        self.tries = settings.LLMGW_GATEWAY_TRIES
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self._sharing: asyncio.Task[None] | None = None  # _keep_inflight
        self._booking: asyncio.Task[None] | None = None  # _keep_books
        self._closing = False  # aclose has begun: the sharing loop ends at its next turn
        self._closed = asyncio.Event()  # the same, for the books loop
        self.clock_offset = 0.0  # Redis's clock less this machine's, as last measured (`now`)
        self._clock_measured = float("-inf")
        self.ledger = Ledger()
        self.records = Records() if settings.LLMGW_REQUEST_LOG else None  # None: no request records written
        self.body_bytes = settings.LLMGW_REQUEST_LOG_BODY_BYTES  # of each body a key that logs them has kept
        self.spans = otel.start()  # None: no OTLP endpoint set, no spans made (gateway/otel.py)
        self.reach = Reach(self.redis)  # how long a request waits on Redis, and whether it is away
        self.admission = Admission(self.redis, self.reach)
        self.limits = Limits(self.redis, self.reach)
        self.budgets = Budgets(self.redis, self.reach, me)
        self.headroom = settings.LLMGW_ADMISSION_HEADROOM
        # when the last reload for each began (look_again), or the last warning was said (may_look_again)
        self._looked_again = {"key": float("-inf"), "model": float("-inf"), "stopped": float("-inf"),
                              "admission": float("-inf"), "books": float("-inf")}
        self._looking: dict[str, asyncio.Future[None]] = {}
        self._overheads: dict[str, deque[int]] = {}  # model -> what its engine counted beyond the estimate, lately

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` in the background, holding on to it until it ends (the loop keeps only weak references)."""
        task = _background(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    async def aclose(self, wait: float = CLOSE_WAIT) -> None:
        """Stop this process's gateway with its books finished (a web process stopping, `lifespan`; tests): what
        its ended requests left to do (settling a key's tpm and budget reservations, giving slots back: `spawn`)
        awaited for at most `wait` seconds, its background tasks stopped, the usage counted since the last flush
        sent to Redis and its in-flight counts taken back; then its admission, upstream pool and Redis client."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self._spawned and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._spawned), timeout=left)
        if self._spawned:
            log.warning("stopping with %d task(s) of ended requests unfinished after %.1f s", len(self._spawned), wait)
            for task in self._spawned:
                task.cancel()
        # the sharing and books loops end at their next turn, not cancelled in a flush or a write
        self._closing = True
        self._wake.set()
        self._closed.set()
        ending = [t for t in (self._sharing, self._booking) if t is not None]
        if ending:
            await asyncio.wait(ending, timeout=max(0.1, min(1.0, deadline - loop.time())))
        # cancelled again until they end: redis-py's asyncio client now and then swallows a cancellation
        while not all(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=0.5)
        try:
            await asyncio.wait_for(self._last_books(), CLOSE_WAIT)
        except Exception as exc:  # the database or Redis away: this process's last counts are lost with it
            log.warning("stopping without this process's last usage written (%s)", exc or type(exc).__name__)
        if self.spans is not None:
            try:  # its last spans exported (a thread: the SDK's flush blocks)
                await asyncio.wait_for(asyncio.to_thread(self.spans.close), CLOSE_WAIT)
            except TimeoutError:
                log.warning("stopping with this process's last spans not exported after %.1f s", CLOSE_WAIT)
        await self.admission.aclose()
        await self.budgets.aclose()
        await self.reach.aclose()
        await self.engines.aclose()
        await self.redis.aclose()

    async def _last_books(self) -> None:
        await self.books()
        await self.redis.delete(self.proc_key, self.waiting_key)  # none of its requests is in flight any more

    async def books(self) -> None:
        """What this process counted since the last time: usage and last use into the database (with the spend
        of the budgets it touched read back), traffic into Redis, and its part of every budget said again. A
        write that failed keeps what it took for the next."""
        rows, last_used = self.ledger.take_usage()
        taken = self.budgets.take_unwritten()
        if rows or last_used or taken:
            try:
                spent = await database_sync_to_async(usage.record)(
                    rows, last_used, [(b.key_id, b.period, b.start) for b in taken])
            except Exception as exc:
                self.ledger.keep_usage(rows, last_used)
                self.budgets.not_written(taken)
                if self.may_look_again("books"):
                    log.warning("could not write this process's usage to the database (%s); it is kept for the "
                                "next write", exc)
            else:
                await self.budgets.written(taken, {b: spent[(b.key_id, b.period, b.start)] for b in taken})
        written = self.records.take() if self.records is not None else []
        if written:
            try:
                await database_sync_to_async(records.write)(written)
            except (DataError, IntegrityError) as exc:  # refused, not away: kept, they would be refused again
                log.error("the database refused %d request records (%s); they are dropped", len(written), exc)
            except Exception as exc:
                assert self.records is not None  # it gave what was written
                self.records.keep(written)
                if self.may_look_again("records"):
                    log.warning("could not write this process's request records (%s); they are kept for the next "
                                "write", exc)
        if not self.reach.away:
            await self.ledger.flush_traffic(self.redis)
            await self.budgets.say_all()

    def now(self) -> dt.datetime:
        """The time on Redis's clock (as last measured), the one every web process reads: a key's budget period
        begins at the same moment for all of them."""
        return dt.datetime.fromtimestamp(time.time() + self.clock_offset, dt.UTC)

    async def _measure_clock(self) -> None:
        sent = time.time()
        seconds, micro = await self.reach.call(self.redis.time())
        self.clock_offset = seconds + micro / 1e6 - (sent + time.time()) / 2

    async def _keep_books(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._closed.wait(), LEDGER_INTERVAL)
            except TimeoutError:
                pass
            if self._closing:
                return
            try:
                if time.monotonic() - self._clock_measured > CLOCK_EVERY and not self.reach.away:
                    self._clock_measured = time.monotonic()
                    await self._measure_clock()
                await self.books()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self.reach.away:
                    log.warning("could not send this process's traffic and budgets to Redis (%s)", exc)

    def prompt_overhead(self, model: str) -> int:
        """Tokens the model's engine counts in a prompt beyond the gateway's estimate (gateway.prompt): its chat
        template's own (a default system prompt, say), learned from its answers: the least of the last
        OVERHEAD_SEEN differences (a request with more than the estimate sees, tools say, does not raise it)."""
        seen = self._overheads.get(model)
        return max(0, min(seen)) if seen else 0

    def learn_prompt(self, model: str, estimated: int, counted: int) -> None:
        if estimated > 0 and counted > 0:
            self._overheads.setdefault(model, deque(maxlen=OVERHEAD_SEEN)).append(counted - estimated)

    def may_look_again(self, what: str) -> bool:
        """At most once a second for `what`: True, and counted (a warning's rate)."""
        now = time.monotonic()
        if now - self._looked_again[what] < 1.0:
            return False
        self._looked_again[what] = now
        return True

    async def look_again(self, what: str) -> None:
        """A key or a model this process has not seen may have been created a moment ago, or the system started a
        moment ago, before the change reached it: a reload that begins after this request came answers that.
        Reloads for `what` begin at most every LOOK_AGAIN seconds (not one per bad request; unknown keys from one
        address are throttled besides): a request that comes sooner waits for the next, shared with every
        request waiting meanwhile. (Refused at once, a key created a moment after a wrong one was tried got 401.)"""
        asked = time.monotonic()
        while self._looked_again[what] < asked:
            pending = self._looking.get(what)
            if pending is None or pending.done():
                delay = max(0.0, self._looked_again[what] + LOOK_AGAIN - time.monotonic())
                pending = self._looking[what] = asyncio.ensure_future(self._look_after(what, delay))
            await asyncio.shield(pending)

    async def _look_after(self, what: str, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        self._looked_again[what] = time.monotonic()
        await self.refresh()

    def slots_of(self, model: str, exclude: Collection[str] = ()) -> list[tuple[str, int]]:
        """The model's ready replicas not in `exclude`, each with the requests admission lets into it at once."""
        route = self.table.find(model) if self.table is not None else None
        if route is None or not route.slots:
            return []
        each = capacity(route.slots, self.headroom)
        found = [(u.replica, each) for u in route.ready if u.replica not in exclude]
        random.shuffle(found)  # of those with the most free slots, admission takes the first: any of them
        return found

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
        elif self._stale or time.monotonic() - self.table.loaded_at > self.refresh_every:
            self._refresh_soon()
        assert self.table is not None  # the first load installed one, or raised
        return self.table

    def _refresh_soon(self) -> None:
        # a change heard while a load runs may have committed after that load read: load once more after it
        self._stale = True
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = _background(self._refresh_while_stale())

    async def _refresh_while_stale(self) -> None:
        while self._stale:
            await self.refresh()

    async def refresh(self) -> None:
        self._stale = False
        self._loads += 1
        load = self._loads
        try:
            table = await database_sync_to_async(routing.load)()
        except Exception:  # keep routing with what we had; the timer tries again
            log.exception("could not refresh the routing table")
            if self.table is None:
                raise
            return
        if load < self._installed:
            return  # a load that began later has finished first: what it read is newer than this
        self._installed = load
        self.table = table
        self._give_up_lost(table)
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
        self._sharing = _background(self._keep_inflight())
        self._booking = _background(self._keep_books())
        self._tasks = [_background(self._listen()), self._sharing, self._booking]

    async def _listen(self) -> None:
        """`routing.changed` on the channel layer (cluster.notify) says when to reload: replicas, models, keys or
        the system state changed."""
        delay = 1.0
        while True:
            try:
                layer = get_channel_layer()
                channel = await layer.new_channel()
                await layer.group_add(notify.GATEWAY_GROUP, channel)
                self.listening.set()
                delay = 1.0
                while True:
                    await layer.receive(channel)
                    self._refresh_soon()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the timer still refreshes; listen again shortly
                self.listening.clear()
                log.warning("gateway change feed interrupted (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    def _give_up_lost(self, table: routing.Table) -> None:
        """The answers still coming from replicas that failed or were stopped (their node lost, say: a connection
        to it may never say so), given up: the request goes to another replica, or its stream goes on at one
        (gateway/resume.py)."""
        answering = self.engines.answering
        for replica in [r for r in answering if r not in table.live]:
            self.engines.abandon(replica, f"its replica {replica} left the fleet")
        for replica in [r for r, answers in answering.items() if not answers]:
            del answering[replica]

    # in-flight counts

    def start(self, replica: str) -> None:
        self.local[replica] += 1
        self._dirty = True

    def end(self, replica: str) -> None:
        self.local[replica] -= 1
        if self.local[replica] <= 0:
            del self.local[replica]
        self._dirty = True
        self._wake.set()

    def requested(self, model: str) -> None:
        self.asked[model] = time.time()
        self._asked_dirty = True

    async def wait_begin(self, model: str) -> None:
        """A request waits for a replica of the model: said in Redis at once, and when it is the first, the
        reconciler is asked to run (for a model at zero, that starts one)."""
        n, since = self.waiting.get(model, (0, 0.0))
        self.waiting[model] = (n + 1, since if n else time.time())
        if n:
            return
        try:
            await self.reach.call(self._share_waiting())
        except RedisAway:  # said once by it; the timer shares it, the reconciler's tick finds it
            pass
        self.spawn(asyncio.to_thread(events.ask_reconciler))

    def wait_end(self, model: str) -> None:
        n, since = self.waiting.get(model, (1, 0.0))
        if n <= 1:
            self.waiting.pop(model, None)
        else:
            self.waiting[model] = (n - 1, since)
        self._dirty = True

    async def _share_waiting(self) -> None:
        await self._share(self.waiting_key, {model: f"{n} {since:.3f}" for model, (n, since) in self.waiting.items()})

    async def _share(self, key: str, mapping: Mapping[FieldT, EncodableT]) -> None:
        """This process's hash, replaced whole, alive for inflight.TTL unless shared again."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if mapping:
                pipe.hset(key, mapping=mapping)
            pipe.expire(key, inflight.TTL)
            await pipe.execute()

    def load_of(self, replica: str) -> int:
        return self.local.get(replica, 0) + self.shared.get(replica, 0)

    def cannot_connect(self, replica: str) -> None:
        self.unreachable[replica] = time.monotonic() + UNREACHABLE_FOR

    def pick(self, route: routing.ModelRoute, exclude: Collection[str] = (),
             key: int | None = None) -> routing.Upstream | None:
        """A ready replica not in `exclude`, passing over those this process could not connect to lately while
        another is there."""
        if self.unreachable:
            now = time.monotonic()
            for name, until in list(self.unreachable.items()):
                if until <= now:
                    del self.unreachable[name]
            if self.unreachable:
                upstream = self._pick(route, {*exclude, *self.unreachable}, key)
                if upstream is not None:
                    return upstream
        return self._pick(route, exclude, key)

    def _pick(self, route: routing.ModelRoute, exclude: Collection[str] = (),
              key: int | None = None) -> routing.Upstream | None:
        """A ready replica not in `exclude`: by the request's key on the model's ring when it routes by prefix
        (gateway/affinity.py), else one with the fewest requests in flight."""
        if key is not None and route.routing == PREFIX:
            name = affinity.choose(route.ring, key, self.load_of, exclude, self.load_factor)
            return next((u for u in route.ready if u.replica == name), None)
        candidates = [u for u in route.ready if u.replica not in exclude]
        if not candidates:
            return None
        least = min(self.load_of(u.replica) for u in candidates)
        return random.choice([u for u in candidates if self.load_of(u.replica) == least])

    def explain(self, route: routing.ModelRoute, chosen: str, tried: Mapping[str, str], key: int | None,
                session: bool, queued: bool) -> Why:
        """Why `chosen` (gateway/explain.py), from the counts the choice was made on."""
        walk = route.ring.walk(key) if key is not None and route.routing == PREFIX else None
        return explain([u.replica for u in route.ready], chosen=chosen, walk=walk, load_of=self.load_of, tried=tried,
                       unreachable=self.unreachable, session=session, factor=self.load_factor, queued=queued)

    async def choose(self, route: routing.ModelRoute, exclude: Collection[str] = (),
                     key: int | None = None) -> routing.Upstream | None:
        """`pick`, and when prefix routing would move the request off its key's replica because that one looks busy,
        first the other processes' counts read afresh: what made it look busy may have ended a moment ago."""
        upstream = self.pick(route, exclude, key)
        if upstream is None or key is None or route.routing != PREFIX:
            return upstream
        if time.monotonic() - self._shared_at < RECHECK_AGE:
            return upstream
        home = next((name for name in route.ring.walk(key) if name not in exclude and name not in self.unreachable), None)
        if upstream.replica == home:
            return upstream
        try:
            await self.reach.call(self._read_others())
        except RedisAway:  # what was read last still holds
            return upstream
        return self.pick(route, exclude, key) or upstream

    async def _read_others(self) -> None:
        read_at = time.monotonic()
        self.shared = await self._others()
        self._shared_at = read_at

    async def _keep_inflight(self) -> None:
        last_alive = 0.0
        while not self._closing:
            self._wake.clear()
            try:
                now = time.monotonic()
                if self._dirty or now - last_alive > inflight.TTL / 3:
                    self._dirty = False
                    await self._share(self.proc_key, {replica: n for replica, n in self.local.items()})
                    await self._share_waiting()
                    last_alive = now
                if self._asked_dirty:
                    self._asked_dirty = False
                    asked: dict[FieldT, EncodableT] = {model: f"{t:.3f}" for model, t in self.asked.items()}
                    await self.redis.hset(inflight.LAST_REQUEST, mapping=asked)
                if now - self._shared_at >= SHARED_INTERVAL:
                    await self._read_others()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self.reach.away:  # said once by it
                    log.warning("could not share in-flight counts (%s)", exc)
                self._dirty = True
                await asyncio.sleep(1)
            await asyncio.sleep(SHARE_GAP)
            try:
                await asyncio.wait_for(self._wake.wait(), FLUSH_INTERVAL - SHARE_GAP)
            except TimeoutError:
                pass

    async def _others(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        async for key in self.redis.scan_iter(match=inflight.PREFIX + "*", count=100):
            if key.decode() == self.proc_key:
                continue
            counts = cast(dict[bytes, bytes], await self.redis.hgetall(key))  # the client decodes no replies
            for replica, n in counts.items():
                totals[replica.decode()] += int(n)
        return dict(totals)
