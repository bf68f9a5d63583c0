"""A busy key's reserve: limits taken ahead for its next requests in this process."""

from __future__ import annotations

# A busy key's admission also takes a reserve for the requests that follow it
# in this process (see Reserve): at most RESERVE_REQUESTS requests' worth, and at
# most RESERVE_SHARE of what each of the key's limits has left; what is left
# of it RESERVE_SECONDS after it was taken goes back.
RESERVE_REQUESTS = 64
RESERVE_SHARE = 0.01
RESERVE_SECONDS = 0.5


class Reserve:
    """Limits taken ahead for a busy key's next requests in this process.

    An admission that goes to Redis for a key this process admitted less than
    RESERVE_SECONDS ago also takes, in the same script, up to RESERVE_REQUESTS
    more requests' worth of each of the key's limits (RPM, TPM, budget holds
    and concurrency slots), and never more than RESERVE_SHARE of what any of
    them has left. The requests that follow are admitted here, with no round
    trip, while the reserve covers them; the first it cannot cover goes to
    Redis, which takes the leftovers back in the same write and may grant a
    new reserve. What is left of a reserve RESERVE_SECONDS after it was taken
    goes back, as does one whose key's policy or budget period changed, and
    every reserve at stop (see ``RedisLimiter._grant`` and ``_retire``).

    Nothing is over-admitted: a reserve is taken from the shared counters
    before it is used, and a budget's reserve is held in this process's hold
    fields, which every process counts. What a reserve costs is the other way:
    while a process holds one, the others see that much less left, at most
    RESERVE_SHARE of it per process, for at most RESERVE_SECONDS. Near a
    limit (less than RESERVE_SHARE of a request left to reserve) no reserve
    is granted and every admission is one round trip, exact as before. A
    process killed holding one loses its rate tokens (the buckets refill), its
    budget share is dropped by the beat reconciliation with its other holds,
    and its slots' leases expire.
    """

    __slots__ = (
        "budget_nanos",
        "budget_tokens",
        "expires",
        "requests",
        "requests_reset",
        "slot_cap",
        "slots",
        "tokens",
        "tokens_reset",
    )

    def __init__(
        self,
        requests: int,
        tokens: int,
        budget_tokens: int,
        budget_nanos: int,
        slots: list[str],
        expires: float,
        requests_reset: float,
        tokens_reset: float,
    ) -> None:
        self.requests = requests
        self.tokens = tokens  # TPM tokens
        self.budget_tokens = budget_tokens
        self.budget_nanos = budget_nanos
        self.slots = slots  # idle concurrency leases
        self.slot_cap = len(slots)
        self.expires = expires  # monotonic: what is left then goes back
        # Monotonic instants the key's buckets are full again, as this process
        # sees them (its own use counted, its leftovers not).
        self.requests_reset = requests_reset
        self.tokens_reset = tokens_reset
