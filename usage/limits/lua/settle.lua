-- KEYS: tpm, concurrency, budget. ARGV: tpm, process, budget ttl s (0: none),
-- then per request: tokens to add to the TPM bucket (negative gives back),
-- lease ("": none), held tokens, held nanos, used tokens, used nanos. Spent
-- counts are added, this process's holds lessened by this request's (a field
-- at 0 stays: the next admission sets it again); the counter's expiry is set
-- when it is created (admission or here). Sent whole (EVAL) with each settle.
-- Not after now.lua: it reads Redis's clock only when it moves the TPM bucket.

local function int(x) return string.format('%.0f', x) end
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[4])
if tpm > 0 and delta ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  tat = math.max(tat + delta * 60000 / tpm, now)
  redis.call('SET', KEYS[1], tostring(tat), 'PX', int(math.ceil(tat - now) + 1000))
end
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[2], ARGV[5]) end
local ht, hn = tonumber(ARGV[6]), tonumber(ARGV[7])
local ut, un = tonumber(ARGV[8]), tonumber(ARGV[9])
if ht > 0 or hn > 0 or ut > 0 or un > 0 then
  if ut > 0 then redis.call('HINCRBY', KEYS[3], 'st', int(ut)) end
  if un > 0 then redis.call('HINCRBY', KEYS[3], 'sn', int(un)) end
  local tf, nf = 'ht:' .. ARGV[2], 'hn:' .. ARGV[2]
  local own = redis.call('HMGET', KEYS[3], tf, nf)
  local t = math.max((tonumber(own[1]) or 0) - ht, 0)
  local n = math.max((tonumber(own[2]) or 0) - hn, 0)
  redis.call('HSET', KEYS[3], tf, int(t), nf, int(n))
  if not own[1] and not own[2] and tonumber(ARGV[3]) > 0 then
    redis.call('EXPIRE', KEYS[3], ARGV[3])
  end
end
return 1
