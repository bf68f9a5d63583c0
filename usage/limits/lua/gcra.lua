-- Put before the admission scripts, after now.lua: gcra(key, limit, cost)
-- takes cost from a bucket of limit per minute (W ms) whose theoretical
-- arrival time is stored at key; returns allowed, the new TAT, what is left,
-- ms until the bucket is full again, and ms to wait when refused. Takes
-- nothing itself: the caller writes the TAT once every check passed.

local W = 60000
local function gcra(key, limit, cost)
  local interval = W / limit
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new = tat + cost * interval
  if new - now > W + 0.001 then
    local rem = math.max(math.floor((W - (tat - now)) / interval + 1e-9), 0)
    return false, tat, rem, tat - now, new - now - W
  end
  local rem = math.max(math.floor((W - (new - now)) / interval + 1e-9), 0)
  return true, new, rem, new - now, 0
end
