"""The Redis limiter of production mode: limits that hold for the gateway as a whole.

Every serving process asks the same Redis, so N processes share one RPM, TPM,
concurrency and budget counter per key (and one concurrency count per
backend). Each admission is one round trip (``EVALSHA`` of a Lua script that
checks and takes everything atomically, on Redis's own clock; the command is
encoded once per key and budget period, bar its per-request arguments);
settles are queued and written together on the loop's next turn, after the
answer that caused them, and always ahead of the next command (in its write).
Redis answers nothing to a settle or a release (``CLIENT REPLY SKIP``), and
neither can be refused for a script Redis lost (a settle is an ``EVAL`` of its
source, a release a plain ``ZREM``): an ``EVALSHA`` answered ``NOSCRIPT`` would
run again only behind the commands written after it. Concurrency slots
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
import contextlib
import logging
import math
import os
import secrets
import socket
import time
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
    format_reset,
    new_lease,
)
from usage.limits.policy import BudgetPeriod, KeyPolicy, period_end, period_id
from usage.limits.resp import RespConnection, Script, encode, encode_parts

logger = logging.getLogger(__name__)

LEASE_SECONDS = 60
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
# tokens, budget nanos (-1: none), lease ms, process, budget ttl s (0: none),
# then per request: estimate tokens, estimate nanos, lease. Returns one string
# (cheaper to read than an array): "ok reason retry-ms rpm-remaining
# rpm-reset-ms tpm-remaining tpm-reset-ms charged hold-tokens hold-nanos";
# reason "-" when allowed, -1 remaining: no such limit. Expired concurrency
# leases are swept only when the set looks full, and the budget counter's
# expiry is set when it is created: the common admission makes as few calls
# as it can.
ADMIT = (
    _NOW
    + """
local W = 60000
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local bt, bn = tonumber(ARGV[4]), tonumber(ARGV[5])
local est_t, est_n = tonumber(ARGV[9]), tonumber(ARGV[10])
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
  return table.concat({0, reason, int(math.ceil(wait)), int(rr),
    int(math.ceil(rreset)), int(tr), int(math.ceil(treset)), 0, 0, 0}, ' ')
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
local own_tf, own_nf = 'ht:' .. ARGV[7], 'hn:' .. ARGV[7]
if bt >= 0 or bn >= 0 then
  local st, sn, ht, hn = 0, 0, 0, 0
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
if maxc > 0 then
  redis.call('ZADD', KEYS[3], int(now + tonumber(ARGV[6])), ARGV[11])
  redis.call('PEXPIRE', KEYS[3], ARGV[6])
end
if rpm > 0 then
  redis.call('SET', KEYS[1], tostring(rnew), 'PX', int(math.ceil(rnew - now) + 1000))
end
if tpm > 0 then
  redis.call('SET', KEYS[2], tostring(tnew), 'PX', int(math.ceil(tnew - now) + 1000))
end
if hold_t > 0 and hold_n > 0 then
  redis.call('HSET', KEYS[4], own_tf, int(own_t + hold_t), own_nf, int(own_n + hold_n))
elseif hold_t > 0 then redis.call('HSET', KEYS[4], own_tf, int(own_t + hold_t))
elseif hold_n > 0 then redis.call('HSET', KEYS[4], own_nf, int(own_n + hold_n)) end
if fresh and (hold_t > 0 or hold_n > 0) and tonumber(ARGV[8]) > 0 then
  redis.call('EXPIRE', KEYS[4], ARGV[8])
end
return table.concat({1, '-', 0, int(rr), int(math.ceil(rreset)), int(tr),
  int(math.ceil(treset)), int(charged), int(hold_t), int(hold_n)}, ' ')
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

# KEYS: tpm, concurrency, budget. ARGV: tpm, process, budget ttl s (0: none),
# then per request: tokens to add to the TPM bucket (negative gives back),
# lease ("": none), held tokens, held nanos, used tokens, used nanos. Spent
# counts are added, this process's holds lessened by this request's (a field
# at 0 stays: the next admission sets it again); the counter's expiry is set
# when it is created (admission or here). Sent whole (EVAL) with each settle.
SETTLE = """
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
"""

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


# Written before each settle and release (see RedisLimiter._take_pending).
_NO_REPLY = encode(("CLIENT", "REPLY", "SKIP"))
_PING = encode(("PING",))


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


class _Commands:
    """One key's admission and settle commands, encoded once (per policy and
    budget period) but for their per-request arguments."""

    __slots__ = (
        "admit",
        "concurrency_key",
        "ends",
        "limit_headers",
        "period",
        "settle",
    )

    def __init__(
        self,
        limiter: RedisLimiter,
        policy: KeyPolicy,
        period: str,
        ends: float,
    ) -> None:
        prefix = policy.prefix
        budget = budget_key(prefix, period or "none")
        ttl = budget_ttl(policy.budget_period)
        self.period = period
        self.ends = ends  # Unix time the period ends (inf: never)
        self.concurrency_key = _key(prefix, "concurrency")
        scripts = limiter._scripts
        # 3 + 4 keys + 8 static + 3 per-request arguments.
        self.admit = b"*18\r\n" + encode_parts(
            (
                "EVALSHA",
                scripts["admit"].sha,
                4,
                _key(prefix, "rpm"),
                _key(prefix, "tpm"),
                self.concurrency_key,
                budget,
                policy.rpm or 0,
                policy.tpm or 0,
                policy.max_concurrency or 0,
                _none(policy.budget_tokens),
                _none(policy.budget_nanos),
                LEASE_SECONDS * 1000,
                limiter.process,
                ttl,
            )
        )
        # 3 + 3 keys + 3 static + 6 per-request arguments. EVAL, not EVALSHA:
        # nobody awaits a settle, and a NOSCRIPT answer (a Redis that lost
        # its scripts) would be sent again behind the commands written after
        # it, such as the next admission that needs the slot it frees.
        self.settle = b"*15\r\n" + encode_parts(
            (
                "EVAL",
                SETTLE,
                3,
                _key(prefix, "tpm"),
                self.concurrency_key,
                budget,
                policy.tpm or 0,
                limiter.process,
                ttl,
            )
        )
        self.limit_headers = (
            str(policy.rpm).encode() if policy.rpm is not None else b"",
            str(policy.tpm).encode() if policy.tpm is not None else b"",
        )


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
                ("acquire", ACQUIRE),
                ("renew", RENEW),
            )
        }
        # Per key prefix: the commands of its current policy and period.
        self._commands: dict[str, tuple[KeyPolicy, _Commands]] = {}
        self._leases: dict[str, str] = {}  # lease -> concurrency set key
        # Backend leases released here whose release is not yet written to
        # Redis: the next request for that backend takes one over.
        self._released: dict[str, list[str]] = {}  # backend set key -> leases
        # Settles and releases not written yet: an encoded settle, or a
        # backend's (set key, lease) whose release is encoded when written
        # (unless a request took the slot over meanwhile).
        self._pending: list[bytes | tuple[str, str]] = []
        self._flush_scheduled = False
        # Settles or releases were written that no reply has confirmed yet.
        self._unconfirmed = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._down_until = 0.0
        self._outage_logged = False

    # Lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._redis = RespConnection(self.url, self.timeout)
        loop = asyncio.get_running_loop()
        self._tasks = [
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

    def _commands_for(self, policy: KeyPolicy, now: float) -> _Commands:
        cached = self._commands.get(policy.prefix)
        if cached is not None:
            known, commands = cached
            if known is policy and now < commands.ends:
                return commands
        if policy.has_budget:
            period = period_id(policy.budget_period, now)
            ends = period_end(policy.budget_period, now) or math.inf
        else:
            period, ends = "", math.inf
        commands = _Commands(self, policy, period, ends)
        if len(self._commands) >= 10_000:  # keys come and go: bounded
            self._commands.clear()
        self._commands[policy.prefix] = (policy, commands)
        return commands

    async def admit(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision:
        if time.monotonic() < self._down_until:
            return self._unavailable(policy)
        now = self.clock()
        commands = self._commands_for(policy, now)
        lease = new_lease() if policy.max_concurrency is not None else ""
        data = commands.admit + encode_parts((tokens, nanos, lease))
        try:
            result = await self._request(self._scripts["admit"], data)
        except (RedisError, OSError) as error:
            self._failed(error)
            return self._unavailable(policy)
        self._recovered()
        try:
            ok, reason, wait_ms, rr, rreset, tr, treset, charged, hold_t, hold_n = (
                result.split(b" ")
            )
            rr, tr = int(rr), int(tr)
        except (AttributeError, ValueError):  # not the script's answer
            self._failed(RedisError(f"Unexpected limiter reply {result!r:.80}"))
            return self._unavailable(policy)
        headers: list[tuple[bytes, bytes]] = []
        requests = token_state = None
        rpm_limit, tpm_limit = commands.limit_headers
        if rpm_limit and rr >= 0:
            requests = RateState(policy.rpm, rr, int(rreset) / 1000)  # type: ignore[arg-type]
            headers += (
                (b"x-ratelimit-limit-requests", rpm_limit),
                (b"x-ratelimit-remaining-requests", b"%d" % rr),
                (b"x-ratelimit-reset-requests", format_reset(int(rreset) / 1000)),
            )
        if tpm_limit and tr >= 0:
            token_state = RateState(policy.tpm, tr, int(treset) / 1000)  # type: ignore[arg-type]
            headers += (
                (b"x-ratelimit-limit-tokens", tpm_limit),
                (b"x-ratelimit-remaining-tokens", b"%d" % tr),
                (b"x-ratelimit-reset-tokens", format_reset(int(treset) / 1000)),
            )
        if ok != b"1":
            reason = reason.decode()
            wait = int(wait_ms) / 1000
            if reason == BUDGET:
                wait = budget_retry_after(policy, now)
            return Decision(None, reason, wait, requests, token_state, headers)
        ticket = Ticket(
            policy,
            period=commands.period,
            lease=lease,
            charged_tokens=int(charged),
            held_tokens=int(hold_t),
            held_nanos=int(hold_n),
            handle=commands,
        )
        if lease:
            self._leases[lease] = commands.concurrency_key
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
        commands = ticket.handle
        if not isinstance(commands, _Commands):  # admitted by another limiter
            return
        self._queue(
            commands.settle
            + encode_parts(
                (
                    delta,
                    ticket.lease,
                    ticket.held_tokens,
                    ticket.held_nanos,
                    tokens if budgeted else 0,
                    nanos if budgeted else 0,
                )
            )
        )

    async def acquire_backend(self, backend: str, limit: int) -> str | None:
        key = backend_key(backend)
        released = self._released.get(key)
        if released:
            # A slot this process just freed and has not yet told Redis about:
            # take it over rather than race its release (the release is
            # queued behind the settles; an acquire written before it would
            # find the backend full, though one of its slots is free). This
            # is what lets admission control send a waiting request into the
            # slot the request before it left.
            lease = released.pop()
            if not released:
                del self._released[key]
            self._leases[lease] = key
            return lease
        if time.monotonic() < self._down_until:
            return "unchecked" if self.fail_open else None
        lease = new_lease()
        try:
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
        self._released.setdefault(key, []).append(lease)
        self._queue((key, lease))

    # Writing -------------------------------------------------------------------

    def _queue(self, entry: bytes | tuple[str, str]) -> None:
        """Queue a settle or release; written on the loop's next turn (after
        the answer that caused it has gone out), or ahead of the next command
        this process sends, whichever comes first: in one write either way."""
        self._pending.append(entry)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        redis = self._redis
        if not self._pending or redis is None:
            return
        if redis.is_open:
            self._unconfirmed = True
            if not redis.send_unanswered(self._take_pending()):
                self._failed(RedisConnectionError("Redis connection lost"))
        else:  # (re)connect first, off the request path
            task = asyncio.get_running_loop().create_task(self._flush_settles())
            self._tasks.append(task)
            task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    def _take_pending(self) -> bytes:
        """Every pending settle and release, encoded to be written in one go.

        Each comes after ``CLIENT REPLY SKIP``: Redis runs it and answers
        nothing, so nothing has to be read back for it (one wake-up of this
        process less per request). Its outcome is not reported: a lost settle's
        holds are reconciled by beat, a lost release's lease expires.
        """
        pending, self._pending = self._pending, []
        commands: list[bytes] = []
        for entry in pending:
            if isinstance(entry, tuple):
                key, lease = entry  # a backend lease's release (release_backend)
                released = self._released.get(key, [])
                if lease not in released:
                    continue  # taken over by a request since: nothing to free
                released.remove(lease)
                if not released:
                    del self._released[key]
                # A plain command: it cannot be refused for a missing script
                # (and so run after the acquire that needs the slot).
                entry = encode(("ZREM", key, lease))
            commands += (_NO_REPLY, entry)
        return b"".join(commands)

    async def _flush_settles(self) -> None:
        """Write what is pending and wait until Redis has run it."""
        redis = self._redis
        if redis is None or not (self._pending or self._unconfirmed):
            return
        try:
            await redis.open()
            self._unconfirmed = False
            # Answered once everything written before it has run.
            await redis.request(_PING, self._take_pending())
        except (RedisError, OSError) as error:
            # Holds and leases expire or are reconciled; spend is recounted
            # from the usage tables by the reconciliation.
            self._failed(error)
            self._drop_pending()

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, []
        for entry in pending:
            if isinstance(entry, tuple):
                key, lease = entry
                released = self._released.get(key, [])
                if lease in released:
                    released.remove(lease)
                    if not released:
                        del self._released[key]

    async def _request(self, script: Script, data: bytes) -> Any:
        redis = self._redis
        if redis is None:
            raise RedisConnectionError("The limiter is not started")
        before = b""
        if self._pending:
            # Settles and releases go first, in the same write: a slot freed
            # here is free for this command (on a connection being opened
            # too: after the set-up, ahead of this command).
            if not redis.is_open:
                await redis.open()
            before = self._take_pending()
        return await redis.run_encoded(script, data, before)

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts[name]
        return await self._request(
            script, encode(("EVALSHA", script.sha, len(keys), *keys, *args))
        )

    # Background ----------------------------------------------------------------

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
