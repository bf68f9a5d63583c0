-- KEYS: sorted sets of places (members: leases, scores: when they expire),
-- all in one cluster slot. ARGV: lease ms, then a limit (-1: none) and a
-- lease per key. Takes a place in every set, or in none: returns 0 when
-- taken, else the (1-based) index of the first set that is full. Runs after
-- now.lua.

for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  local limit = tonumber(ARGV[2 * i])
  if limit >= 0 and redis.call('ZCARD', KEYS[i]) >= limit then return i end
end
local expires = int(now + tonumber(ARGV[1]))
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], expires, ARGV[2 * i + 1])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return 0
