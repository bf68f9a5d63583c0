-- KEYS: liveness key, then the concurrency sets. ARGV: lease ms, liveness s,
-- then one lease per set. Extends each lease this process still holds.
-- Runs after now.lua.

redis.call('SET', KEYS[1], '1', 'EX', ARGV[2])
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', int(now + tonumber(ARGV[1])), ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return 1
