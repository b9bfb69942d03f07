-- A key's token budget for one period (gateway/spend.py): what the database says it spent, and what each web
-- process holds for it besides (reserved by requests under way, or used and not yet written to the database).
-- Each process says its own part whole each time (never a difference), so what Redis loses is said again.
--
-- KEYS[1]  llmgw:budget:<key id>:<period>:<start>  HASH "db" -> tokens the database has;
--          "p:"..process -> that process's part; "s:"..process -> when it last said so (ms, Redis's clock)
-- ARGV[1]  reserve: the process's part grows by ARGV[5], unless that passes the budget ARGV[4];
--          part: the process's part is ARGV[5]; written: the same, and the database has ARGV[6] (never less)
-- ARGV[2]  the process
-- ARGV[3]  the process's part before this call (reserve), or now (part, written)
-- ARGV[4]  reserve: the budget
-- ARGV[5]  reserve: tokens to reserve
-- ARGV[6]  written: what the database has now; reserve, part: -
-- ARGV[7]  when the hash lapses (Unix seconds: the period's end, and a day)
-- ARGV[8]  ms a process's part counts after it last said so (a process that stopped saying so is gone)
-- Returns {status, what the other processes and the database hold}: status -1 (reserve: the database's spend
-- unknown here: seed it, `written` with a part of 0), 0 (done), 1 (refused: it would pass the budget).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key, me, op = KEYS[1], ARGV[2], ARGV[1]
local stale = tonumber(ARGV[8])

local function others()
  local total = tonumber(redis.call('HGET', key, 'db') or '0')
  local all = redis.call('HGETALL', key)
  local seen = {}
  for i = 1, #all, 2 do seen[all[i]] = all[i + 1] end
  for name, value in pairs(seen) do
    if string.sub(name, 1, 2) == 'p:' then
      local process = string.sub(name, 3)
      if process ~= me then
        if now - tonumber(seen['s:' .. process] or '0') > stale then
          redis.call('HDEL', key, name, 's:' .. process)  -- gone: what it held went with it
        else
          total = total + tonumber(value)
        end
      end
    end
  end
  return total
end

local function say(part)
  if part > 0 then
    redis.call('HSET', key, 'p:' .. me, part, 's:' .. me, now)
  else
    redis.call('HDEL', key, 'p:' .. me, 's:' .. me)
  end
  redis.call('EXPIREAT', key, tonumber(ARGV[7]))
end

if op == 'reserve' then
  if redis.call('HEXISTS', key, 'db') == 0 then return {-1, 0} end
  local held = others()
  local part = tonumber(ARGV[3]) + tonumber(ARGV[5])
  if held + part > tonumber(ARGV[4]) then return {1, held} end
  say(part)
  return {0, held}
end
if op == 'written' then
  local db = tonumber(ARGV[6])
  if db > tonumber(redis.call('HGET', key, 'db') or '-1') then redis.call('HSET', key, 'db', db) end
end
say(tonumber(ARGV[3]))
return {0, others()}
