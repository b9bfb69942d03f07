"""Admission: at most a model's capacity in its engines; the rest waits here, in a fair order, bounded.

A replica takes as many requests at once as its engine has slots (its profile's `parallel`): a request beyond
that waits inside the engine, first come first served, where nothing can order, bound or see it. So the gateway
lets a request through only with a slot: a lease on one replica, held in Redis (a sorted set per replica, member ->
when it lapses, on Redis's own clock), so every web process of every control plane counts the same slots, and a
process that dies leaks none (its leases lapse LEASE_TTL after it last kept them alive).

A request that finds no free slot takes a ticket in its model's queue (Redis too) and waits. The order in which
free slots go to tickets (gateway/lua/admission.lua, one script, atomic, whichever process runs it):

1. by class: `interactive`, `standard`, `batch` (the key's, or lower with `X-Llmgw-Priority`); a class whose
   oldest ticket has waited PROMOTE_AFTER rises one class for each such wait, so nothing starves (the class,
   not the ticket: a flood's tickets that have waited long do not pass a quiet key of their own class);
2. between keys of a class, the key with the least attained service first: its tokens served over a decaying
   window (TAU), completion tokens weighing OUTPUT_WEIGHT times a prompt's (VTC's and llm-d's measure), counted
   from the moment a request is granted (its prompt) and settled when it ends;
3. within a key, first come first served.

A slot a lower class could take is held back (HOLD_BACK slots of the model) while a higher class was admitted
within HOLD: a quiet interactive key then never waits for a batch request to finish. Within a class, a key that
holds a slot already may not take the model's last free one while another key of its class (or a higher one),
admitted within KEY_HOLD, holds none: a quiet key between its requests finds that slot free rather than wait for
one of a flood's requests to end. A key's first slot is never held back, so every key progresses. The grant names the
replica: with `prefix` routing the first on the request's ring walk within the bounded load (slots held and
requests waiting for each replica, as gateway/affinity.py bounds requests in flight): a request waits for a slot
there rather than move to a free replica, where its conversation's cache is not (a cold prefill), unless its
replica is over the bound or its prompt is short (under SHORT_PROMPT tokens: its cold prefill costs less than a
wait for a slot); else the one with the most free slots.

One web process's work on a model goes to Redis in one script call at a time: what comes while a call is on its way
(slots given back, new tickets, tickets given up, slots and tickets kept alive) goes together in the next, so a
slot freed and a request wanting one meet in one round trip, and a busy process makes one call for many requests.
A grant to a ticket of the calling process comes back in the call's answer; one to another process's ticket is
published on that process's channel (pub/sub) and recorded, so a waiter whose message was lost finds it when it
looks again (every LOOK_EVERY seconds). A ticket whose process stopped keeping it alive lapses after TICKET_TTL; a
waiter that gives up (its client gone, its wait over) gives its ticket up, and a slot granted to it meanwhile goes
back in the same call. Slots and tickets kept alive that Redis lost (a restart, a failover) are added back.

What one call costs grows with the model's replicas, never with the tickets waiting when no slot is free; granting
looks at the first ticket of each key waiting (bench/admission.py measures a queue of 10,000).

Redis away (gateway/redis_reach.py): a request does not wait on it more than a quarter of a second, and then goes
straight to an engine the routing picks (admission fails open), until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

from django.conf import settings
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from cluster.inflight import ADMISSION_PREFIX
from gateway import scripts
from gateway.errors import GatewayError
from gateway.key_slots import KeySlots
from gateway.redis_reach import Reach, RedisAway

log = logging.getLogger("llmgw.gateway")

T = TypeVar("T")
# What admission.lua answers: counts, and tickets' and replicas' names (bytes, or str from a decoding client)
Reply = list[bytes | str | int]

CLASSES = ("interactive", "standard", "batch")
DEFAULT_CLASS = "standard"
RANK = {name: rank for rank, name in enumerate(CLASSES)}

LEASE_TTL = 30.0  # seconds a slot outlives the last time its holder kept it alive
TICKET_TTL = 10.0  # seconds a waiting ticket outlives the last time its waiter kept it alive
RENEW_EVERY = 3.0
LOOK_EVERY = 0.5  # a waiter looks again this often: a replica came ready, a grant's message was lost
PROMOTE_AFTER = 15.0  # a class rises one rank per this many seconds its oldest ticket waited
HOLD = 10.0  # seconds a class counts as active after its last admission, holding slots back from lower classes
HOLD_BACK = 1  # slots of a model a lower class may not take while a higher one is active
KEY_HOLD = 10.0  # seconds a key counts as active after its last admission: a key holding a slot already leaves
# the model's last free slot to another active key of its class that holds none
TAU = 60.0  # seconds: attained service decays by e over this
OUTPUT_WEIGHT = 2  # a completion token's weight in attained service, against a prompt token's 1
SHORT_PROMPT = 256  # tokens: a prompt shorter takes a free slot off its replica rather than wait there
GRANT_TTL = 120.0  # seconds a grant's record waits for its waiter to read it
# A slot its request gives back is kept for the next request of its key and class, in this process, while that is
# what Redis would grant anyway: nobody waits, no other key and no higher class was admitted lately, as the model's
# last call answered at most HINTS_FOR seconds ago. Kept at most KEEP_FOR seconds unused, given back at once when
# a ticket is enqueued anywhere (llmgw:adm:wanted). A key's closed loop then costs no Redis round trip a request.
HINTS_FOR = 0.2
KEEP_FOR = 0.025
RETRY_AFTER = 0.5  # seconds before a call that failed is tried again (slots given back, tickets given up)

PREFIX = ADMISSION_PREFIX
SERVICE = PREFIX + "service"  # key id -> "<attained service>|<at ms>", across models
RS, US = "\x1e", "\x1f"  # the script's record and field separators
WANTED = PREFIX + "wanted"  # a model's name, published when a ticket is enqueued into its empty queue


def model_prefix(model: str) -> str:
    return f"{PREFIX}{model}:"


def slots_key(replica: str) -> str:
    return f"{PREFIX}slots:{replica}"


def channel(process: str) -> str:
    return f"{PREFIX}granted:{process}"


@dataclass
class Lease:
    """A slot held on a replica: release it when the request ends."""

    model: str
    replica: str
    member: str  # ticket|rank|key
    key: str
    cost: int  # the attained service counted at the grant
    position: int | None = None  # where it entered the queue, when it waited there (1: first in line)


@dataclass
class _Waiter:
    model: str
    placed: asyncio.Future[tuple[str | None, int]]  # (replica or None, position in the queue; -1: the queue is full)
    granted: asyncio.Future[str]  # the replica


@dataclass
class _Hints:
    """What the model's last call said: whether a slot may be kept for its key's next request."""

    at: float  # monotonic
    waiting: int  # tickets in the queue
    only_key: str  # the one key admitted within KEY_HOLD ("": none, or several)
    top: int  # the highest class admitted within HOLD (3: none)

    def keep(self, key: str, rank: int, now: float) -> bool:
        return now - self.at < HINTS_FOR and not self.waiting and self.only_key == key and self.top >= rank


@dataclass
class _Kept:
    lease: Lease
    rank: int
    timer: asyncio.TimerHandle


@dataclass
class _Batch:
    """What goes to Redis in one call for one model."""

    releases: list[tuple[Lease, int]] = field(default_factory=list)  # a slot given back, the service to add
    service: dict[str, int] = field(default_factory=dict)  # key -> service of slots kept, to add
    cancels: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)
    forgets: list[str] = field(default_factory=list)
    news: list[tuple[str, str]] = field(default_factory=list)
    keep: bool = False  # the model's slots and tickets kept alive
    look: bool = False
    done: list[asyncio.Future[None]] = field(default_factory=list)  # resolved when the call has been made

    def __bool__(self) -> bool:
        return bool(self.releases or self.cancels or self.forgets or self.news or self.keep or self.look
                    or self.service)


class Admission:
    """One web process's side of admission: its waiters, its leases and tickets kept alive, its grants heard."""

    def __init__(self, redis: Redis, reach: Reach | None = None):
        self.redis = redis
        self.reach = reach or Reach(redis)
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._script = scripts.register(redis, "admission")
        self.keys = KeySlots(redis, self.reach, self.process, LEASE_TTL, self.start)  # a key's requests at once
        self.waiters: dict[str, _Waiter] = {}  # by ticket
        self.leases: dict[str, Lease] = {}  # by member
        self.tickets: dict[str, tuple[str, str]] = {}  # ticket -> (model, fields): kept alive while it waits
        self._batches: dict[str, _Batch] = {}  # model -> what waits to go in its next call
        self._calls: dict[str, asyncio.Task[None]] = {}  # model -> the task making its calls
        self._replicas: dict[str, Callable[[], list[tuple[str, int]]]] = {}  # model -> its replicas, as given
        self._looked: dict[str, float] = {}  # model -> when this process last looked
        self._tasks: list[asyncio.Task[None]] = []
        self.enabled = settings.LLMGW_ADMISSION
        self.load_factor = settings.LLMGW_ROUTING_LOAD_FACTOR  # `prefix` routing's bound (gateway/affinity.py)
        self._limits: dict[str, int] = {}  # model -> its queue limit, as last given
        self._hints: dict[str, _Hints] = {}  # model -> what its last call said
        self._kept: dict[str, list[_Kept]] = {}  # model -> slots kept for their key's next request
        self.reach.on_back.append(self._keep_everything)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._hear(), context=contextvars.Context()),
                           loop.create_task(self._renew(), context=contextvars.Context())]

    async def aclose(self, timeout: float = 2.0) -> None:
        """Stop: what waits to go to Redis (slots given back, slots kept) sent first, within `timeout`; then the
        tasks."""
        for model in list(self._kept):
            self._unkeep(model)
        calls = [task for task in self._calls.values() if not task.done()]
        if calls:
            await asyncio.wait(calls, timeout=timeout)
        for task in [*self._tasks, *self._calls.values()]:
            task.cancel()
        while not all(task.done() for task in [*self._tasks, *self._calls.values()]):
            await asyncio.wait([*self._tasks, *self._calls.values()], timeout=0.5)

    # the calls

    def _batch(self, model: str) -> _Batch:
        batch = self._batches.get(model)
        if batch is None:
            batch = self._batches[model] = _Batch()
        task = self._calls.get(model)
        if task is None or task.done():
            self._calls[model] = asyncio.get_running_loop().create_task(self._call_while(model),
                                                                         context=contextvars.Context())
        return batch

    async def _call_while(self, model: str) -> None:
        """The model's calls, one at a time, each with everything that came while the last was on its way."""
        while batch := self._batches.pop(model, None):
            try:
                answer = await self._call(model, batch)
            except asyncio.CancelledError:
                self._failed(model, batch, RedisAway("the process is stopping"), again=False)
                raise
            except ResponseError as exc:  # Redis answered, refusing the script: a bug, not Redis away
                log.error("admission's script failed on %s: %s", model, exc)
                self._failed(model, batch, exc, again=False)
                continue
            except Exception as exc:
                self.reach.lost(exc)
                self._failed(model, batch, exc, again=True)
                await asyncio.sleep(RETRY_AFTER)
                continue
            self._answered(model, batch, answer)

    async def _call(self, model: str, batch: _Batch) -> Reply:
        replicas = self._replicas.get(model, list)()
        names = {name for name, _ in replicas}
        releases = []
        for lease, served in batch.releases:
            releases.append(f"{lease.replica}{US}{lease.member}{US}{served - lease.cost}")
            names.add(lease.replica)
        kept_slots = kept_tickets = ""
        if batch.keep:
            kept_slots = RS.join(f"{held.replica}{US}{held.member}" for held in self.leases.values() if held.model == model)
            kept_tickets = RS.join(f"{t}{US}{fields}" for t, (m, fields) in self.tickets.items() if m == model)
        args = [model_prefix(model), self._settings_for(model), self.process,
                RS.join(f"{name}{US}{cap}" for name, cap in replicas), RS.join(releases), kept_slots, kept_tickets,
                RS.join(t for t, _ in batch.cancels), RS.join(batch.forgets),
                RS.join(f"{t}{US}{fields}" for t, fields in batch.news), "1" if batch.look else "",
                RS.join(f"{key}{US}{n}" for key, n in batch.service.items())]
        answer: Reply = await self._script(keys=[SERVICE], args=args)
        return answer

    def _settings_for(self, model: str) -> str:
        """The script's settings (read each call: tests change them), with the model's queue limit."""
        return "|".join(str(v) for v in (
            int(LEASE_TTL * 1000), int(PROMOTE_AFTER * 1000), int(HOLD * 1000), int(TAU * 1000), HOLD_BACK,
            self._limits.get(model, 0), OUTPUT_WEIGHT, self.load_factor, int(KEY_HOLD * 1000),
            int(TICKET_TTL * 1000), int(GRANT_TTL * 1000)))

    def _answered(self, model: str, batch: _Batch, answer: Reply) -> None:
        self._hints[model] = _Hints(time.monotonic(), int(answer[0]), _text(answer[2]), int(answer[3]))
        at = 4
        n = int(answer[at])
        at += 1
        for ticket, _ in batch.news:
            replica, position = _text(answer[at]), int(answer[at + 1])
            at += 2
            waiter = self.waiters.get(ticket)
            if waiter is not None and not waiter.placed.done():
                waiter.placed.set_result((replica or None, position))
            elif waiter is None and position != -1:  # given up as the call went: out again in the next
                self._batch(model).cancels.append((ticket, asyncio.get_running_loop().create_future()))
        del n  # one answer per new ticket, read above
        m = int(answer[at])
        at += 1
        for (_, future), released in zip(batch.cancels, answer[at:at + m]):
            if not future.done():
                future.set_result(_text(released))
        at += m
        k = int(answer[at])
        at += 1
        for i in range(k):
            self._granted(_text(answer[at + 2 * i]), _text(answer[at + 2 * i + 1]))
        for done in batch.done:
            if not done.done():
                done.set_result(None)

    def _failed(self, model: str, batch: _Batch, exc: BaseException, again: bool) -> None:
        """A call that failed: new tickets are answered with the failure at once (their requests go on without
        admission); slots given back, tickets given up and grants read go again in the next call (unless the
        process is stopping: they lapse)."""
        for ticket, _ in batch.news:
            waiter = self.waiters.get(ticket)
            if waiter is not None and not waiter.placed.done():
                waiter.placed.set_exception(RedisAway(str(exc) or type(exc).__name__))
        self._hints.pop(model, None)
        if again and (batch.releases or batch.cancels or batch.forgets or batch.service):
            retry = self._batches.setdefault(model, _Batch())
            retry.releases[:0] = batch.releases
            retry.cancels[:0] = batch.cancels
            retry.forgets[:0] = batch.forgets
            retry.done[:0] = batch.done
            for key, n in batch.service.items():
                retry.service[key] = retry.service.get(key, 0) + n
        else:
            for _, future in batch.cancels:
                if not future.done():
                    future.set_result("")
            for done in batch.done:
                if not done.done():
                    done.set_result(None)
        if not again and batch.releases:
            log.warning("admission: %d slot(s) of %s not given back (they lapse in %.0f s)", len(batch.releases),
                        model, LEASE_TTL)

    def _granted(self, ticket: str, replica: str) -> None:
        waiter = self.waiters.get(ticket)
        if waiter is not None and not waiter.granted.done():
            waiter.granted.set_result(replica)

    # a request's side

    async def admit(self, model: str, replicas: Callable[[], list[tuple[str, int]]], *, key: str, rank: int,
                    cost: int, prefs: list[str], queue_limit: int, max_wait: float,
                    on_wait: Callable[[], None] | None = None, check: Callable[[], None] | None = None,
                    movable: bool = False, exclude: Collection[str] = (), chosen: str | None = None,
                    klass: int | None = None) -> Lease:
        """A slot on one of `replicas()` ((name, capacity) each, as they are now, none while a model loads), not
        one of `exclude`, waiting for it at most `max_wait` seconds (`on_wait()` is called when it must; `check()`,
        as it waits, raises what ends the wait sooner). Raises a 429 when the queue is full, a 503 when the wait is
        over, RedisAway when Redis did not answer in time; a cancellation (the client gone) gives the ticket up.
        `movable`: it may take a free slot of a replica other than the first of `prefs` (a short prompt).
        `chosen`: the replica the model's routing picks, where a slot this process kept may be taken. `klass`: the
        key's own class, when `rank` puts it ahead of it (a request failing over): the class it holds its slot as."""
        self.start()
        self._replicas[model] = replicas
        self._limits[model] = queue_limit
        klass = rank if klass is None else klass
        if chosen and rank == klass and (lease := self._take_kept(model, key, rank, cost, chosen)) is not None:
            return lease
        ticket = f"{self.process}:{secrets.token_hex(6)}"
        fields = f"{rank}|{key}|{cost}|{','.join(prefs)}|{int(movable)}|{','.join(exclude)}||{klass}"
        loop = asyncio.get_running_loop()
        waiter = self.waiters[ticket] = _Waiter(model, loop.create_future(), loop.create_future())
        started = time.monotonic()
        replica: str | None = None
        try:
            if self.reach.away:
                raise RedisAway("Redis is away")
            self.tickets[ticket] = (model, fields)
            self._batch(model).news.append((ticket, fields))
            replica, position = await self.reach.call(asyncio.shield(waiter.placed))
            if position == -1:
                raise GatewayError(429, "queue_full",
                                   f"model {model} has {queue_limit} requests waiting already; try again shortly", 2)
            waited_at = None if replica is not None else position
            if replica is None and on_wait is not None:
                on_wait()
            while replica is None:
                if check is not None:
                    check()
                left = max_wait - (time.monotonic() - started)
                if left <= 0:
                    raise GatewayError(503, "queue_timeout",
                                       f"model {model} had no free slot for {max_wait:g}s; try again shortly", 5)
                try:
                    replica = await asyncio.wait_for(asyncio.shield(waiter.granted), min(left, LOOK_EVERY))
                except TimeoutError:
                    self._look(model)
        except BaseException:
            self._give_up(model, ticket, waiter)
            raise
        finally:
            self.waiters.pop(ticket, None)
            self.tickets.pop(ticket, None)
        self._batch_later(model).forgets.append(ticket)  # its grant's record is not needed any more
        lease = Lease(model, replica, f"{ticket}|{klass}|{key}", key, cost, waited_at)
        self.leases[lease.member] = lease
        return lease

    def _batch_later(self, model: str) -> _Batch:
        """The model's next batch, without making a call for it now (what it holds waits for the next call)."""
        return self._batches.setdefault(model, _Batch())

    def _look(self, model: str) -> None:
        """Look again (a replica may have come ready, a grant's message been lost): once per LOOK_EVERY in this
        process however many of its requests wait."""
        now = time.monotonic()
        if now - self._looked.get(model, 0.0) >= LOOK_EVERY * 0.9:
            self._looked[model] = now
            self._batch(model).look = True

    def _give_up(self, model: str, ticket: str, waiter: _Waiter) -> None:
        """The ticket out of the queue, and a slot granted to it meanwhile back: in the model's next call, which
        runs whatever happens to the request."""
        pending = self._batches.get(model)
        if pending is not None and any(t == ticket for t, _ in pending.news):  # never sent: never will be
            pending.news = [(t, f) for t, f in pending.news if t != ticket]
            return
        replica = _result(waiter.granted) or (_result(waiter.placed) or (None, 0))[0]
        if replica:
            fields = self.tickets.get(ticket, (model, "|||||||"))[1].split("|")
            key, klass = fields[1], fields[7] or fields[0]
            batch = self._batch(model)
            batch.releases.append((Lease(model, replica, f"{ticket}|{klass}|{key}", key, 0), 0))
            batch.forgets.append(ticket)
        elif not (waiter.placed.done() and not waiter.placed.cancelled() and waiter.placed.exception()):
            self._batch(model).cancels.append((ticket, asyncio.get_running_loop().create_future()))

    def give_back(self, lease: Lease, served: int) -> asyncio.Future[None]:
        """The slot back, the request's service settled (`served`: its attained service, of which `lease.cost` was
        counted at the grant), and the queue's free slots granted, in the model's next call; the future is done
        once that call was made. Or the slot kept for its key's next request (HINTS_FOR), done at once."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        rank = int(lease.member.rsplit("|", 2)[1])
        hints = self._hints.get(lease.model)
        if hints is not None and hints.keep(lease.key, rank, time.monotonic()):
            batch = self._batch_later(lease.model)
            batch.service[lease.key] = batch.service.get(lease.key, 0) + served - lease.cost
            kept = _Kept(lease, rank, loop.call_later(KEEP_FOR, self._unkeep, lease.model, lease.member))
            self._kept.setdefault(lease.model, []).append(kept)
            done.set_result(None)
            return done
        self.leases.pop(lease.member, None)
        batch = self._batch(lease.model)
        batch.releases.append((lease, served))
        batch.done.append(done)
        return done

    def _take_kept(self, model: str, key: str, rank: int, cost: int, replica: str) -> Lease | None:
        """A slot this process keeps for the key's next request on `replica` (the one its routing picks), when
        Redis would grant it one anyway."""
        kept = self._kept.get(model)
        if not kept:
            return None
        hints = self._hints.get(model)
        if hints is None or not hints.keep(key, rank, time.monotonic()):
            return None
        for i, k in enumerate(kept):
            if k.lease.key == key and k.rank == rank and k.lease.replica == replica:
                del kept[i]
                k.timer.cancel()
                batch = self._batch_later(model)
                batch.service[key] = batch.service.get(key, 0) + cost
                lease = Lease(model, k.lease.replica, k.lease.member, key, cost)
                self.leases[lease.member] = lease
                return lease
        return None

    def _unkeep(self, model: str, member: str | None = None) -> None:
        """Slots kept give back: the one of `member` (kept KEEP_FOR unused), or all of the model's (a ticket
        enqueued somewhere wants one)."""
        kept = self._kept.get(model, [])
        going = [k for k in kept if member is None or k.lease.member == member]
        if not going:
            return
        self._kept[model] = [k for k in kept if k not in going]
        batch = self._batch(model)
        for k in going:
            k.timer.cancel()
            self.leases.pop(k.lease.member, None)
            batch.releases.append((k.lease, k.lease.cost))  # its service was counted when it was kept

    async def release(self, lease: Lease, replicas: list[tuple[str, int]] | None = None, served: int = 0) -> None:
        """`give_back`, waited for (`replicas`: the model's, as they are now, when this process has not
        admitted to it yet)."""
        if replicas is not None:
            self._replicas.setdefault(lease.model, lambda: replicas)
        await self.give_back(lease, served)

    async def _hear(self) -> None:
        """Grants for this process's waiters, as other processes make them."""
        delay = 1.0
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(channel(self.process), WANTED)
                    delay = 1.0
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                        if message is None:
                            continue
                        if message["channel"] == WANTED.encode():  # a ticket waits: no slot kept any more
                            model = message["data"].decode()
                            self._hints.pop(model, None)
                            self._unkeep(model)
                            continue
                        for grant in message["data"].decode().split(";"):
                            ticket, _, replica = grant.rpartition("|")
                            self._granted(ticket, replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # waiters still look every LOOK_EVERY
                if not self.reach.away:
                    log.warning("admission grants feed interrupted (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    def _keep_everything(self) -> None:
        """Every slot and ticket of this process kept alive now (Redis is back, perhaps without them)."""
        for model in {lease.model for lease in self.leases.values()} | {m for m, _ in self.tickets.values()}:
            self._batch(model).keep = True

    async def _renew(self) -> None:
        """This process's leases and tickets kept alive (those of a process that dies lapse), and any Redis lost
        added back; the grants' records read sent on their way."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            models = ({lease.model for lease in self.leases.values()} | {m for m, _ in self.tickets.values()}
                      | {m for m, b in self._batches.items() if b.forgets})
            for model in models:
                self._batch(model).keep = True
            try:
                await self.keys.keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self.reach.away:
                    log.warning("could not keep the keys' requests alive (%s)", exc)


def _result(future: asyncio.Future[T]) -> T | None:
    """A future's result, None while it has none (not done, cancelled, failed)."""
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    return None


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def rank_of(key_class: str, header: str) -> int:
    """The request's class: its key's, or a lower one its header asks for (never a higher one)."""
    rank = RANK.get(key_class, RANK[DEFAULT_CLASS])
    if header:
        asked = RANK.get(header.strip().lower())
        if asked is None:
            raise GatewayError(400, "invalid_request",
                               f"X-Llmgw-Priority must be one of {', '.join(CLASSES)}, not {header[:32]!r}")
        rank = max(rank, asked)
    return rank


def service(prompt: int, completion: int) -> int:
    """A request's attained service: its tokens, a completion token weighing OUTPUT_WEIGHT."""
    return prompt + OUTPUT_WEIGHT * completion


def capacity(slots: int, headroom: float) -> int:
    """A replica's admitted requests: its slots and a headroom (a fraction of them, rounded up)."""
    return slots + math.ceil(slots * headroom)
