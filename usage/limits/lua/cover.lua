-- KEYS: budget. ARGV: budget tokens, budget nanos (-1: none), process, held
-- tokens, held nanos, used tokens, used nanos, wanted tokens, wanted nanos.
-- Returns {covered, new hold tokens, new hold nanos}.
-- Runs after now.lua.

local b = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local held = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local used = {tonumber(ARGV[6]), tonumber(ARGV[7])}
local want = {tonumber(ARGV[8]), tonumber(ARGV[9])}
local spent, holds = {0, 0}, {0, 0}
local vals = redis.call('HGETALL', KEYS[1])
for i = 1, #vals, 2 do
  local f, v = vals[i], tonumber(vals[i + 1])
  if f == 'st' then spent[1] = v elseif f == 'sn' then spent[2] = v
  elseif string.sub(f, 1, 3) == 'ht:' then holds[1] = holds[1] + v
  elseif string.sub(f, 1, 3) == 'hn:' then holds[2] = holds[2] + v end
end
local ok = 1
local fields = {'ht:' .. ARGV[3], 'hn:' .. ARGV[3]}
for i = 1, 2 do
  if b[i] >= 0 and used[i] > held[i] then
    local avail = b[i] - spent[i] - (holds[i] - held[i])
    local new = math.max(math.min(math.max(want[i], used[i]), avail), held[i])
    if new > held[i] then redis.call('HINCRBY', KEYS[1], fields[i], int(new - held[i])) end
    if used[i] > new then ok = 0 end
    held[i] = new
  end
end
return {ok, int(held[1]), int(held[2])}
