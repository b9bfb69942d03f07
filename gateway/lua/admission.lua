-- Admission (gateway/admission.py): one call carries a batch of one web process's admission work on one model —
-- slots given back, slots kept alive, tickets given up, new tickets — and then grants what is free, atomically.
--
-- KEYS[1]  llmgw:adm:service            HASH key id -> "<attained service>|<at ms>", across models
-- ARGV[1]  the model's prefix, llmgw:adm:<model>: (the model's keys below are built from it)
-- ARGV[2]  settings: lease ttl|promote after|hold|tau|hold back|queue limit|output weight|load factor|key hold|
--          ticket ttl|grant ttl (times in ms)
-- ARGV[3]  the calling process's id
-- ARGV[4]  the model's ready replicas as the caller sees them: name\31capacity\30...
-- ARGV[5]  slots given back: replica\31member\31service to add\30...
-- ARGV[6]  slots kept alive: replica\31member\30... (added again when Redis lost them)
-- ARGV[7]  tickets kept alive: ticket\31fields\30... (enqueued again when Redis lost them and they were not granted)
-- ARGV[8]  tickets given up: ticket\30... (a slot granted to one meanwhile goes back here)
-- ARGV[9]  grants read: ticket\30... (their records go)
-- ARGV[10] new tickets: ticket\31fields\30...
-- ARGV[11] "1": also answer with every grant recorded for the caller (a look)
-- ARGV[12] service of slots the caller kept for its key's next request: key\31service to add\30...
--
-- A ticket's fields: rank (its place in the order)|key|cost|prefs (replica names, comma-separated: its ring
-- walk)|movable (1: it may take a free slot off its first replica)|exclude (replica names it may not have,
-- comma-separated)|enqueued ms (set here)|class (its key's own: a request failing over goes ahead of every class,
-- rank 0, yet holds its slot, and makes a class active, as its key's class; empty: its rank).
-- A slot is a member "ticket|class|key" of the sorted set llmgw:adm:slots:<replica> (member -> when it lapses).
--
-- The model's keys (P = ARGV[1]); every one is given an expiry when written:
--   P.."tickets"        HASH ticket -> fields
--   P.."c"..rank        ZSET ticket -> when enqueued (ms): each class's tickets, oldest first
--   P.."exp"            ZSET ticket -> when it lapses unless kept alive
--   P.."w"..rank        HASH key -> how many of its tickets wait in the class
--   P.."q"..rank..":"..key  ZSET ticket -> arrival: a key's tickets in a class, first come first
--   P.."seq"            arrival counter
--   P.."homed"          HASH replica -> tickets waiting whose ring walk starts there (`prefix` routing's load)
--   P.."held"           HASH "r"..rank / "k"..key -> slots held (kept with the slots, rebuilt when they disagree)
--   P.."reps"           SET the replicas with slots held
--   P.."active"         HASH rank -> when last admitted; "k:"..key -> "rank|when"
-- and llmgw:adm:grants:<process> (HASH ticket -> "replica\31member": grants not yet read by their process).
--
-- What a call costs grows with the replicas and the slots that lapsed, never with the tickets waiting when no slot
-- is free. Granting looks at the first ticket of each key waiting in the classes in turn (not every ticket).
--
-- Answers: {queue length, free slots, the one key admitted within KEY_HOLD ("" when none or several), the highest
-- class admitted within HOLD (3: none), n, (replica or "", position) per new ticket (position -1: the queue is
-- full), m, replica or "" per ticket given up (a slot granted to it, given back here), k, (ticket, replica) per
-- grant to the caller's tickets}. A ticket enqueued into an empty queue is published on llmgw:adm:wanted (the
-- model's name): a process keeping slots for its key's next requests gives them back.

local P = ARGV[1]
local settings = {}
for v in string.gmatch(ARGV[2], '([^|]+)') do settings[#settings + 1] = tonumber(v) end
local lease_ttl, promote, hold, tau, hold_back, limit, weight, factor, key_hold, ticket_ttl, grant_ttl =
  unpack(settings)
local me = ARGV[3]
local service = KEYS[1]
local GRANTS = 'llmgw:adm:grants:'
local QUEUE_TTL = 3600000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function records(s)
  local out = {}
  if s == '' then return out end
  for rec in string.gmatch(s, '([^\30]+)') do
    local f = {}
    for part in string.gmatch(rec .. '\31', '([^\31]*)\31') do f[#f + 1] = part end
    out[#out + 1] = f
  end
  return out
end

local function split(s, sep)
  local out = {}
  for part in string.gmatch(s .. sep, '([^' .. sep .. ']*)' .. sep) do out[#out + 1] = part end
  return out
end

local function slots_key(replica) return 'llmgw:adm:slots:' .. replica end

-- the replicas: those the caller sees ready (with their capacity), and those with slots held (capacity 0 when
-- not ready: a slot there still counts until it is given back)
local names, caps, index, free = {}, {}, {}, {}
for _, f in ipairs(records(ARGV[4])) do
  names[#names + 1] = f[1]; caps[#names] = tonumber(f[2]); index[f[1]] = #names
end
local listed = #names
for _, name in ipairs(redis.call('SMEMBERS', P .. 'reps')) do
  if not index[name] then names[#names + 1] = name; caps[#names] = 0; index[name] = #names end
end

local held = {}  -- "r"..rank / "k"..key -> slots held (read as needed)
local function held_of(field)
  if held[field] == nil then held[field] = tonumber(redis.call('HGET', P .. 'held', field) or '0') end
  return held[field]
end
local function add_held(member, by)
  local f = split(member, '|')
  for _, field in ipairs({'r' .. f[2], 'k' .. f[3]}) do
    local n = redis.call('HINCRBY', P .. 'held', field, by)
    if n <= 0 then redis.call('HDEL', P .. 'held', field); n = 0 end
    held[field] = n
  end
end

-- slots that lapsed (their process stopped keeping them alive) go; what is left is counted
local total_held, seen_held = 0, 0
for i, name in ipairs(names) do
  local k = slots_key(name)
  local lapsed = redis.call('ZRANGEBYSCORE', k, '-inf', now)
  if #lapsed > 0 then
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
    for _, member in ipairs(lapsed) do add_held(member, -1) end
  end
  local n = redis.call('ZCARD', k)
  if n == 0 and i > listed then redis.call('SREM', P .. 'reps', name) end
  total_held = total_held + n
  free[i] = caps[i] - n
end
for _, v in ipairs(redis.call('HMGET', P .. 'held', 'r0', 'r1', 'r2')) do seen_held = seen_held + tonumber(v or '0') end
if seen_held ~= total_held then  -- the counts disagree with the slots (Redis lost some): counted again
  redis.call('DEL', P .. 'held')
  held = {}
  for _, name in ipairs(names) do
    for _, member in ipairs(redis.call('ZRANGE', slots_key(name), 0, -1)) do add_held(member, 1) end
  end
end

local cache = {}
local function attained(key)
  if cache[key] ~= nil then return cache[key] end
  local v = redis.call('HGET', service, key)
  local value = 0
  if v then
    local f = split(v, '|')
    value = tonumber(f[1]) * math.exp(-(now - tonumber(f[2])) / tau)
  end
  cache[key] = value
  return value
end

local function add_service(key, amount)
  if key == '' or amount == 0 then return end
  local value = math.max(0, attained(key) + amount)
  cache[key] = value
  redis.call('HSET', service, key, string.format('%.3f|%d', value, now))
  redis.call('PEXPIRE', service, 600000)  -- ten minutes unwritten: every key's service has decayed to nothing
end

local function touch(key, ttl) redis.call('PEXPIRE', key, ttl) end

-- a ticket out of every structure it is in
local function unqueue(id, f)
  local rank, key = f[1], f[2]
  redis.call('HDEL', P .. 'tickets', id)
  redis.call('ZREM', P .. 'exp', id)
  redis.call('ZREM', P .. 'c' .. rank, id)
  redis.call('ZREM', P .. 'q' .. rank .. ':' .. key, id)
  if redis.call('HINCRBY', P .. 'w' .. rank, key, -1) <= 0 then redis.call('HDEL', P .. 'w' .. rank, key) end
  local home = f[4] ~= '' and string.match(f[4], '^([^,]+)') or nil
  if home and redis.call('HINCRBY', P .. 'homed', home, -1) <= 0 then redis.call('HDEL', P .. 'homed', home) end
end

local function enqueue(id, fields)
  local f = split(fields, '|')
  local rank, key = f[1], f[2]
  if f[7] == nil or f[7] == '' then f[7] = tostring(now); fields = table.concat(f, '|') end
  redis.call('HSET', P .. 'tickets', id, fields)
  redis.call('ZADD', P .. 'exp', now + ticket_ttl, id)
  redis.call('ZADD', P .. 'c' .. rank, tonumber(f[7]), id)
  redis.call('ZADD', P .. 'q' .. rank .. ':' .. key, redis.call('INCR', P .. 'seq'), id)
  redis.call('HINCRBY', P .. 'w' .. rank, key, 1)
  local home = f[4] ~= '' and string.match(f[4], '^([^,]+)') or nil
  if home then redis.call('HINCRBY', P .. 'homed', home, 1) end
  for _, k in ipairs({'tickets', 'exp', 'c' .. rank, 'q' .. rank .. ':' .. key, 'w' .. rank, 'seq', 'homed'}) do
    touch(P .. k, QUEUE_TTL)
  end
end

local function queue_length()
  return redis.call('ZCARD', P .. 'c0') + redis.call('ZCARD', P .. 'c1') + redis.call('ZCARD', P .. 'c2')
end

local function give_back(replica, member)
  if redis.call('ZREM', slots_key(replica), member) == 1 then
    add_held(member, -1)
    local i = index[replica]
    if i then free[i] = free[i] + 1 end
  end
end

local function grant_record(process) return GRANTS .. process end

-- 1. slots given back (and the service of what they served)
for _, f in ipairs(records(ARGV[5])) do
  give_back(f[1], f[2])
  add_service(split(f[2], '|')[3], tonumber(f[3]))
end

-- 1b. service of slots the caller kept for its key's next request
for _, f in ipairs(records(ARGV[12])) do add_service(f[1], tonumber(f[2])) end

-- 2. slots kept alive; one Redis lost is added back (its request is still under way)
local kept = records(ARGV[6])
if #kept > 0 then touch(P .. 'held', lease_ttl * 2); touch(P .. 'reps', lease_ttl * 2) end
for _, f in ipairs(kept) do
  local k = slots_key(f[1])
  if redis.call('ZADD', k, now + lease_ttl, f[2]) == 1 then
    add_held(f[2], 1)
    redis.call('SADD', P .. 'reps', f[1])
    local i = index[f[1]]
    if i then free[i] = free[i] - 1 else names[#names + 1] = f[1]; caps[#names] = 0; free[#names] = -1; index[f[1]] = #names end
  end
  touch(k, lease_ttl * 2)
end

-- 3. tickets given up: out of the queue, or the slot granted to one meanwhile given back
local cancelled = {}
for _, f in ipairs(records(ARGV[8])) do
  local id = f[1]
  local fields = redis.call('HGET', P .. 'tickets', id)
  local answer = ''
  if fields then
    unqueue(id, split(fields, '|'))
  else
    local record = redis.call('HGET', grant_record(me), id)
    if record then
      local g = split(record, '\31')
      redis.call('HDEL', grant_record(me), id)
      give_back(g[1], g[2])
      answer = g[1]
    end
  end
  cancelled[#cancelled + 1] = answer
end

-- 4. grants read by their waiters: their records go
for _, f in ipairs(records(ARGV[9])) do redis.call('HDEL', grant_record(me), f[1]) end

-- 5. tickets whose process stopped keeping them alive lapse (a bounded number a call: the rest next time)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'exp', '-inf', now, 'LIMIT', 0, 128)) do
  local fields = redis.call('HGET', P .. 'tickets', id)
  if fields then unqueue(id, split(fields, '|')) else redis.call('ZREM', P .. 'exp', id) end
end

-- 6. tickets kept alive; one Redis lost, and not granted, is enqueued again
for _, f in ipairs(records(ARGV[7])) do
  if redis.call('HEXISTS', P .. 'tickets', f[1]) == 1 then
    redis.call('ZADD', P .. 'exp', 'XX', now + ticket_ttl, f[1])
  elseif redis.call('HEXISTS', grant_record(me), f[1]) == 0 then
    enqueue(f[1], f[2])
  end
end

-- granting
local total_free = 0
local function count_free()
  total_free = 0
  for i = 1, #names do total_free = total_free + math.max(0, free[i]) end
end
count_free()

local homed = nil
local function homed_of(name)
  if homed == nil then
    homed = {}
    local all = redis.call('HGETALL', P .. 'homed')
    for i = 1, #all, 2 do homed[all[i]] = tonumber(all[i + 1]) end
  end
  return homed[name] or 0
end

local active = nil
local function active_of(field)
  if active == nil then
    active = {}
    local all = redis.call('HGETALL', P .. 'active')
    for i = 1, #all, 2 do active[all[i]] = all[i + 1] end
  end
  return active[field]
end

-- how many of the free slots a class may take: HOLD_BACK of them (less those a higher active class already
-- holds) stay for a higher class admitted within HOLD
local function may_take(rank)
  local higher_held, higher_active = 0, false
  for r = 0, rank - 1 do
    if now - tonumber(active_of(tostring(r)) or '0') < hold then higher_active = true end
    higher_held = higher_held + held_of('r' .. r)
  end
  if not higher_active then return total_free end
  return total_free - math.max(0, hold_back - higher_held)
end

-- whether the model's last slot a class may take stays for another key: this key holds a slot already, and another
-- key of its class or a higher one (by the keys' own classes), admitted within KEY_HOLD, holds none.
-- `same_class`: a slot is held back for the higher classes already, so only a key of its own class counts
local function left_for_another(key, rank, same_class)
  if key == '' or held_of('k' .. key) == 0 then return false end
  active_of('')
  for name, value in pairs(active) do
    if string.sub(name, 1, 2) == 'k:' then
      local other = string.sub(name, 3)
      local f = split(value, '|')
      local r = tonumber(f[1])
      if now - tonumber(f[2]) >= key_hold then
        redis.call('HDEL', P .. 'active', name)
        active[name] = nil
      elseif other ~= key and (r == rank or (r < rank and not same_class)) and held_of('k' .. other) == 0 then
        return true
      end
    end
  end
  return false
end

-- the replica a ticket is granted on. `prefix` routing (prefs): the first on its ring walk whose load (slots held
-- and tickets waiting there), with it, stays within ceil(factor x everything / replicas) (gateway/affinity.py); it
-- waits for a slot there rather than move (a move costs the engine a cold prefill) unless that is over the bound
-- or it is movable (a short prompt: any free slot on its walk). Replicas ready now that its walk does not name
-- (come ready since it was enqueued: a restart's replacement) are the end of its walk, and a walk naming none
-- ready is no walk. Else the replica with the most free slots.
local function pick_replica(f, queued)
  local excluded = {}
  if f[6] ~= '' then for name in string.gmatch(f[6], '([^,]+)') do excluded[name] = true end end
  local walk, on = {}, {}
  if f[4] ~= '' then
    for name in string.gmatch(f[4], '([^,]+)') do
      local i = index[name]
      if i and i <= listed and not on[i] then walk[#walk + 1] = i; on[i] = true end
    end
  end
  if #walk > 0 then
    for i = 1, listed do if not on[i] then walk[#walk + 1] = i end end
    local home = string.match(f[4], '^([^,]+)')
    local load, total = {}, 0
    for i = 1, listed do
      load[i] = caps[i] - free[i] + homed_of(names[i])
      if queued and names[i] == home then load[i] = load[i] - 1 end  -- counted among the waiting: this ticket
      total = total + load[i]
    end
    local bound = math.ceil(factor * (total + 1) / listed)
    for _, i in ipairs(walk) do
      if not excluded[names[i]] and load[i] + 1 <= bound then
        if free[i] > 0 then return names[i] end
        if f[5] ~= '1' then return nil end
        break
      end
    end
    for _, i in ipairs(walk) do  -- every one over the bound (or movable): any free slot, on its walk
      if not excluded[names[i]] and free[i] > 0 then return names[i] end
    end
    return nil
  end
  local best, most = nil, 0
  for i = 1, listed do
    if free[i] > most and not excluded[names[i]] then best, most = names[i], free[i] end
  end
  return best
end

local function own_class(f)
  return (f[8] ~= nil and f[8] ~= '') and f[8] or f[1]
end

-- the replica a ticket may have of the `allowed` free slots its class may take (nil: none now), and whether the
-- last of them is left for another key (then none of its key's tickets may have it)
local function place(f, allowed, queued)
  if allowed <= 1 and left_for_another(f[2], tonumber(own_class(f)), allowed < total_free) then return nil, true end
  return pick_replica(f, queued), false
end

local mine = {}  -- grants to the caller's tickets, answered
local told = {}  -- process -> "ticket|replica;..." to publish
local granted_new = {}

local function grant(id, f, replica, queued)
  local rank, key = own_class(f), f[2]
  local member = id .. '|' .. rank .. '|' .. key
  local k = slots_key(replica)
  redis.call('ZADD', k, now + lease_ttl, member)
  touch(k, lease_ttl * 2)
  redis.call('SADD', P .. 'reps', replica)
  touch(P .. 'reps', lease_ttl * 2)
  add_held(member, 1)
  touch(P .. 'held', lease_ttl * 2)
  local i = index[replica]
  free[i] = free[i] - 1
  total_free = total_free - 1
  if queued and homed ~= nil and f[4] ~= '' then
    local home = string.match(f[4], '^([^,]+)')
    homed[home] = (homed[home] or 1) - 1
  end
  if queued then unqueue(id, f) end
  redis.call('HSET', P .. 'active', rank, now)
  if key ~= '' then redis.call('HSET', P .. 'active', 'k:' .. key, rank .. '|' .. now) end
  if active ~= nil then
    active[rank] = tostring(now)
    if key ~= '' then active['k:' .. key] = rank .. '|' .. now end
  end
  touch(P .. 'active', QUEUE_TTL)
  add_service(key, tonumber(f[3]))
  local process = string.match(id, '^(.*):[^:]*$')
  redis.call('HSET', grant_record(process), id, replica .. '\31' .. member)
  touch(grant_record(process), grant_ttl)
  if process == me then
    mine[#mine + 1] = id; mine[#mine + 1] = replica
    granted_new[id] = replica
  else
    told[process] = (told[process] and (told[process] .. ';') or '') .. id .. '|' .. replica
  end
end

-- free slots to tickets: by class (a class rises one rank per PROMOTE_AFTER its oldest ticket has waited), then
-- the key with the least attained service, then first come; a ticket its replicas cannot take now is passed over
-- (a key passed over for the last slot, with all its tickets), at most `patience` tickets a call
local function dispatch()
  if total_free <= 0 then return end
  local done = {}  -- classes with nothing grantable left this call
  local skip = {}  -- rank..':'..key -> tickets of it passed over; true: the key passed over
  local patience = 64
  for i = 1, listed do patience = patience + math.max(0, caps[i]) end
  while total_free > 0 do
    local eff, best_eff = {}, nil
    for r = 0, 2 do
      if not done[r] then
        local oldest = redis.call('ZRANGE', P .. 'c' .. r, 0, 0, 'WITHSCORES')
        if #oldest > 0 then
          eff[r] = math.max(0, r - math.floor((now - tonumber(oldest[2])) / promote))
          if best_eff == nil or eff[r] < best_eff then best_eff = eff[r] end
        end
      end
    end
    if best_eff == nil then return end
    local allowed = may_take(best_eff)
    if allowed <= 0 then return end
    local pick, pick_f, pick_at, pick_service, pick_rank, pick_key = nil, nil, nil, nil, nil, nil
    for r = 0, 2 do
      if eff[r] == best_eff then
        for _, key in ipairs(redis.call('HKEYS', P .. 'w' .. r)) do
          local passed = skip[r .. ':' .. key]
          if passed ~= true then
            local first = redis.call('ZRANGE', P .. 'q' .. r .. ':' .. key, passed or 0, passed or 0, 'WITHSCORES')
            if #first > 0 then
              local a, at = attained(key), tonumber(first[2])
              if pick == nil or a < pick_service or (a == pick_service and at < pick_at) then
                pick, pick_at, pick_service, pick_rank, pick_key = first[1], at, a, r, key
              end
            end
          end
        end
      end
    end
    if pick == nil then
      for r = 0, 2 do if eff[r] == best_eff then done[r] = true end end
    else
      local fields = redis.call('HGET', P .. 'tickets', pick)
      if not fields then  -- a stray: its ticket is gone
        redis.call('ZREM', P .. 'q' .. pick_rank .. ':' .. pick_key, pick)
        redis.call('ZREM', P .. 'c' .. pick_rank, pick)
      else
        pick_f = split(fields, '|')
        local replica, left = place(pick_f, allowed, true)
        if left then
          skip[pick_rank .. ':' .. pick_key] = true
        elseif replica then
          grant(pick, pick_f, replica, true)
        else
          skip[pick_rank .. ':' .. pick_key] = (skip[pick_rank .. ':' .. pick_key] or 0) + 1
          patience = patience - 1
          if patience <= 0 then return end
        end
      end
    end
  end
end

-- 7. new tickets, in order: granted at once while no ticket waits and a slot is free for them (the rules as a
-- dispatch applies them); else each enqueued (unless the queue is full), and then free slots granted
local answers = {}
local news = records(ARGV[10])
if #news > 0 then
  local length = queue_length()
  if length + #news > limit then dispatch(); length = queue_length() end
  for _, f in ipairs(news) do
    local replica = nil
    if length == 0 and total_free > 0 then
      local g = split(f[2], '|')
      local allowed = may_take(tonumber(g[1]))
      if allowed >= 1 then replica = place(g, allowed, false) end
      if replica then grant(f[1], g, replica, false); answers[#answers + 1] = {f[1], 0} end
    end
    if replica then
      -- granted at once
    elseif length >= limit then
      answers[#answers + 1] = {f[1], -1}
    else
      if length == 0 then redis.call('PUBLISH', 'llmgw:adm:wanted', string.sub(P, 11, -2)) end
      enqueue(f[1], f[2])
      length = length + 1
      answers[#answers + 1] = {f[1], length}
    end
  end
end
dispatch()

for process, message in pairs(told) do redis.call('PUBLISH', 'llmgw:adm:granted:' .. process, message) end

-- what the caller needs to keep a slot for its key's next request: nobody waits, no other key and no higher class
-- was admitted lately (gateway/admission.py)
local only_key, top = nil, 3
active_of('')
for name, value in pairs(active) do
  if string.sub(name, 1, 2) == 'k:' then
    if now - tonumber(split(value, '|')[2]) < key_hold then
      only_key = (only_key == nil) and string.sub(name, 3) or ''
    end
  elseif now - tonumber(value) < hold then
    top = math.min(top, tonumber(name))
  end
end

local out = {queue_length(), total_free, only_key or '', top, #answers}
for _, a in ipairs(answers) do
  local replica = granted_new[a[1]]
  out[#out + 1] = replica or ''
  out[#out + 1] = a[2]
end
out[#out + 1] = #cancelled
for _, c in ipairs(cancelled) do out[#out + 1] = c end
if ARGV[11] == '1' then  -- a look: every grant recorded for the caller, read or not
  mine = {}
  local all = redis.call('HGETALL', grant_record(me))
  for i = 1, #all, 2 do
    mine[#mine + 1] = all[i]
    mine[#mine + 1] = split(all[i + 1], '\31')[1]
  end
end
out[#out + 1] = #mine / 2
for _, v in ipairs(mine) do out[#out + 1] = v end
return out
