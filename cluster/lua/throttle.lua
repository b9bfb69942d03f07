-- One failed credential at a door (cluster/throttle.py): count it, the window starting again, and past the free
-- failures shut the door for 2^(n - free - 1) seconds, at most the window.
--
-- KEYS[1]  the failures of one subject at one door, llmgw:auth:<door>:<kind>:<who>
-- KEYS[2]  the door shut for that subject while this key lives, KEYS[1] .. ':shut'
-- ARGV[1]  the window, seconds: a quiet window forgets the count (both keys expire within it)
-- ARGV[2]  the free failures
-- Returns {failures, seconds the door is now shut for (0: still free)}.
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
local over = n - tonumber(ARGV[2])
if over <= 0 then return {n, 0} end
local delay = math.min(2 ^ math.min(over - 1, 30), tonumber(ARGV[1]))
redis.call('SET', KEYS[2], '1', 'EX', delay)
return {n, delay}
