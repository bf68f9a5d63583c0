-- A key with team limits: admits against the key's limits and its team's in
-- one script, all or nothing (no reserve). KEYS: per layer (the key's, then
-- its team's): rpm, tpm, concurrency, budget. ARGV: lease ms, process, per
-- layer: rpm, tpm, max concurrency, budget tokens, budget nanos (-1: none),
-- budget ttl s (0: none); then per request: estimate tokens, estimate nanos,
-- and per layer its lease ("": none). Returns one string: "ok reason layer retry-ms", then per
-- layer "rpm-remaining rpm-reset-ms tpm-remaining tpm-reset-ms charged
-- hold-tokens hold-nanos" (-1 remaining: no such limit); layer is the 1-based
-- layer that refused (0 when allowed). Runs after now.lua and gcra.lua.

local process = ARGV[2]
local layers = #KEYS / 4
local r = 2 + layers * 6
local est_t, est_n = tonumber(ARGV[r + 1]), tonumber(ARGV[r + 2])
local state = {}
local function report(ok, reason, layer, wait)
  local out = {ok, reason, layer, int(math.ceil(wait))}
  for i = 1, layers do
    local s = state[i] or {rr = -1, rreset = 0, tr = -1, treset = 0}
    out[#out + 1] = table.concat({int(s.rr), int(math.ceil(s.rreset)), int(s.tr),
      int(math.ceil(s.treset)), int(s.charged or 0), int(s.hold_t or 0),
      int(s.hold_n or 0)}, ' ')
  end
  return table.concat(out, ' ')
end
-- Check every layer first; take nothing unless all of them admit.
for i = 1, layers do
  local k, a = (i - 1) * 4, 2 + (i - 1) * 6
  local rpm, tpm, maxc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local bt, bn = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local s = {rr = -1, rreset = 0, tr = -1, treset = 0, charged = 0, hold_t = 0,
    hold_n = 0, rpm = rpm, tpm = tpm, maxc = maxc, budget = bt >= 0 or bn >= 0,
    fresh = false, own_t = 0, own_n = 0}
  state[i] = s
  if maxc > 0 and redis.call('ZCARD', KEYS[k + 3]) >= maxc then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now)
    if redis.call('ZCARD', KEYS[k + 3]) >= maxc then
      return report(0, 'concurrency', i, 1000)
    end
  end
  if rpm > 0 then
    local ok, new, rem, reset, wait = gcra(KEYS[k + 1], rpm, 1)
    s.rr, s.rreset, s.rnew = rem, reset, new
    if not ok then return report(0, 'requests', i, wait) end
  end
  if tpm > 0 then
    s.charged = math.min(est_t, tpm)
    local ok, new, rem, reset, wait = gcra(KEYS[k + 2], tpm, s.charged)
    s.tr, s.treset, s.tnew = rem, reset, new
    if not ok then return report(0, 'tokens', i, wait) end
  end
  if s.budget then
    local vals = redis.call('HGETALL', KEYS[k + 4])
    local st, sn, ht, hn = 0, 0, 0, 0
    s.fresh = #vals == 0
    for j = 1, #vals, 2 do
      local f, v = vals[j], tonumber(vals[j + 1])
      if f == 'st' then st = v elseif f == 'sn' then sn = v
      elseif string.sub(f, 1, 3) == 'ht:' then
        ht = ht + v
        if f == 'ht:' .. process then s.own_t = v end
      elseif string.sub(f, 1, 3) == 'hn:' then
        hn = hn + v
        if f == 'hn:' .. process then s.own_n = v end
      end
    end
    if bt >= 0 then
      if bt - st - ht <= 0 then return report(0, 'budget', i, 0) end
      s.hold_t = math.min(est_t, bt - st - ht)
    end
    if bn >= 0 then
      if bn - sn - hn <= 0 then return report(0, 'budget', i, 0) end
      s.hold_n = math.min(est_n, bn - sn - hn)
    end
  end
end
for i = 1, layers do
  local k, a, s = (i - 1) * 4, 2 + (i - 1) * 6, state[i]
  if s.maxc > 0 then
    redis.call('ZADD', KEYS[k + 3], int(now + tonumber(ARGV[1])), ARGV[r + 2 + i])
    redis.call('PEXPIRE', KEYS[k + 3], ARGV[1])
  end
  if s.rpm > 0 then
    redis.call('SET', KEYS[k + 1], tostring(s.rnew), 'PX', int(math.ceil(s.rnew - now) + 1000))
  end
  if s.tpm > 0 then
    redis.call('SET', KEYS[k + 2], tostring(s.tnew), 'PX', int(math.ceil(s.tnew - now) + 1000))
  end
  if s.hold_t > 0 or s.hold_n > 0 then
    redis.call('HSET', KEYS[k + 4], 'ht:' .. process, int(s.own_t + s.hold_t),
      'hn:' .. process, int(s.own_n + s.hold_n))
    if s.fresh and tonumber(ARGV[a + 6]) > 0 then
      redis.call('EXPIRE', KEYS[k + 4], ARGV[a + 6])
    end
  end
end
return report(1, '-', 0, 0)
