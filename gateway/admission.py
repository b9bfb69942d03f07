"""Admission: at most a model's capacity in its engines; the rest waits here, in a fair order, bounded.

A replica takes as many requests at once as its engine has slots (its profile's `parallel`): a request beyond
that waits inside the engine, first come first served, where nothing can order, bound or see it. So the gateway
lets a request through only with a slot: a lease on one replica, held in Redis (a sorted set per replica,
member -> when it lapses), so every web process of every control plane counts the same slots, and a process that
dies leaks none (its leases lapse LEASE_TTL after it last renewed them).

A request that finds no free slot takes a ticket in its model's queue (Redis too) and waits. Whenever a slot
frees, a ticket is added, or a waiter looks again, the queue is dispatched (one Lua script: atomic, whichever
process runs it), granting free slots to tickets in this order:

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

Slots a process gives back while a release of the same model is on its way to Redis go together in the next
script call (one dispatch for all of them). A grant is published on the waiter's process's channel (pub/sub), so
it wakes at once; a waiter also looks
again every LOOK_EVERY seconds (a message lost, a replica come ready). A ticket whose process stopped renewing it
lapses after TICKET_TTL; a waiter that gives up (its client gone, its wait over) cancels it, returning a slot
granted in the meantime.
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
from dataclasses import dataclass

from django.conf import settings

from cluster.inflight import ADMISSION_PREFIX, queue_keys
from gateway.errors import GatewayError

log = logging.getLogger("llmgw.gateway")

CLASSES = ("interactive", "standard", "batch")
DEFAULT_CLASS = "standard"
RANK = {name: rank for rank, name in enumerate(CLASSES)}

LEASE_TTL = 30.0  # seconds a slot outlives the last renewal by its holder
TICKET_TTL = 10.0  # seconds a waiting ticket outlives the last renewal by its waiter
RENEW_EVERY = 3.0
LOOK_EVERY = 0.5  # a waiter dispatches again this often: a replica came ready, a grant's message was lost
PROMOTE_AFTER = 15.0  # a ticket rises one class per this many seconds waited
HOLD = 10.0  # seconds a class counts as active after its last admission, holding slots back from lower classes
HOLD_BACK = 1  # slots of a model a lower class may not take while a higher one is active
KEY_HOLD = 10.0  # seconds a key counts as active after its last admission: a key holding a slot already leaves
# the model's last free slot to another active key of its class that holds none
TAU = 60.0  # seconds: attained service decays by e over this
OUTPUT_WEIGHT = 2  # a completion token's weight in attained service, against a prompt token's 1
SHORT_PROMPT = 256  # tokens: a prompt shorter takes a free slot off its replica rather than wait there

PREFIX = ADMISSION_PREFIX
SERVICE = PREFIX + "service"  # key id -> "<attained service>|<at ms>", across models
GRANT_TTL = 120  # seconds a grant's record waits for its waiter to read it


def _keys(model: str) -> tuple[str, str, str, str]:
    """A model's queue (ticket -> seq), its tickets (ticket -> fields), when each class was last admitted, and its
    ticket counter."""
    queue, tickets = queue_keys(model)
    return queue, tickets, f"{PREFIX}{model}:active", f"{PREFIX}{model}:seq"


def slots_key(replica: str) -> str:
    return f"{PREFIX}slots:{replica}"


def grant_key(ticket: str) -> str:
    return f"{PREFIX}grant:{ticket}"


def channel(process: str) -> str:
    return f"{PREFIX}granted:{process}"


# KEYS: queue, tickets, active, seq, service, then each replica's slots. ARGV: op, now (ms), lease ttl (ms), promote
# (ms), hold (ms), tau (ms), hold back, queue limit, output weight, load factor, replica count, key hold (ms), then
# name and capacity per replica, then the op's own. A ticket's fields: rank|key|cost|expires (ms)|enqueued (ms)|process|prefs
# (names, ,)|movable (1: it may take a free slot off its replica within the bound).
# A lease's member: ticket|rank|key.
SCRIPT = r"""
local queue, tickets, active, seqkey, service = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local op = ARGV[1]
local now, lease_ttl, promote, hold, tau = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local hold_back, limit, weight, factor = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local nrep = tonumber(ARGV[11])
local key_hold = tonumber(ARGV[12])
local names, caps, index, free, holders, homed, held = {}, {}, {}, {}, {}, {}, {}
local at = 13
for i = 1, nrep do
  names[i] = ARGV[at]; caps[i] = tonumber(ARGV[at + 1]); index[ARGV[at]] = i; at = at + 2
end
local args = {}
for i = at, #ARGV do args[#args + 1] = ARGV[i] end

local function split(s)
  local out = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do out[#out + 1] = part end
  return out
end

local function attained(key, cache)
  if cache[key] ~= nil then return cache[key] end
  local v = redis.call('HGET', service, key)
  local value = 0
  if v then
    local f = split(v)
    value = tonumber(f[1]) * math.exp(-(now - tonumber(f[2])) / tau)
  end
  cache[key] = value
  return value
end

local function add_service(key, amount, cache)
  if key == '' then return end
  local value = math.max(0, attained(key, cache) + amount)
  cache[key] = value
  redis.call('HSET', service, key, string.format('%.3f|%d', value, now))
end

local function count_slots()
  for i = 1, nrep do
    local k = KEYS[5 + i]
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
    local members = redis.call('ZRANGE', k, 0, -1)
    free[i] = caps[i] - #members
    for _, m in ipairs(members) do
      local f = split(m)
      local rank = tonumber(f[2]) or 1
      holders[rank] = (holders[rank] or 0) + 1
      if f[3] then held[f[3]] = (held[f[3]] or 0) + 1 end
    end
  end
end

-- how many of the free slots a class may take: HOLD_BACK of them (less those a higher active class already holds)
-- stay for a higher class admitted within HOLD
local function may_take(rank, total)
  local held = 0
  local higher_active = false
  for r = 0, rank - 1 do
    local last = tonumber(redis.call('HGET', active, tostring(r)) or '0')
    if now - last < hold then higher_active = true end
    held = held + (holders[r] or 0)
  end
  if not higher_active then return total end
  return total - math.max(0, hold_back - held)
end

-- the keys of each class admitted within KEY_HOLD (the active hash's 'k:<key>' fields: rank|when), read once
local recent = nil
local function recent_keys()
  if recent then return recent end
  recent = {}
  local all = redis.call('HGETALL', active)
  for i = 1, #all, 2 do
    local name = all[i]
    if string.sub(name, 1, 2) == 'k:' then
      local f = split(all[i + 1])
      if now - tonumber(f[2]) < key_hold then
        recent[string.sub(name, 3)] = tonumber(f[1])
      else
        redis.call('HDEL', active, name)
      end
    end
  end
  return recent
end

-- whether the model's last slot a class may take stays for another key: the ticket's key holds a slot already,
-- and another key of its class or a higher one (by the classes the keys have, not as they rose waiting), admitted
-- within KEY_HOLD, holds none (it is between requests). `same_class`: a slot is held back for the higher classes
-- already, so only a key of the ticket's own class counts
local function left_for_another(f, same_class)
  local key, rank = f[2], tonumber(f[1])
  if key == '' or (held[key] or 0) == 0 then return false end
  for other, r in pairs(recent_keys()) do
    if other ~= key and (r == rank or (r < rank and not same_class)) and (held[other] or 0) == 0 then
      return true
    end
  end
  return false
end

local function grant(id, f, replica, cache, wanted)
  local i = index[replica]
  local rank = f[1]
  redis.call('ZADD', KEYS[5 + i], now + lease_ttl, id .. '|' .. rank .. '|' .. f[2])
  redis.call('PEXPIRE', KEYS[5 + i], lease_ttl * 2)
  free[i] = free[i] - 1
  holders[tonumber(rank)] = (holders[tonumber(rank)] or 0) + 1
  redis.call('ZREM', queue, id)
  redis.call('HDEL', tickets, id)
  if id ~= wanted then  -- the caller's own ticket is answered by the script itself
    redis.call('SET', ARGV[#ARGV - 1] .. id, replica, 'EX', 120)
    redis.call('PUBLISH', ARGV[#ARGV] .. f[6], id .. '|' .. replica)
  end
  redis.call('HSET', active, rank, now)
  if f[2] ~= '' then
    held[f[2]] = (held[f[2]] or 0) + 1
    redis.call('HSET', active, 'k:' .. f[2], rank .. '|' .. now)
    if recent then recent[f[2]] = tonumber(rank) end
  end
  add_service(f[2], tonumber(f[3]), cache)
end

local function home_of(f)
  return f[7] ~= '' and string.match(f[7], '^([^,]+)') or nil
end

-- `prefix` routing's bounded load, over slots held and requests waiting: the ticket's replica is the first on its
-- ring walk whose load, with it, stays within ceil(factor x everything / replicas) (gateway/affinity.py); it
-- waits for a slot there rather than move (a move costs the engine a cold prefill) unless that is over the bound
local function pick_replica(f)
  if f[7] ~= '' then
    local load, total = {}, 0
    local home = home_of(f)
    for i = 1, nrep do
      load[i] = caps[i] - free[i] + (homed[names[i]] or 0)
      if names[i] == home then load[i] = load[i] - 1 end  -- counted among the waiting: this ticket itself
      total = total + load[i]
    end
    local bound = math.ceil(factor * (total + 1) / nrep)
    for name in string.gmatch(f[7], '([^,]+)') do
      local i = index[name]
      if i and load[i] + 1 <= bound then
        if free[i] > 0 then return name end
        if f[8] ~= '1' then return nil end
        break  -- a short prompt: any free slot, on its walk
      end
    end
    for name in string.gmatch(f[7], '([^,]+)') do  -- every one over the bound (or a short prompt): any free slot
      local i = index[name]
      if i and free[i] > 0 then return name end
    end
    return nil
  end
  local best, most = nil, 0
  for i = 1, nrep do
    if free[i] > most then best, most = names[i], free[i] end
  end
  return best
end

local function dispatch(cache, wanted)
  local got = nil
  local waiting = {}
  for _, id in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
    local v = redis.call('HGET', tickets, id)
    local f = v and split(v)
    if not f or tonumber(f[4]) < now then
      redis.call('ZREM', queue, id)
      redis.call('HDEL', tickets, id)
    else
      waiting[#waiting + 1] = {id, f, #waiting}
      local home = home_of(f)
      if home then homed[home] = (homed[home] or 0) + 1 end
    end
  end
  while #waiting > 0 do
    local total = 0
    for i = 1, nrep do total = total + math.max(0, free[i]) end
    if total <= 0 then break end
    -- a class rises one rank for each PROMOTE_AFTER its oldest ticket has waited: the class, not the ticket, so
    -- within it the order stays least attained service first (a flood's long-waiting tickets do not pass a
    -- quiet key of their own class)
    local oldest = {}
    for _, w in ipairs(waiting) do
      local r, at = tonumber(w[2][1]), tonumber(w[2][5])
      if oldest[r] == nil or at < oldest[r] then oldest[r] = at end
    end
    local best, best_at, order = nil, nil, nil
    for n, w in ipairs(waiting) do
      local f = w[2]
      local r = tonumber(f[1])
      local rank = math.max(0, r - math.floor((now - oldest[r]) / promote))
      local key = {rank, attained(f[2], cache), w[3]}
      if order == nil or key[1] < order[1] or (key[1] == order[1] and (key[2] < order[2] or (key[2] == order[2] and key[3] < order[3]))) then
        best, best_at, order = w, n, key
      end
    end
    local allowed = may_take(order[1], total)
    if allowed <= 0 then break end
    local replica = nil
    if allowed > 1 or not left_for_another(best[2], allowed < total) then replica = pick_replica(best[2]) end
    if replica == nil then
      table.remove(waiting, best_at)  -- its replicas are full: the others may still go
    else
      grant(best[1], best[2], replica, cache, wanted)
      table.remove(waiting, best_at)
      local home = home_of(best[2])
      if home then homed[home] = homed[home] - 1 end
      if best[1] == wanted then got = replica end
    end
  end
  return got
end

count_slots()
local cache = {}
if op == 'admit' then
  -- args: ticket, fields..., then the grant prefix and channel prefix
  local id = args[1]
  local fields = args[2]
  redis.call('PEXPIRE', queue, 3600000)
  local f = split(fields)
  if redis.call('ZCARD', queue) >= limit then
    dispatch(cache, nil)
    if redis.call('ZCARD', queue) >= limit then return {-1, ''} end
  end
  redis.call('HSET', tickets, id, fields)
  redis.call('ZADD', queue, redis.call('INCR', seqkey), id)
  local got = dispatch(cache, id)
  if got then return {1, got} end
  return {0, tostring(redis.call('ZCARD', queue))}
elseif op == 'release' then
  -- args: replica's slots, member, key, service to add (for each slot given back), grant prefix, channel prefix
  for a = 1, #args - 2, 4 do
    local k = args[a]
    if redis.call('ZREM', k, args[a + 1]) == 1 then
      for i = 1, nrep do
        if KEYS[5 + i] == k then free[i] = free[i] + 1 end
      end
      local f = split(args[a + 1])
      local rank = tonumber(f[2]) or 1  -- its class and key no longer hold that slot
      holders[rank] = math.max(0, (holders[rank] or 0) - 1)
      if f[3] then held[f[3]] = math.max(0, (held[f[3]] or 0) - 1) end
    end
    add_service(args[a + 2], tonumber(args[a + 3]), cache)
  end
  dispatch(cache, nil)
  return {1, ''}
elseif op == 'cancel' then
  -- args: ticket, grant prefix, channel prefix
  local id = args[1]
  if redis.call('ZREM', queue, id) == 1 then
    redis.call('HDEL', tickets, id)
    return {0, ''}
  end
  local replica = redis.call('GET', ARGV[#ARGV - 1] .. id)
  if replica then
    redis.call('DEL', ARGV[#ARGV - 1] .. id)
    return {1, replica}
  end
  return {-1, ''}
elseif op == 'look' then
  -- args: ticket (or ''), grant prefix, channel prefix
  local got = dispatch(cache, args[1])
  if got then return {1, got} end
  local replica = args[1] ~= '' and redis.call('GET', ARGV[#ARGV - 1] .. args[1])
  if replica then return {1, replica} end
  return {0, ''}
end
return {-2, ''}
"""


# keeps waiting tickets alive, and only those still waiting (a granted one is not brought back). KEYS: queue,
# tickets; ARGV: ticket, fields, ticket, fields, ...
RENEW_TICKETS = r"""
for i = 1, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
return 0
"""


# a key's requests at once (its max_concurrency), across every web process: a sorted set per key, member -> when it
# lapses. KEYS: the key's set; ARGV: now (ms), lease ttl (ms), limit, member. Returns 1 (held) or 0 (refused).
KEY_SLOT = r"""
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return 1
"""


def key_slots_key(key_id: int) -> str:
    return f"{PREFIX}key:{key_id}"


@dataclass
class Lease:
    """A slot held on a replica: release it when the request ends."""

    model: str
    replica: str
    member: str
    key: str
    cost: int  # the attained service counted at the grant


class Admission:
    """One web process's side of admission: its waiters, its leases and tickets kept alive, its grants heard."""

    def __init__(self, redis):
        self.redis = redis
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._script = redis.register_script(SCRIPT)
        self._renew_tickets = redis.register_script(RENEW_TICKETS)
        self._key_slot = redis.register_script(KEY_SLOT)
        self.key_slots: dict[str, int] = {}  # member -> key id: the key slots this process holds
        self.waiters: dict[str, asyncio.Future] = {}
        self.leases: dict[str, Lease] = {}  # by member
        self.tickets: dict[str, tuple[str, str]] = {}  # ticket -> (model, its fields but the expiry)
        self._looked: dict[str, float] = {}  # model -> when this process last dispatched its queue to look
        self._releasing: dict[str, list] = {}  # model -> (lease, served, done) given back, not yet sent
        self._release_replicas: dict[str, list[tuple[str, int]]] = {}  # model -> its replicas as last given
        self._flushing: dict[str, asyncio.Task] = {}  # model -> the task sending its releases
        self._tasks: list[asyncio.Task] = []
        self.enabled = settings.LLMGW_ADMISSION
        self.load_factor = settings.LLMGW_ROUTING_LOAD_FACTOR  # `prefix` routing's bound (gateway/affinity.py)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._hear(), context=contextvars.Context()),
                           loop.create_task(self._renew(), context=contextvars.Context())]

    async def aclose(self) -> None:
        if self._flushing:  # the slots given back on their way: sent before the process goes (else they lapse)
            await asyncio.wait(list(self._flushing.values()), timeout=2)
        while not all(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=0.5)

    async def _run(self, op: str, model: str, replicas: list[tuple[str, int]], *args, queue_limit: int = 0):
        queue, tickets, active, seq = _keys(model)
        keys = [queue, tickets, active, seq, SERVICE, *(slots_key(name) for name, _ in replicas)]
        argv = [op, int(time.time() * 1000), int(LEASE_TTL * 1000), int(PROMOTE_AFTER * 1000), int(HOLD * 1000),
                int(TAU * 1000), HOLD_BACK, queue_limit, OUTPUT_WEIGHT, self.load_factor, len(replicas),
                int(KEY_HOLD * 1000)]
        for name, capacity in replicas:
            argv += [name, capacity]
        argv += [*args, PREFIX + "grant:", PREFIX + "granted:"]
        status, value = await self._script(keys=keys, args=argv)
        return int(status), value.decode() if isinstance(value, bytes) else str(value)

    async def admit(self, model: str, replicas, *, key: str, rank: int, cost: int, prefs: list[str],
                    queue_limit: int, max_wait: float, on_wait=None, check=None, movable: bool = False) -> Lease:
        """A slot on one of `replicas()` ((name, capacity) each, as they are now, none while a model loads),
        waiting for it at most `max_wait` seconds (`on_wait()` is called when it must; `check()`, as it waits,
        raises what ends the wait sooner). Raises a 429 when the queue is full, a 503 when the wait is over; a
        cancellation (the client gone) gives the ticket up. `movable`: it may take a free slot of a replica
        other than the first of `prefs` (a short prompt)."""
        self.start()
        ticket = f"{self.process}:{secrets.token_hex(6)}"
        fields = (f"{rank}|{key}|{cost}|{{expires}}|{int(time.time() * 1000)}|{self.process}|{','.join(prefs)}"
                  f"|{int(movable)}")
        future = asyncio.get_running_loop().create_future()
        self.waiters[ticket] = future
        self.tickets[ticket] = (model, fields)
        started = time.monotonic()
        try:
            status, value = await self._run("admit", model, replicas(), ticket, self._expiring(fields),
                                            queue_limit=queue_limit)
            if status == -1:
                raise GatewayError(429, "queue_full",
                                   f"model {model} has {queue_limit} requests waiting already; try again shortly", 2)
            replica = value if status == 1 else None
            direct = replica is not None  # granted by its own admission: no record of the grant was made
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
                    replica = await asyncio.wait_for(asyncio.shield(future), min(left, LOOK_EVERY))
                except TimeoutError:
                    replica = await self._look(model, replicas, ticket)
        except BaseException:
            self.waiters.pop(ticket, None)
            self.tickets.pop(ticket, None)
            await self._give_up(model, replicas(), ticket, key, rank, cost)
            raise
        self.waiters.pop(ticket, None)
        self.tickets.pop(ticket, None)
        if not direct:  # granted by a dispatch: its record is not needed any more
            self._forget_grant(ticket)
        lease = Lease(model, replica, f"{ticket}|{rank}|{key}", key, cost)
        self.leases[lease.member] = lease
        return lease

    async def _look(self, model: str, replicas, ticket: str) -> str | None:
        """Dispatch the model's queue again (a replica may have come ready, a release been missed), once per
        LOOK_EVERY in this process however many of its requests wait; then whether this ticket was granted."""
        now = time.monotonic()
        if now - self._looked.get(model, 0.0) >= LOOK_EVERY * 0.9:
            self._looked[model] = now
            status, value = await self._run("look", model, replicas(), ticket)
            return value if status == 1 else None
        found = await self.redis.get(grant_key(ticket))
        return found.decode() if found else None

    async def _give_up(self, model, replicas, ticket, key, rank, cost) -> None:
        """The ticket out of the queue, and a slot granted to it meanwhile back (shielded: it runs even as the
        request is cancelled)."""

        async def cancel():
            status, replica = await self._run("cancel", model, replicas, ticket)
            if status == 1:  # granted meanwhile: released, as the request that never ran
                await self.release(Lease(model, replica, f"{ticket}|{rank}|{key}", key, cost), replicas, 0)

        try:
            await asyncio.shield(asyncio.get_running_loop().create_task(cancel(), context=contextvars.Context()))
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # it lapses in TICKET_TTL (a ticket) or LEASE_TTL (a slot)
            log.warning("could not give up a place in %s's queue (%s)", model, exc)

    async def release(self, lease: Lease, replicas: list[tuple[str, int]], served: int) -> None:
        """The slot back, the request's service settled (`served`: its attained service, of which `lease.cost` was
        counted at the grant), and the queue dispatched. The slots of a model this process gives back while a
        release of it is on its way to Redis go together, in one script call after it."""
        self.leases.pop(lease.member, None)
        done = asyncio.get_running_loop().create_future()
        self._releasing.setdefault(lease.model, []).append((lease, served, done))
        self._release_replicas[lease.model] = replicas
        if lease.model not in self._flushing:
            self._flushing[lease.model] = asyncio.get_running_loop().create_task(
                self._flush(lease.model), context=contextvars.Context())
        await done

    async def _flush(self, model: str) -> None:
        pending: list = []
        try:
            while pending := self._releasing.pop(model, None):
                replicas = list(self._release_replicas.pop(model))
                names = {name for name, _ in replicas}
                args: list = []
                for lease, served, _ in pending:
                    if lease.replica not in names:  # gone from the table: its slots still counted
                        names.add(lease.replica)
                        replicas.append((lease.replica, 0))
                    args += [slots_key(lease.replica), lease.member, lease.key, served - lease.cost]
                try:
                    await self._run("release", model, replicas, *args)
                except Exception as exc:  # the leases lapse in LEASE_TTL
                    log.warning("could not release %d slot(s) of %s (%s)", len(pending), model, exc)
                self._settled(pending)
        finally:  # cancelled (the process stopping): no one waits on for these, nor for any given back since
            self._flushing.pop(model, None)
            self._settled(pending or [])
            self._settled(self._releasing.pop(model, []))

    @staticmethod
    def _settled(pending: list) -> None:
        for _, _, done in pending:
            if not done.done():
                done.set_result(None)

    def _forget_grant(self, ticket: str) -> None:
        task = asyncio.get_running_loop().create_task(self.redis.delete(grant_key(ticket)), context=contextvars.Context())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # it expires anyway

    async def hold_key(self, key_id: int, name: str, limit: int) -> str:
        """One of the key's `limit` requests at once (waiting or in flight), or a 429 `concurrency_limit`."""
        self.start()
        member = f"{self.process}:{secrets.token_hex(6)}"
        held = await self._key_slot(keys=[key_slots_key(key_id)],
                                    args=[int(time.time() * 1000), int(LEASE_TTL * 1000), limit, member])
        if not int(held):
            raise GatewayError(429, "concurrency_limit",
                               f"key {name} has {limit} requests in flight already (its max concurrency)", 1)
        self.key_slots[member] = key_id
        return member

    async def let_key_go(self, member: str) -> None:
        key_id = self.key_slots.pop(member, None)
        if key_id is not None:
            try:
                await self.redis.zrem(key_slots_key(key_id), member)
            except Exception as exc:  # it lapses in LEASE_TTL
                log.warning("could not let a key's request go (%s)", exc)

    @staticmethod
    def _expiring(fields: str) -> str:
        return fields.replace("{expires}", str(int((time.time() + TICKET_TTL) * 1000)), 1)

    async def _hear(self) -> None:
        """Grants for this process's waiters, as they are made."""
        delay = 1.0
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(channel(self.process))
                    delay = 1.0
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                        if message is None:
                            continue
                        ticket, _, replica = message["data"].decode().rpartition("|")
                        future = self.waiters.get(ticket)
                        if future is not None and not future.done():
                            future.set_result(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # waiters still look every LOOK_EVERY
                log.warning("admission grants feed interrupted (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    async def _renew(self) -> None:
        """This process's leases and tickets kept alive: those of a process that dies lapse."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            try:
                now = time.time()
                async with self.redis.pipeline(transaction=False) as pipe:
                    for lease in list(self.leases.values()):
                        pipe.zadd(slots_key(lease.replica), {lease.member: int((now + LEASE_TTL) * 1000)}, xx=True)
                        pipe.pexpire(slots_key(lease.replica), int(LEASE_TTL * 2000))
                    for member, key_id in list(self.key_slots.items()):
                        pipe.zadd(key_slots_key(key_id), {member: int((now + LEASE_TTL) * 1000)}, xx=True)
                        pipe.pexpire(key_slots_key(key_id), int(LEASE_TTL * 2000))
                    await pipe.execute()
                by_model: dict[str, list[str]] = {}
                for ticket, (model, fields) in list(self.tickets.items()):
                    by_model.setdefault(model, []).extend([ticket, self._expiring(fields)])
                for model, pairs in by_model.items():
                    queue, tickets, _, _ = _keys(model)
                    await self._renew_tickets(keys=[queue, tickets], args=pairs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not renew admission leases (%s)", exc)


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
