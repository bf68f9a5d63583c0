"""The Redis limiter of production mode: limits that hold for the gateway as a whole.

Every serving process asks the same Redis, so N processes share one RPM, TPM,
concurrency and budget counter per key (and one concurrency count per
backend). An admission is one round trip (``EVALSHA`` of a Lua script that
checks and takes everything atomically, on Redis's own clock, ``lua/``; the
command is encoded once per key and budget period, bar its per-request
arguments, ``commands.KeyCommands``), or none for a busy key far from its
limits, admitted from the reserve an earlier admission took for it
(``reserve.Reserve``). Settles are queued and written together on the loop's
next turn, after the answer that caused them, and always ahead of the next
command (in its write); those of a key holding a reserve are summed for up to
COALESCE_SECONDS first (``writes.PendingWrites``).
Redis answers nothing to a settle or a release (``CLIENT REPLY SKIP``), and
neither can be refused for a script Redis lost (a settle is an ``EVAL`` of its
source, a release a plain ``ZREM``): an ``EVALSHA`` answered ``NOSCRIPT`` would
run again only behind the commands written after it. Concurrency slots
are leases that this process renews while it holds them, so a process killed
without warning frees its slots when they expire (LEASE_SECONDS). Budget holds
are kept per process (``ht:<process>`` fields): each process writes its own
as it counts them with every renewal, and the beat reconciliation drops those
of processes that stopped renewing their liveness key.

If Redis cannot be reached, ``fail_open`` decides: let the request through
unchecked, or refuse it (503). Either way it is logged (once per outage) and
counted, and Redis is not asked again for a second, so an outage costs no
timeout per request.
"""

from __future__ import annotations

import asyncio
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

from nexus_lib.service import periodic
from usage.limits.commands import KeyCommands, TeamCommands, key_rate_headers
from usage.limits.limiter import (
    BUDGET,
    UNAVAILABLE,
    WINDOW,
    Decision,
    RateState,
    TeamTicket,
    Ticket,
    budget_retry_after,
    new_lease,
    rate_headers,
    tighter,
)
from usage.limits.policy import KeyPolicy, LimitLayer, period_end, period_id
from usage.limits.redis_keys import LEASE_SECONDS, backend_key, budget_key, liveness_key
from usage.limits.reserve import RESERVE_REQUESTS, RESERVE_SECONDS, Reserve
from usage.limits.resp import RespConnection, Script, encode, encode_parts
from usage.limits.scripts import (
    ACQUIRE,
    ADMIT,
    ADMIT_LAYERS,
    COVER,
    HOLDS,
    PLACES,
    RENEW,
    RETURN,
    limit_arg,
)
from usage.limits.writes import NO_REPLY, PendingWrites

logger = logging.getLogger(__name__)

RENEW_SECONDS = 10
OUTAGE_BACKOFF = 1.0


class RedisLimiter:
    """Limits and budgets in Redis, shared by every serving process."""

    name = "limiter"
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
                ("admit_layers", ADMIT_LAYERS),
                ("cover", COVER),
                ("acquire", ACQUIRE),
                ("places", PLACES),
                ("renew", RENEW),
            )
        }
        # Per key prefix: the commands of its current policy and period.
        self._commands: dict[str, tuple[KeyPolicy, KeyCommands]] = {}
        self._leases: dict[str, str] = {}  # lease -> concurrency set key
        # Per budget counter: [tokens, nanos] this process holds (its requests'
        # holds and its reserve), and the counter's expiry.
        self._holds: dict[str, list[int]] = {}
        self._holds_ttl: dict[str, int] = {}
        # Admissions and covers sent whose holds are not counted yet.
        self._unaccounted = 0
        # Settles, reserve returns and releases not written yet.
        self._writes = PendingWrites(self._failed)
        self._renewing = periodic(
            "limiter-renew", RENEW_SECONDS, self._renew_once, immediately=True
        )
        self._down_until = 0.0
        self._outage_logged = False

    # Lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Connect lazily and start renewing this process's leases."""
        self._redis = self._writes.redis = RespConnection(self.url, self.timeout)
        self._renewing.start()

    async def stop(self) -> None:
        """Stop renewing; write what is pending and close the connection."""
        tasks = self._writes.cancel()
        await asyncio.gather(self._renewing.stop(), *tasks, return_exceptions=True)
        if self._redis is not None:
            for _, commands in self._commands.values():
                self._retire(commands)
            await self._writes.flush()
            await self._redis.close()
            self._redis = self._writes.redis = None

    # Admission -----------------------------------------------------------------

    def _commands_for(self, policy: KeyPolicy, now: float) -> KeyCommands:
        cached = self._commands.get(policy.prefix)
        if cached is not None:
            known, commands = cached
            if known is policy and now < commands.ends:
                return commands
            self._retire(commands)  # the policy or the budget period changed
        period, ends = _period(policy, now)
        team = None
        if policy.team is not None:
            team_period, team_ends = _period(policy.team, now)
            ends = min(ends, team_ends)
            team = TeamCommands(policy.team, team_period, self.process, self._holds_of)
        commands = KeyCommands(
            policy,
            period,
            ends,
            self.process,
            self._scripts["admit" if team is None else "admit_layers"].sha,
            self._holds_of,
            team,
        )
        if len(self._commands) >= 10_000:  # keys come and go: bounded
            for _, stale in self._commands.values():
                self._retire(stale)
            self._commands.clear()
        self._commands[policy.prefix] = (policy, commands)
        return commands

    def _holds_of(self, budget: str, ttl: int) -> list[int]:
        self._holds_ttl[budget] = ttl
        return self._holds.setdefault(budget, [0, 0])

    async def admit(self, policy: KeyPolicy, tokens: int, nanos: int) -> Decision:
        now = self.clock()
        commands = self._commands_for(policy, now)
        if commands.team is not None:
            return await self._admit_layers(policy, commands, tokens, nanos, now)
        mono = time.monotonic()
        if commands.reserve is not None:
            redis = self._redis
            # Not with the connection lost: Redis may be down, and a limiter
            # that fails closed refuses from the moment it knows.
            if redis is not None and redis.is_open:
                decision = commands.admit_reserved(policy, tokens, nanos, mono)
                if decision is not None:
                    return decision
            # Its leftovers go back ahead of this admission, in its write.
            self._retire(commands)
        if mono < self._down_until:
            return self._unavailable(policy)
        # A key admitted here moments ago is busy: take a reserve this time,
        # unless an admission that overlaps this one is taking one.
        want = (
            RESERVE_REQUESTS
            if mono < commands.busy_until and not commands.reserving
            else 0
        )
        commands.busy_until = mono + RESERVE_SECONDS
        commands.reserving = commands.reserving or want > 0
        lease, slots = "", 0
        if policy.max_concurrency is not None:
            lease = new_lease()
            slots = min(2 * commands.in_flight + 4, RESERVE_REQUESTS) if want else 0
        data = commands.admit + encode_parts((tokens, nanos, lease, want, slots))
        self._unaccounted += 1
        try:
            return self._admitted(
                policy,
                commands,
                lease,
                await self._request(self._scripts["admit"], data),
                now,
                mono,
            )
        except (RedisError, OSError) as error:
            self._failed(error)
            return self._unavailable(policy)
        finally:
            self._unaccounted -= 1
            if want:
                commands.reserving = False

    def _admitted(
        self,
        policy: KeyPolicy,
        commands: KeyCommands,
        lease: str,
        result: Any,
        now: float,
        mono: float,
    ) -> Decision:
        """The decision of an admission Redis answered; what it took counted."""
        self._recovered()
        try:
            (ok, reason, wait_ms, rr, rreset, tr, treset, charged, hold_t, hold_n) = (
                fields := result.split(b" ")
            )[:10]
            rr, tr = int(rr), int(tr)
            reserved, reserved_slots = int(fields[10]), int(fields[11])
        except (AttributeError, ValueError, IndexError):  # not the script's answer
            self._failed(RedisError(f"Unexpected limiter reply {result!r:.80}"))
            return self._unavailable(policy)
        rreset_s, treset_s = int(rreset) / 1000, int(treset) / 1000
        headers, requests, token_state = key_rate_headers(
            policy, rr, rreset_s, tr, treset_s
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
            commands.in_flight += 1
        holds = commands.holds
        if holds is not None:
            holds[0] += ticket.held_tokens + int(fields[13])
            holds[1] += ticket.held_nanos + int(fields[14])
        if reserved > 0:
            self._grant(
                commands, fields, lease, reserved_slots, mono, rreset_s, treset_s
            )
        return Decision(ticket, "", 0.0, requests, token_state, headers)

    async def _admit_layers(
        self,
        policy: KeyPolicy,
        commands: KeyCommands,
        tokens: int,
        nanos: int,
        now: float,
    ) -> Decision:
        """Admit a key with team limits: its limits and its team's in one round
        trip (the layered script), with no reserve."""
        if time.monotonic() < self._down_until:
            return self._unavailable(policy)
        team = commands.team
        assert team is not None and policy.team is not None
        lease = new_lease() if policy.max_concurrency is not None else ""
        team_lease = new_lease() if policy.team.max_concurrency is not None else ""
        data = commands.admit + encode_parts((tokens, nanos, lease, team_lease))
        self._unaccounted += 1
        try:
            result = await self._request(self._scripts["admit_layers"], data)
        except (RedisError, OSError) as error:
            self._failed(error)
            return self._unavailable(policy)
        finally:
            self._unaccounted -= 1
        self._recovered()
        try:
            fields = [int(field) for field in result.split(b" ")[4:18]]
            ok, reason, layer, wait_ms = result.split(b" ")[:4]
            layer = int(layer)
        except (AttributeError, ValueError) as error:  # not the script's answer
            self._failed(
                RedisError(f"Unexpected limiter reply {result!r:.80}: {error}")
            )
            return self._unavailable(policy)
        mine, theirs = fields[:7], fields[7:14]
        requests = tighter(
            _rate(policy.rpm, mine[0], mine[1]),
            _rate(policy.team.rpm, theirs[0], theirs[1]),
        )
        token_state = tighter(
            _rate(policy.tpm, mine[2], mine[3]),
            _rate(policy.team.tpm, theirs[2], theirs[3]),
        )
        headers = rate_headers(requests, token_state)
        if ok != b"1":
            refused = policy if layer == 1 else policy.team
            reason = reason.decode()
            wait = int(wait_ms) / 1000
            if reason == BUDGET:
                wait = budget_retry_after(refused, now)
            return Decision(
                None,
                reason,
                wait,
                requests,
                token_state,
                headers,
                scope="key" if layer == 1 else "team",
            )
        ticket = Ticket(
            policy,
            period=commands.period,
            lease=lease,
            charged_tokens=mine[4],
            held_tokens=mine[5],
            held_nanos=mine[6],
            handle=commands,
            team=TeamTicket(team.period, team_lease, *theirs[4:7]),
        )
        if lease:
            self._leases[lease] = commands.concurrency_key
        if team_lease:
            self._leases[team_lease] = team.concurrency_key
        for holds, held in ((commands.holds, mine), (team.holds, theirs)):
            if holds is not None:
                holds[0] += held[5]
                holds[1] += held[6]
        return Decision(ticket, "", 0.0, requests, token_state, headers)

    def _grant(
        self,
        commands: KeyCommands,
        fields: list[bytes],
        lease: str,
        slots: int,
        mono: float,
        requests_reset: float,
        tokens_reset: float,
    ) -> None:
        """Keep the reserve an admission took (see Reserve)."""
        # One reserve per key: one still here (taken by an admission that
        # overlapped) goes back rather than being dropped with what it holds.
        self._retire(commands)
        leases = [f"{lease}:{index}" for index in range(1, slots + 1)]
        for slot in leases:
            self._leases[slot] = commands.concurrency_key
        reserve = commands.reserve = Reserve(
            int(fields[10]),
            int(fields[12]),
            int(fields[13]),
            int(fields[14]),
            leases,
            mono + RESERVE_SECONDS,
            mono + requests_reset,
            mono + tokens_reset,
        )
        asyncio.get_running_loop().call_later(
            RESERVE_SECONDS, self._expire, commands, reserve
        )

    def _expire(self, commands: KeyCommands, reserve: Reserve) -> None:
        if commands.reserve is reserve:
            self._retire(commands)

    def _retire(self, commands: KeyCommands) -> None:
        """Give the key's reserve back: its leftovers, written with the settles."""
        reserve = commands.reserve
        if reserve is None:
            return
        commands.reserve = None
        slots, reserve.slots = reserve.slots, []
        for slot in slots:
            self._leases.pop(slot, None)
        holds = commands.holds
        if holds is not None:
            holds[0] -= reserve.budget_tokens
            holds[1] -= reserve.budget_nanos
        rpm, tpm = commands.rates
        requests = reserve.requests if rpm else 0
        tokens = reserve.tokens if tpm else 0
        if requests or tokens or reserve.budget_tokens or reserve.budget_nanos or slots:
            self._writes.queue(
                encode(
                    (
                        "EVAL",
                        RETURN,
                        4,
                        *commands.keys,
                        rpm,
                        tpm,
                        self.process,
                        requests,
                        tokens,
                        reserve.budget_tokens,
                        reserve.budget_nanos,
                        *slots,
                    )
                )
            )

    async def cover(
        self, ticket: Ticket, used: tuple[int, int], want: tuple[int, int]
    ) -> bool:
        if ticket.unchecked:
            return True
        if time.monotonic() < self._down_until:
            return self.fail_open
        commands = ticket.handle
        if not isinstance(commands, KeyCommands):  # admitted by another limiter
            return True
        # The key's budget and its team's, each with this ticket's hold on it.
        budgets: list[tuple[LimitLayer, Ticket | TeamTicket, list[int] | None]] = []
        if ticket.period:
            budgets.append((ticket.policy, ticket, commands.holds))
        team = ticket.team
        if team is not None and team.period and ticket.policy.team is not None:
            assert commands.team is not None
            budgets.append((ticket.policy.team, team, commands.team.holds))
        if not budgets:
            return True
        args: list[Any] = [self.process, *used, *want]
        for layer, hold, _ in budgets:
            args += (
                limit_arg(layer.budget_tokens),
                limit_arg(layer.budget_nanos),
                hold.held_tokens,
                hold.held_nanos,
            )
        keys = [budget_key(layer.prefix, hold.period) for layer, hold, _ in budgets]
        self._unaccounted += 1
        try:
            ok, *held = await self._run("cover", keys, args)
            for index, (_, hold, holds) in enumerate(budgets):
                tokens, nanos = int(held[2 * index]), int(held[2 * index + 1])
                if holds is not None:
                    holds[0] += tokens - hold.held_tokens
                    holds[1] += nanos - hold.held_nanos
                hold.held_tokens, hold.held_nanos = tokens, nanos
            return bool(int(ok))
        except (RedisError, OSError) as error:
            self._failed(error)
            return self.fail_open
        finally:
            self._unaccounted -= 1

    def settle(self, ticket: Ticket, tokens: int, nanos: int) -> None:
        if ticket.unchecked:
            return
        policy = ticket.policy
        commands = ticket.handle
        if not isinstance(commands, KeyCommands):  # admitted by another limiter
            return
        if ticket.team is not None and commands.team is not None:
            self._settle_team(ticket.team, commands.team, tokens, nanos, policy)
        lease = ticket.lease
        if lease:
            commands.in_flight -= 1
            reserve = commands.reserve
            if reserve is not None and len(reserve.slots) < reserve.slot_cap:
                reserve.slots.append(lease)  # the key's next request here takes it
                lease = ""
            else:
                self._leases.pop(lease, None)
        delta = tokens - ticket.charged_tokens if policy.tpm is not None else 0
        if delta and commands.reserve is not None:
            # The next headers from the reserve show the difference given back
            # (or taken), as Redis's bucket will once the settle is written.
            reserve = commands.reserve
            reserve.tokens_reset = max(
                reserve.tokens_reset + delta * WINDOW / policy.tpm,  # type: ignore[operator]
                time.monotonic(),
            )
        budgeted = bool(ticket.period)
        holds = commands.holds
        if holds is not None:
            holds[0] -= ticket.held_tokens
            holds[1] -= ticket.held_nanos
        if not (delta or lease or budgeted):
            return
        used_t, used_n = (tokens, nanos) if budgeted else (0, 0)
        if not lease and commands.reserve is not None:
            # Far from its limits: summed with the key's other settles.
            unsettled = commands.unsettled
            if unsettled is None:
                commands.unsettled = [
                    delta,
                    ticket.held_tokens,
                    ticket.held_nanos,
                    used_t,
                    used_n,
                ]
                self._writes.coalesce(commands)
            else:
                unsettled[0] += delta
                unsettled[1] += ticket.held_tokens
                unsettled[2] += ticket.held_nanos
                unsettled[3] += used_t
                unsettled[4] += used_n
            return
        self._writes.queue(
            commands.settle
            + encode_parts(
                (
                    delta,
                    lease,
                    ticket.held_tokens,
                    ticket.held_nanos,
                    used_t,
                    used_n,
                )
            )
        )

    def _settle_team(
        self,
        ticket: TeamTicket,
        commands: TeamCommands,
        tokens: int,
        nanos: int,
        policy: KeyPolicy,
    ) -> None:
        """Queue the settle of a request's take from its team's limits."""
        team = policy.team
        assert team is not None
        if ticket.lease:
            self._leases.pop(ticket.lease, None)
        if commands.holds is not None:
            commands.holds[0] -= ticket.held_tokens
            commands.holds[1] -= ticket.held_nanos
        delta = tokens - ticket.charged_tokens if team.tpm is not None else 0
        used_t, used_n = (tokens, nanos) if ticket.period else (0, 0)
        if delta or ticket.lease or ticket.period:
            self._writes.queue(
                commands.settle
                + encode_parts(
                    (
                        delta,
                        ticket.lease,
                        ticket.held_tokens,
                        ticket.held_nanos,
                        used_t,
                        used_n,
                    )
                )
            )

    async def acquire_backend(self, backend: str, limit: int) -> str | None:
        key = backend_key(backend)
        released = self._writes.released.get(key)
        if released:
            # A slot this process just freed and has not yet told Redis about:
            # take it over rather than race its release (the release is
            # queued behind the settles; an acquire written before it would
            # find the backend full, though one of its slots is free). This
            # is what lets admission control send a waiting request into the
            # slot the request before it left.
            lease = released.pop()
            if not released:
                del self._writes.released[key]
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
        writes = self._writes
        writes.released.setdefault(key, []).append(lease)
        writes.queue((key, lease))

    async def acquire_places(
        self, keys: list[str], limits: list[int]
    ) -> tuple[list[str], int]:
        """Take a place in each of `keys` (sorted sets of leases, at most
        `limits` each, one cluster slot) or in none, in one round trip.

        Returns the leases taken and 0, or no leases and the 1-based index of
        the first key that is full. While Redis cannot be reached: no leases
        and 0 (nothing is counted; the caller's own bounds still hold). The
        leases are renewed with the backends' and expire LEASE_SECONDS after
        a process dies holding them; ``release_places`` gives them back.
        """
        if time.monotonic() < self._down_until:
            return [], 0
        lease = new_lease()
        leases = [f"{lease}.{index}" for index in range(len(keys))]
        args: list[Any] = [LEASE_SECONDS * 1000]
        for limit, member in zip(limits, leases, strict=True):
            args += (limit, member)
        try:
            full = int(await self._run("places", keys, args))
        except (RedisError, OSError, ValueError) as error:
            self._failed(error)
            return [], 0
        if full:
            return [], full
        for key, member in zip(keys, leases, strict=True):
            self._leases[member] = key
        return leases, 0

    def release_places(self, leases: list[str]) -> None:
        """Give back places taken by ``acquire_places`` (written unanswered,
        ahead of this process's next command)."""
        for lease in leases:
            key = self._leases.pop(lease, None)
            if key is not None:
                self._writes.queue(encode(("ZREM", key, lease)))

    async def _request(self, script: Script, data: bytes) -> Any:
        redis = self._redis
        if redis is None:
            raise RedisConnectionError("The limiter is not started")
        before = b""
        writes = self._writes
        if writes.pending or writes.unsettled:
            # Settles and releases go first, in the same write: a slot freed
            # here is free for this command (on a connection being opened
            # too: after the set-up, ahead of this command).
            if not redis.is_open:
                await redis.open()
            before = writes.take()
        return await redis.run_encoded(script, data, before)

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts[name]
        return await self._request(
            script, encode(("EVALSHA", script.sha, len(keys), *keys, *args))
        )

    # Background ----------------------------------------------------------------

    async def _renew_once(self) -> None:
        try:
            await self.renew()
        except (RedisError, OSError) as error:
            self._failed(error)

    async def renew(self) -> None:
        """Extend the leases this process holds; mark the process alive; set
        its budget holds to what it knows they are."""
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
        self._assert_holds()

    def _assert_holds(self) -> None:
        """Write this process's budget holds as absolute values.

        Settles and reserve returns are written without a reply; one lost
        with a broken connection would leave its hold in Redis, and a live
        process's holds are not dropped by the reconciliation: the budget
        would look that much more used until its period ends. So the holds
        this process keeps count of are written as they are, behind every
        pending settle (in the same write), and only when no admission or
        cover is between its write and its hold being counted here (whose
        hold Redis has, or will have, taken but this count has not): then
        the count is exactly what Redis should hold. Otherwise it is done at the next renewal.
        """
        redis = self._redis
        if redis is None or not self._holds or not redis.is_open or self._unaccounted:
            return
        data = [self._writes.take()]
        process = self.process
        for budget, (tokens, nanos) in self._holds.items():
            ttl = self._holds_ttl.get(budget, 0)
            data += (
                NO_REPLY,
                encode(("EVAL", HOLDS, 1, budget, process, tokens, nanos, ttl)),
            )
        if not redis.send_unanswered(b"".join(data)):
            self._failed(RedisConnectionError("Redis connection lost"))
            return
        self._writes.unconfirmed = True
        used = {commands.keys[3] for _, commands in self._commands.values()} | {
            commands.team.keys[3]
            for _, commands in self._commands.values()
            if commands.team is not None
        }
        for budget, held in list(self._holds.items()):
            if held == [0, 0] and budget not in used:
                del self._holds[budget]
                self._holds_ttl.pop(budget, None)

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


def _period(layer: LimitLayer, now: float) -> tuple[str, float]:
    """The budget period of a key's or team's budgets now, and when it ends."""
    if not layer.has_budget:
        return "", math.inf
    return (
        period_id(layer.budget_period, now),
        period_end(layer.budget_period, now) or math.inf,
    )


def _rate(limit: int | None, remaining: int, reset_ms: int) -> RateState | None:
    if limit is None or remaining < 0:
        return None
    return RateState(limit, remaining, reset_ms / 1000)
