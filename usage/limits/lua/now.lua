-- Put before the scripts that read Redis's clock: now, in milliseconds (Redis's
-- TIME, so every process agrees), and int(), a number written as an integer.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function int(x) return string.format('%.0f', x) end
