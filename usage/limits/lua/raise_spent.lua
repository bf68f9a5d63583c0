-- KEYS: budget. ARGV: tokens, nanos, ttl s (0: none). Raises the spent counters
-- to at least the given values.

local function int(x) return string.format('%.0f', x) end
local st = tonumber(redis.call('HGET', KEYS[1], 'st') or '0')
local sn = tonumber(redis.call('HGET', KEYS[1], 'sn') or '0')
if tonumber(ARGV[1]) > st then redis.call('HSET', KEYS[1], 'st', ARGV[1]) end
if tonumber(ARGV[2]) > sn then redis.call('HSET', KEYS[1], 'sn', ARGV[2]) end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
