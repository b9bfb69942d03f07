-- A key's requests at once (its max_concurrency), across every web process (gateway/key_slots.py).
--
-- KEYS[1]  llmgw:adm:key:<key id>   ZSET member -> when it lapses (ms, Redis's clock)
-- ARGV[1]  hold: one more, unless the key has ARGV[3] already; keep: the members ARGV[4..] kept alive (those
--          still held: one given back meanwhile is not brought back)
-- ARGV[2]  lease ttl (ms)
-- ARGV[3]  the key's limit (hold)
-- ARGV[4..] members
-- Returns 1 (held, or kept) or 0 (refused).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] == 'hold' then
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[4])
else
  for i = 4, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return 1
