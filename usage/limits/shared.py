"""The Redis limiter of production mode: limits that hold for the gateway as a whole.

Every serving process asks the same Redis, so N processes share one RPM, TPM,
concurrency and budget counter per key (and one concurrency count per
backend). Each admission is one round trip (``EVALSHA`` of a Lua script that
checks and takes everything atomically, on Redis's own clock); settling is
queued and sent in pipelined batches off the request path. Concurrency slots
are leases that this process renews while it holds them, so a process killed
without warning frees its slots when they expire (LEASE_SECONDS). Budget holds
are kept per process (``ht:<process>`` fields) and the beat reconciliation
drops those of processes that stopped renewing their liveness key.

If Redis cannot be reached, ``fail_open`` decides: let the request through
unchecked, or refuse it (503). Either way it is logged (once per outage) and
counted, and Redis is not asked again for a second, so an outage costs no
timeout per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from usage.limits.limiter import (
    BUDGET,
    UNAVAILABLE,
    Decision,
    RateState,
    Ticket,
    budget_retry_after,
    new_lease,
    rate_headers,
)
from usage.limits.policy import BudgetPeriod, KeyPolicy, period_id
from usage.limits.resp import RespConnection, Script

logger = logging.getLogger(__name__)

LEASE_SECONDS = 60
# A backend slot release is a settle with this (empty) first key, as before.
RELEASE = ""
# How long an acquire waits for this process's own release of the slot.
RELEASE_WAIT_SECONDS = 1.0
RENEW_SECONDS = 10
OUTAGE_BACKOFF = 1.0
# Budget counters of a period outlive it a little (reports read the database).
_BUDGET_TTL = {BudgetPeriod.DAY: 3 * 86_400, BudgetPeriod.MONTH: 40 * 86_400}

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function int(x) return string.format('%.0f', x) end
"""

# KEYS: rpm, tpm, concurrency, budget. ARGV: rpm, tpm, max concurrency, budget
# tokens, budget nanos (-1: none), estimate tokens, estimate nanos, lease,
# lease ms, process, budget ttl s (0: none). Returns {ok, reason, retry ms, rpm
# remaining, rpm reset ms, tpm remaining, tpm reset ms, charged, hold tokens,
# hold nanos}; -1 remaining: no such limit.
ADMIT = (
    _NOW
    + """
local W = 60000
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local bt, bn = tonumber(ARGV[4]), tonumber(ARGV[5])
local est_t, est_n = tonumber(ARGV[6]), tonumber(ARGV[7])
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
local rr, rreset, tr, treset = -1, 0, -1, 0
local rnew, tnew, charged = 0, 0, 0
local function no(reason, wait)
  return {0, reason, int(math.ceil(wait)), rr, int(math.ceil(rreset)), tr,
          int(math.ceil(treset)), 0, 0, 0}
end
if maxc > 0 then
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
local hold_t, hold_n = 0, 0
if bt >= 0 or bn >= 0 then
  local st, sn, ht, hn = 0, 0, 0, 0
  local vals = redis.call('HGETALL', KEYS[4])
  for i = 1, #vals, 2 do
    local f, v = vals[i], tonumber(vals[i + 1])
    if f == 'st' then st = v elseif f == 'sn' then sn = v
    elseif string.sub(f, 1, 3) == 'ht:' then ht = ht + v
    elseif string.sub(f, 1, 3) == 'hn:' then hn = hn + v end
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
if maxc > 0 then
  redis.call('ZADD', KEYS[3], int(now + tonumber(ARGV[9])), ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[9])
end
if rpm > 0 then
  redis.call('SET', KEYS[1], tostring(rnew), 'PX', int(math.ceil(rnew - now) + 1000))
end
if tpm > 0 then
  redis.call('SET', KEYS[2], tostring(tnew), 'PX', int(math.ceil(tnew - now) + 1000))
end
if hold_t > 0 then redis.call('HINCRBY', KEYS[4], 'ht:' .. ARGV[10], int(hold_t)) end
if hold_n > 0 then redis.call('HINCRBY', KEYS[4], 'hn:' .. ARGV[10], int(hold_n)) end
if (hold_t > 0 or hold_n > 0) and tonumber(ARGV[11]) > 0 then
  redis.call('EXPIRE', KEYS[4], ARGV[11])
end
return {1, '', 0, rr, int(math.ceil(rreset)), tr, int(math.ceil(treset)),
        int(charged), int(hold_t), int(hold_n)}
"""
)

# KEYS: budget. ARGV: budget tokens, budget nanos (-1: none), process, held
# tokens, held nanos, used tokens, used nanos, wanted tokens, wanted nanos.
# Returns {covered, new hold tokens, new hold nanos}.
COVER = (
    _NOW
    + """
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
"""
)

# KEYS: tpm, concurrency, budget. ARGV: tpm, tokens to add to the TPM bucket
# (negative gives back), lease ("": none), process, held tokens, held nanos,
# used tokens, used nanos, budget ttl s (0: none).
SETTLE = (
    _NOW
    + """
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and delta ~= 0 then
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  tat = math.max(tat + delta * 60000 / tpm, now)
  redis.call('SET', KEYS[1], tostring(tat), 'PX', int(math.ceil(tat - now) + 1000))
end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local ht, hn = tonumber(ARGV[5]), tonumber(ARGV[6])
local ut, un = tonumber(ARGV[7]), tonumber(ARGV[8])
if ht > 0 or hn > 0 or ut > 0 or un > 0 then
  if ut > 0 then redis.call('HINCRBY', KEYS[3], 'st', int(ut)) end
  if un > 0 then redis.call('HINCRBY', KEYS[3], 'sn', int(un)) end
  for _, pair in ipairs({{'ht:', ht}, {'hn:', hn}}) do
    if pair[2] > 0 then
      local field = pair[1] .. ARGV[4]
      if redis.call('HINCRBY', KEYS[3], field, int(-pair[2])) <= 0 then
        redis.call('HDEL', KEYS[3], field)
      end
    end
  end
  if tonumber(ARGV[9]) > 0 then redis.call('EXPIRE', KEYS[3], ARGV[9]) end
end
return 1
"""
)

# KEYS: concurrency. ARGV: limit, lease, lease ms. Returns 1 if taken.
ACQUIRE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[3])), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: liveness key, then the concurrency sets. ARGV: lease ms, liveness s,
# then one lease per set. Extends each lease this process still holds.
RENEW = (
    _NOW
    + """
redis.call('SET', KEYS[1], '1', 'EX', ARGV[2])
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', int(now + tonumber(ARGV[1])), ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return 1
"""
)

# KEYS: budget. ARGV: tokens, nanos, ttl s (0: none). Raises the spent counters
# to at least the given values.
RAISE_SPENT = """
local function int(x) return string.format('%.0f', x) end
local st = tonumber(redis.call('HGET', KEYS[1], 'st') or '0')
local sn = tonumber(redis.call('HGET', KEYS[1], 'sn') or '0')
if tonumber(ARGV[1]) > st then redis.call('HSET', KEYS[1], 'st', ARGV[1]) end
if tonumber(ARGV[2]) > sn then redis.call('HSET', KEYS[1], 'sn', ARGV[2]) end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""


def _key(prefix: str, what: str) -> str:
    # The braces put all of one client key's counters in one cluster slot.
    return f"nx:{{{prefix}}}:{what}"


def budget_key(prefix: str, period: str) -> str:
    return _key(prefix, f"budget:{period}")


def backend_key(backend: str) -> str:
    return f"nx:backend:{{{backend}}}:concurrency"


def liveness_key(process: str) -> str:
    return f"nx:process:{process}"


def budget_ttl(policy_period: str) -> int:
    return _BUDGET_TTL.get(policy_period, 0)  # type: ignore[call-overload]


def _none(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimiter:
    """Limits and budgets in Redis, shared by every serving process."""

    shared = True

    def __init__(
        self,
        url: str,
        *,
        fail_open: bool = True,
        timeout: float = 0.5,
        on_error: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.fail_open = fail_open
        self.timeout = timeout
        self.on_error = on_error
        self.clock = clock
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._redis: RespConnection | None = None
        self._scripts = {
            name: Script(source)
            for name, source in (
                ("admit", ADMIT),
                ("cover", COVER),
                ("settle", SETTLE),
                ("acquire", ACQUIRE),
                ("renew", RENEW),
            )
        }
        self._leases: dict[str, str] = {}  # lease -> concurrency set key
        self._settles: deque[tuple[list[str], list[Any]]] = deque()
        self._wake = asyncio.Event()
        # Backend slot releases of this process not yet written to Redis, per
        # slot key, and an event set after each batch of settles is written.
        self._releasing: dict[str, int] = {}
        self._settled = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._down_until = 0.0
        self._outage_logged = False

    # Lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._redis = RespConnection(self.url, self.timeout)
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._send_settles(), name="limiter-settle"),
            loop.create_task(self._renew_periodically(), name="limiter-renew"),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._redis is not None:
            await self._flush_settles()
            await self._redis.close()
            self._redis = None

    # Admission -----------------------------------------------------------------

    async def admit(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision:
        if time.monotonic() < self._down_until:
            return self._unavailable(policy)
        now = self.clock()
        prefix = policy.prefix
        period = period_id(policy.budget_period, now) if policy.has_budget else ""
        lease = new_lease() if policy.max_concurrency is not None else ""
        try:
            result = await self._run(
                "admit",
                [
                    _key(prefix, "rpm"),
                    _key(prefix, "tpm"),
                    _key(prefix, "concurrency"),
                    budget_key(prefix, period or "none"),
                ],
                [
                    policy.rpm or 0,
                    policy.tpm or 0,
                    policy.max_concurrency or 0,
                    _none(policy.budget_tokens),
                    _none(policy.budget_nanos),
                    tokens,
                    nanos,
                    lease,
                    LEASE_SECONDS * 1000,
                    self.process,
                    budget_ttl(policy.budget_period),
                ],
            )
        except (RedisError, OSError) as error:
            self._failed(error)
            return self._unavailable(policy)
        self._recovered()
        ok, reason, wait_ms, rr, rreset, tr, treset, charged, hold_t, hold_n = result
        requests = (
            RateState(policy.rpm, int(rr), int(rreset) / 1000)
            if policy.rpm is not None and int(rr) >= 0
            else None
        )
        token_state = (
            RateState(policy.tpm, int(tr), int(treset) / 1000)
            if policy.tpm is not None and int(tr) >= 0
            else None
        )
        headers = rate_headers(requests, token_state)
        if not int(ok):
            reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            wait = int(wait_ms) / 1000
            if reason == BUDGET:
                wait = budget_retry_after(policy, now)
            return Decision(None, reason, wait, requests, token_state, headers)
        ticket = Ticket(
            policy,
            period=period,
            lease=lease,
            charged_tokens=int(charged),
            held_tokens=int(hold_t),
            held_nanos=int(hold_n),
        )
        if lease:
            self._leases[lease] = _key(prefix, "concurrency")
        return Decision(ticket, "", 0.0, requests, token_state, headers)

    async def cover(
        self, ticket: Ticket, used: tuple[int, int], want: tuple[int, int]
    ) -> bool:
        if ticket.unchecked or not ticket.period:
            return True
        if time.monotonic() < self._down_until:
            return self.fail_open
        policy = ticket.policy
        try:
            ok, hold_t, hold_n = await self._run(
                "cover",
                [budget_key(policy.prefix, ticket.period)],
                [
                    _none(policy.budget_tokens),
                    _none(policy.budget_nanos),
                    self.process,
                    ticket.held_tokens,
                    ticket.held_nanos,
                    *used,
                    *want,
                ],
            )
        except (RedisError, OSError) as error:
            self._failed(error)
            return self.fail_open
        ticket.held_tokens, ticket.held_nanos = int(hold_t), int(hold_n)
        return bool(int(ok))

    def settle(self, ticket: Ticket, tokens: int, nanos: int) -> None:
        if ticket.unchecked:
            return
        policy = ticket.policy
        if ticket.lease:
            self._leases.pop(ticket.lease, None)
        delta = tokens - ticket.charged_tokens if policy.tpm is not None else 0
        budgeted = bool(ticket.period)
        if not (delta or ticket.lease or budgeted):
            return
        prefix = policy.prefix
        self._settles.append(
            (
                [
                    _key(prefix, "tpm"),
                    _key(prefix, "concurrency"),
                    budget_key(prefix, ticket.period or "none"),
                ],
                [
                    policy.tpm or 0,
                    delta,
                    ticket.lease,
                    self.process,
                    ticket.held_tokens,
                    ticket.held_nanos,
                    tokens if budgeted else 0,
                    nanos if budgeted else 0,
                    budget_ttl(policy.budget_period),
                ],
            )
        )
        self._wake.set()

    async def acquire_backend(self, backend: str, limit: int) -> str | None:
        if time.monotonic() < self._down_until:
            return "unchecked" if self.fail_open else None
        lease = new_lease()
        key = backend_key(backend)
        try:
            taken = await self._run(
                "acquire", [key], [limit, lease, LEASE_SECONDS * 1000]
            )
            if not int(taken) and self._releasing.get(key):
                # The slot is this process's own, released a moment ago and
                # still on its way (settles are batched): wait for it, once.
                await self._wait_for_releases(key)
                taken = await self._run(
                    "acquire", [key], [limit, lease, LEASE_SECONDS * 1000]
                )
        except (RedisError, OSError) as error:
            self._failed(error)
            return "unchecked" if self.fail_open else None
        if not int(taken):
            return None
        self._leases[lease] = key
        return lease

    def release_backend(self, backend: str, lease: str) -> None:
        if lease == "unchecked" or self._leases.pop(lease, None) is None:
            return
        key = backend_key(backend)
        self._releasing[key] = self._releasing.get(key, 0) + 1
        self._settles.append(([RELEASE, key, ""], [0, 0, lease, "", 0, 0, 0, 0, 0]))
        self._wake.set()

    async def _wait_for_releases(self, key: str) -> None:
        """Wait (a second at most) until this process's releases of `key` are
        written to Redis."""
        deadline = time.monotonic() + RELEASE_WAIT_SECONDS
        while self._releasing.get(key) and time.monotonic() < deadline:
            settled = self._settled
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await settled.wait()
            except TimeoutError:
                return

    # Background ----------------------------------------------------------------

    async def _send_settles(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush_settles()

    async def _flush_settles(self) -> None:
        redis = self._redis
        while self._settles and redis is not None:
            batch = [
                self._settles.popleft() for _ in range(min(len(self._settles), 500))
            ]
            script = self._scripts["settle"]
            # Written back to back on the one connection: pipelined.
            results = await asyncio.gather(
                *(redis.run(script, keys, args) for keys, args in batch),
                return_exceptions=True,
            )
            self._note_settled(batch)
            for result in results:
                if isinstance(result, RedisError | OSError):
                    # Holds and leases expire or are reconciled; spend is
                    # recounted from the usage tables by the reconciliation.
                    self._failed(result)
                    return
                if isinstance(result, BaseException):
                    raise result

    def _note_settled(self, batch: list[tuple[list[str], list[Any]]]) -> None:
        """Count the batch's slot releases as written; wake who waits for them."""
        for keys, _ in batch:
            if keys[0] == RELEASE:
                count = self._releasing.get(keys[1], 0) - 1
                if count > 0:
                    self._releasing[keys[1]] = count
                else:
                    self._releasing.pop(keys[1], None)
        settled, self._settled = self._settled, asyncio.Event()
        settled.set()

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self._redis is None:
            raise RedisConnectionError("The limiter is not started")
        return await self._redis.run(self._scripts[name], keys, args)

    async def _renew_periodically(self) -> None:
        while True:
            try:
                await self.renew()
            except (RedisError, OSError) as error:
                self._failed(error)
            await asyncio.sleep(RENEW_SECONDS)

    async def renew(self) -> None:
        """Extend the leases this process holds; mark the process alive."""
        leases = list(self._leases.items())
        await self._run(
            "renew",
            [liveness_key(self.process), *(key for _, key in leases)],
            [
                LEASE_SECONDS * 1000,
                LEASE_SECONDS,
                *(lease for lease, _ in leases),
            ],
        )

    # Outages -------------------------------------------------------------------

    def _unavailable(self, policy: KeyPolicy) -> Decision:
        if self.fail_open:
            return Decision(Ticket(policy, unchecked=True))
        return Decision(None, UNAVAILABLE, OUTAGE_BACKOFF)

    def _failed(self, error: BaseException) -> None:
        self._down_until = time.monotonic() + OUTAGE_BACKOFF
        if self.on_error is not None:
            self.on_error()
        if not self._outage_logged:
            self._outage_logged = True
            logger.error(
                "The limiter cannot reach Redis (%s); requests are %s until it is back",
                error,
                "let through unchecked" if self.fail_open else "refused (503)",
            )

    def _recovered(self) -> None:
        if self._outage_logged:
            self._outage_logged = False
            logger.warning("The limiter reaches Redis again")
