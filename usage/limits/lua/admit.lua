-- KEYS: rpm, tpm, concurrency, budget. ARGV: rpm, tpm, max concurrency, budget
-- tokens, budget nanos (-1: none), lease ms, process, budget ttl s (0: none),
-- then per request: estimate tokens, estimate nanos, lease, reserve wanted (in
-- requests like this one), reserve slots wanted. Returns one string (cheaper
-- to read than an array): "ok reason retry-ms rpm-remaining rpm-reset-ms
-- tpm-remaining tpm-reset-ms charged hold-tokens hold-nanos reserve-requests
-- reserve-slots reserve-tpm reserve-tokens reserve-nanos"; reason "-" when
-- allowed, -1 remaining: no such limit. The reserve (see Reserve) is taken
-- only when the request is admitted, and is at most RESERVE_SHARE of what each
-- limit has left after it: its slots are leases named "<lease>:<i>", its
-- budget share is held in this process's hold fields. Expired concurrency
-- leases are swept only when the set looks full, and the budget counter's
-- expiry is set when it is created: the common admission makes as few calls
-- as it can.
-- RESERVE_SHARE is written in from usage.limits.reserve; runs after now.lua
-- and gcra.lua.

local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local bt, bn = tonumber(ARGV[4]), tonumber(ARGV[5])
local est_t, est_n = tonumber(ARGV[9]), tonumber(ARGV[10])
local rr, rreset, tr, treset = -1, 0, -1, 0
local rnew, tnew, charged = 0, 0, 0
local function no(reason, wait)
  return table.concat({0, reason, int(math.ceil(wait)), int(rr),
    int(math.ceil(rreset)), int(tr), int(math.ceil(treset)), 0, 0, 0, 0, 0, 0, 0, 0},
    ' ')
end
if maxc > 0 and redis.call('ZCARD', KEYS[3]) >= maxc then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= maxc then return no('concurrency', 1000) end
end
if rpm > 0 then
  local ok, new, rem, reset, wait = gcra(KEYS[1], rpm, 1)
  rr, rreset, rnew = rem, reset, new
  if not ok then return no('requests', wait) end
end
if tpm > 0 then
  charged = math.min(est_t, tpm)
  local ok, new, rem, reset, wait = gcra(KEYS[2], tpm, charged)
  tr, treset, tnew = rem, reset, new
  if not ok then return no('tokens', wait) end
end
local hold_t, hold_n, fresh, own_t, own_n = 0, 0, false, 0, 0
local st, sn, ht, hn = 0, 0, 0, 0
local own_tf, own_nf = 'ht:' .. ARGV[7], 'hn:' .. ARGV[7]
if bt >= 0 or bn >= 0 then
  local vals = redis.call('HGETALL', KEYS[4])
  fresh = #vals == 0
  for i = 1, #vals, 2 do
    local f, v = vals[i], tonumber(vals[i + 1])
    if f == 'st' then st = v elseif f == 'sn' then sn = v
    elseif string.sub(f, 1, 3) == 'ht:' then
      ht = ht + v
      if f == own_tf then own_t = v end
    elseif string.sub(f, 1, 3) == 'hn:' then
      hn = hn + v
      if f == own_nf then own_n = v end
    end
  end
  if bt >= 0 then
    local left = bt - st - ht
    if left <= 0 then return no('budget', 0) end
    hold_t = math.min(est_t, left)
  end
  if bn >= 0 then
    local left = bn - sn - hn
    if left <= 0 then return no('budget', 0) end
    hold_n = math.min(est_n, left)
  end
end
local n, ns, res_t, res_bt, res_bn = tonumber(ARGV[12]), 0, 0, 0, 0
if n > 0 then
  local F = RESERVE_SHARE
  if rpm > 0 then n = math.min(n, math.floor(rr * F)) end
  if tpm > 0 and charged > 0 then n = math.min(n, math.floor(tr * F / charged)) end
  if bt >= 0 and est_t > 0 then
    n = math.min(n, math.floor((bt - st - ht - hold_t) * F / est_t))
  end
  if bn >= 0 and est_n > 0 then
    n = math.min(n, math.floor((bn - sn - hn - hold_n) * F / est_n))
  end
  if maxc > 0 and n > 0 then
    local free = maxc - redis.call('ZCARD', KEYS[3]) - 1
    ns = math.min(n, tonumber(ARGV[13]), math.floor(free * F))
    if ns < 1 then n = 0 end
  end
  if n < 1 then n, ns = 0, 0 end
  if rpm > 0 then rnew = rnew + n * W / rpm end
  if tpm > 0 then res_t = n * charged; tnew = tnew + res_t * W / tpm end
  if bt >= 0 then res_bt = n * est_t end
  if bn >= 0 then res_bn = n * est_n end
end
if maxc > 0 then
  local expiry = int(now + tonumber(ARGV[6]))
  if ns > 0 then
    local add = {'ZADD', KEYS[3], expiry, ARGV[11]}
    for i = 1, ns do
      add[#add + 1] = expiry
      add[#add + 1] = ARGV[11] .. ':' .. i
    end
    redis.call(unpack(add))
  else
    redis.call('ZADD', KEYS[3], expiry, ARGV[11])
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[6])
end
if rpm > 0 then
  redis.call('SET', KEYS[1], tostring(rnew), 'PX', int(math.ceil(rnew - now) + 1000))
end
if tpm > 0 then
  redis.call('SET', KEYS[2], tostring(tnew), 'PX', int(math.ceil(tnew - now) + 1000))
end
local all_t, all_n = hold_t + res_bt, hold_n + res_bn
if all_t > 0 and all_n > 0 then
  redis.call('HSET', KEYS[4], own_tf, int(own_t + all_t), own_nf, int(own_n + all_n))
elseif all_t > 0 then redis.call('HSET', KEYS[4], own_tf, int(own_t + all_t))
elseif all_n > 0 then redis.call('HSET', KEYS[4], own_nf, int(own_n + all_n)) end
if fresh and (all_t > 0 or all_n > 0) and tonumber(ARGV[8]) > 0 then
  redis.call('EXPIRE', KEYS[4], ARGV[8])
end
return table.concat({1, '-', 0, int(rr), int(math.ceil(rreset)), int(tr),
  int(math.ceil(treset)), int(charged), int(hold_t), int(hold_n), int(n), int(ns),
  int(res_t), int(res_bt), int(res_bn)}, ' ')
