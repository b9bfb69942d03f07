-- A key's rate limits (gateway/limits.py): its requests and tokens this minute, across every web process, the
-- minute on Redis's clock.
--
-- KEYS     none: the minute's counters are named from ARGV[2] and the minute (one key's two counters)
-- ARGV[1]  check: count this request and reserve ARGV[5] tokens unless a limit is reached;
--          settle: the tokens of the minute ARGV[6] put right by ARGV[5] (what was used less what was reserved)
-- ARGV[2]  the key's counters' prefix, llmgw:rl:<key id>:
-- ARGV[3]  requests per minute (0: none)
-- ARGV[4]  tokens per minute (0: none)
-- ARGV[5]  check: tokens to reserve; settle: the change
-- ARGV[6]  settle: the minute it was reserved in
-- Returns check: {0, minute} (admitted), {1, requests} or {2, tokens} (refused), the third item the seconds
-- left in the minute; settle: 1.
local t = redis.call('TIME')
local now = tonumber(t[1])
if ARGV[1] == 'settle' then
  local name = ARGV[2] .. 't:' .. ARGV[6]
  if redis.call('EXISTS', name) == 1 then redis.call('INCRBY', name, ARGV[5]) end  -- a lost count stays lost
  return 1
end
local minute = math.floor(now / 60)
local left = 60 - now % 60
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
if rpm > 0 then
  local name = ARGV[2] .. 'r:' .. minute
  local n = redis.call('INCR', name)
  redis.call('EXPIRE', name, 120)
  if n > rpm then return {1, n, left} end
end
if tpm > 0 then
  local name = ARGV[2] .. 't:' .. minute
  local used = tonumber(redis.call('GET', name) or '0')
  if used >= tpm then return {2, used, left} end
  if tonumber(ARGV[5]) > 0 then
    redis.call('INCRBY', name, ARGV[5])
    redis.call('EXPIRE', name, 120)
  end
end
return {0, minute, left}
