-- KEYS: budget. ARGV: process, held tokens, held nanos, ttl s (0: none). Sets
-- this process's holds to what it knows it holds (see RedisLimiter.renew).

local tf, nf = 'ht:' .. ARGV[1], 'hn:' .. ARGV[1]
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[2] == '0' and ARGV[3] == '0' then return 0 end
  redis.call('HSET', KEYS[1], tf, ARGV[2], nf, ARGV[3])
  if tonumber(ARGV[4]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
else
  redis.call('HSET', KEYS[1], tf, ARGV[2], nf, ARGV[3])
end
return 1
