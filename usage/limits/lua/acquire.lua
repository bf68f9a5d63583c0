-- KEYS: concurrency. ARGV: limit, lease, lease ms. Returns 1 if taken.
-- Runs after now.lua.

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[3])), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
