-- KEYS: rpm, tpm, concurrency, budget. ARGV: rpm, tpm, process, then the
-- reserve's leftovers: requests, TPM tokens, budget tokens, budget nanos, then
-- its idle slots' leases. Gives them back: the rate buckets' TATs move back
-- (never before now), this process's holds shrink, the slots are freed.
-- Runs after now.lua.

local function give(key, limit, amount)
  if limit > 0 and amount > 0 then
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat > now then
      tat = math.max(tat - amount * 60000 / limit, now)
      redis.call('SET', key, tostring(tat), 'PX', int(math.ceil(tat - now) + 1000))
    end
  end
end
give(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[4]))
give(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[5]))
local bt, bn = tonumber(ARGV[6]), tonumber(ARGV[7])
if bt > 0 or bn > 0 then
  local tf, nf = 'ht:' .. ARGV[3], 'hn:' .. ARGV[3]
  local own = redis.call('HMGET', KEYS[4], tf, nf)
  if own[1] or own[2] then
    local t = math.max((tonumber(own[1]) or 0) - bt, 0)
    local n = math.max((tonumber(own[2]) or 0) - bn, 0)
    redis.call('HSET', KEYS[4], tf, int(t), nf, int(n))
  end
end
if #ARGV > 7 then redis.call('ZREM', KEYS[3], unpack(ARGV, 8)) end
return 1
