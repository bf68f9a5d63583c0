-- KEYS: budgets (the key's, and its team's when it has one). ARGV: process,
-- used tokens, used nanos, wanted tokens, wanted nanos, then per budget: its
-- tokens, its nanos (-1: none), held tokens, held nanos. Returns {covered,
-- then per budget: new hold tokens, new hold nanos}.
-- Runs after now.lua.

local used = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local want = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local fields = {'ht:' .. ARGV[1], 'hn:' .. ARGV[1]}
local ok, out = 1, {}
for k = 1, #KEYS do
  local a = 5 + (k - 1) * 4
  local b = {tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])}
  local held = {tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])}
  local spent, holds = {0, 0}, {0, 0}
  local vals = redis.call('HGETALL', KEYS[k])
  for i = 1, #vals, 2 do
    local f, v = vals[i], tonumber(vals[i + 1])
    if f == 'st' then spent[1] = v elseif f == 'sn' then spent[2] = v
    elseif string.sub(f, 1, 3) == 'ht:' then holds[1] = holds[1] + v
    elseif string.sub(f, 1, 3) == 'hn:' then holds[2] = holds[2] + v end
  end
  for i = 1, 2 do
    if b[i] >= 0 and used[i] > held[i] then
      local avail = b[i] - spent[i] - (holds[i] - held[i])
      local new = math.max(math.min(math.max(want[i], used[i]), avail), held[i])
      if new > held[i] then
        redis.call('HINCRBY', KEYS[k], fields[i], int(new - held[i]))
      end
      if used[i] > new then ok = 0 end
      held[i] = new
    end
  end
  out[#out + 1] = int(held[1])
  out[#out + 1] = int(held[2])
end
table.insert(out, 1, ok)
return out
