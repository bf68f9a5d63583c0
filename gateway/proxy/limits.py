"""Keys' expiry, allow-lists, limits and budgets on the request path.

Everything here reads the snapshot's frozen ``KeyPolicy`` and ``Price``
values; the only I/O is the limiter's (one Redis round trip per admission in
production, none in the embedded default). Refusals are ``ProxyError``s that
each inbound surface renders in its own shape: 401 ``key_expired``, 403
``model_not_allowed`` (the same for a model that does not exist, so a key
learns nothing beyond its allow-list), 429 with ``Retry-After`` for rates,
concurrency and budgets, 503 when the limiter is down and set to fail closed.
The proxy calls these in one place (``Pipeline._check_key``),
before admission control, for every surface.

``StreamCap`` is the one limit kept in each serving process alone: the
streams a key has open there (each may pin up to the unsent-bytes bound of
that process's memory while its client reads slowly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gateway.proxy.errors import ProxyError
from routing.core import RouterSnapshot
from usage.limits.limiter import (
    BUDGET,
    CONCURRENCY,
    COVER_BLOCK_TOKENS,
    REQUESTS,
    TOKENS,
    UNAVAILABLE,
    Decision,
    Limiter,
    TeamTicket,
    Ticket,
)
from usage.limits.policy import FREE, KeyPolicy, LimitLayer, Price

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

Headers = list[tuple[bytes, bytes]]

# The metrics' label of a stream refused by StreamCap.
STREAMS = "streams"


class StreamCap:
    """Counts the streams each key has open in this process, up to ``cap``.

    Per process on purpose: what it bounds is this process's memory, and
    counting gateway-wide would cost a Redis round trip for every stream of
    keys that have no limits (a key's ``max_concurrency`` is the gateway-wide
    limit, through the limiter). ``cap`` 0: no cap.
    """

    __slots__ = ("cap", "open")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: dict[str, int] = {}

    def take(self, prefix: str, metrics: GatewayMetrics) -> None:
        """Count one more stream of the key, or refuse it with a 429."""
        count = self.open.get(prefix, 0)
        if self.cap and count >= self.cap:
            metrics.count_limited(STREAMS)
            raise ProxyError(
                429,
                f"This key already has {count} streams open on this server, the "
                f"limit per key (NEXUS_KEY_MAX_STREAMS={self.cap}). Read or close "
                "one before opening another.",
                error_type="requests",
                code="stream_limit_exceeded",
            )
        self.open[prefix] = count + 1

    def give_back(self, prefix: str) -> None:
        count = self.open.pop(prefix, 0) - 1
        if count > 0:
            self.open[prefix] = count


def check_expiry(policy: KeyPolicy, now: float, metrics: GatewayMetrics) -> None:
    """Refuse an expired key with a 401."""
    if policy.is_expired(now):
        metrics.count_limited("expired")
        assert policy.expires_at is not None
        when = datetime.fromtimestamp(policy.expires_at, UTC)
        raise ProxyError(
            401,
            f"This API key expired on {when:%Y-%m-%d %H:%M} UTC. Ask your Nexus "
            "operator for a new one.",
            code="key_expired",
        )


def is_model_allowed(policy: KeyPolicy, routes: RouterSnapshot, model: str) -> bool:
    """Whether the key may ask for `model`: by the name asked for, or by the
    model its alias (exact or pattern) sends it to."""
    if not policy.allowed_models:
        return True
    target = routes.alias_for(model)
    return policy.allows(model) if target is None else policy.allows(model, target)


def check_model(
    policy: KeyPolicy, routes: RouterSnapshot, model: str, metrics: GatewayMetrics
) -> None:
    """Refuse a model outside the key's allow-list with a 403."""
    if not is_model_allowed(policy, routes, model):
        metrics.count_limited("model_not_allowed")
        raise ProxyError(
            403,
            f"This API key is not allowed to use the model '{model[:200]}'.",
            error_type="invalid_request_error",
            param="model",
            code="model_not_allowed",
        )


def price_estimate(
    prices: Mapping[str, Price], routes: RouterSnapshot, model: str
) -> Price:
    """The price a request for `model` is held at before a backend is chosen:
    the model's (or its alias target's); free when neither has one."""
    price = prices.get(model)
    if price is None:
        target = routes.alias_for(model)
        price = prices.get(target) if target is not None else None
    return FREE if price is None else price


def completion_estimate(
    payload: Mapping[str, Any], is_embeddings: bool, default: int
) -> int:
    """Completion tokens to hold for a request: its max_tokens (times n), or
    `default`; none for embeddings. `payload` is the canonical (OpenAI) body."""
    if is_embeddings:
        return 0
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    tokens = limit if isinstance(limit, int) and limit >= 0 else default
    choices = payload.get("n")
    if isinstance(choices, int) and 1 < choices <= 128:
        tokens *= choices
    return tokens


async def admit(
    limiter: Limiter,
    policy: KeyPolicy,
    tokens: int,
    nanos: int,
    headers: Headers,
    metrics: GatewayMetrics,
) -> Ticket:
    """Take the request's share of the key's limits, or raise the refusal.

    The rate-limit headers of the answer go onto `headers` either way.
    """
    decision = await limiter.admit(policy, tokens, nanos)
    headers += decision.headers
    if decision.ticket is not None:
        return decision.ticket
    metrics.count_limited(decision.reason)
    raise refusal(decision, policy, headers)


def refusal(decision: Decision, policy: KeyPolicy, headers: Headers) -> ProxyError:
    if decision.scope == "team" and policy.team is not None:
        return _refusal(decision, policy.team, "this key's team", headers)
    return _refusal(decision, policy, "this key", headers)


def _refusal(
    decision: Decision, layer: LimitLayer, whose: str, headers: Headers
) -> ProxyError:
    wait = decision.retry_after
    if wait > 0:
        headers += (
            (b"retry-after", str(max(math.ceil(wait), 1)).encode()),
            (b"retry-after-ms", str(max(math.ceil(wait * 1000), 1)).encode()),
        )
    reason = decision.reason
    if reason == REQUESTS:
        return ProxyError(
            429,
            f"Rate limit reached for requests per minute on {whose} (limit "
            f"{layer.rpm}). Please try again in {wait:.3g}s.",
            error_type="requests",
            code="rate_limit_exceeded",
        )
    if reason == TOKENS:
        return ProxyError(
            429,
            f"Rate limit reached for tokens per minute on {whose} (limit "
            f"{layer.tpm}). Please try again in {wait:.3g}s.",
            error_type="tokens",
            code="rate_limit_exceeded",
        )
    if reason == CONCURRENCY:
        return ProxyError(
            429,
            f"{whose.capitalize()} already has {layer.max_concurrency} requests "
            "in flight, its limit. Retry when one has finished.",
            error_type="requests",
            code="concurrency_limit_exceeded",
        )
    if reason == BUDGET:
        return ProxyError(
            429,
            f"The budget of {whose} ({_describe_budget(layer)}) is used up.",
            error_type="insufficient_quota",
            code="budget_exceeded",
        )
    assert reason == UNAVAILABLE, reason
    return ProxyError(
        503,
        "The gateway cannot check this key's limits right now; retry shortly.",
        error_type="server_error",
        code="limits_unavailable",
    )


def _describe_budget(policy: LimitLayer) -> str:
    parts = []
    if policy.budget_tokens is not None:
        parts.append(f"{policy.budget_tokens:,} tokens")
    if policy.budget_nanos is not None:
        parts.append(f"${policy.budget_nanos / 1e9:,.4f}")
    period = {"day": "per UTC day", "month": "per UTC month"}.get(
        policy.budget_period, "in all"
    )
    return f"{' and '.join(parts)} {period}"


class BudgetMeter:
    """Counts a budgeted stream's tokens as its events are relayed.

    Completion tokens are counted as at least one per event that carries text
    (model servers stream about a token an event) and at least a quarter of
    the characters relayed, rounded up, whichever is more; with the prompt
    estimate, at the price of the model that answers (``use_model``). A stream
    cut for its budget is billed as the meter counted it. While that stays
    within the ticket's hold nothing is asked; past it the limiter is asked
    to grow the hold, and when the budget cannot cover what was already
    relayed the stream is cut after that event. Events come as
    ``(bytes, characters of text)`` pieces, one per event of the client's
    protocol (``sse.counted_events``, ``LegStream.feed_counted``).
    """

    __slots__ = (
        "chars",
        "events",
        "limiter",
        "price",
        "prices",
        "prompt",
        "spent",
        "ticket",
    )

    def __init__(
        self,
        limiter: Limiter,
        ticket: Ticket,
        prices: Mapping[str, Price],
        model: str,
        prompt: int,
        spent: tuple[int, int] = (0, 0),
    ) -> None:
        self.limiter = limiter
        self.ticket = ticket
        self.prices = prices
        self.price = prices.get(model, FREE)
        self.prompt = prompt
        # Tokens and nano-USD the ticket already paid for before this stream
        # (an ensemble's earlier steps): the stream is counted on top of them.
        self.spent = spent
        self.chars = 0
        self.events = 0  # events that carried text

    def use_model(self, model: str) -> None:
        """Count at the price of the model that answers (a fallback's, maybe)."""
        self.price = self.prices.get(model, FREE)

    async def take(self, pieces: list[tuple[bytes, int]]) -> tuple[bytes, bool]:
        """Count relayed events; return what of them to send and whether the
        stream may go on (False: cut after the returned events)."""
        added = events = 0
        for _, chars in pieces:
            if chars:
                added += chars
                events += 1
        if not self._is_over(self.chars + added, self.events + events):
            self.chars += added
            self.events += events
            return b"".join([piece for piece, _ in pieces]), True
        # Find the event that crossed.
        out: list[bytes] = []
        for piece, chars in pieces:
            out.append(piece)
            if not chars:
                continue
            self.chars += chars
            self.events += 1
            if self._is_over(self.chars, self.events) and not await self._cover():
                return b"".join(out), False
        return b"".join(out), True

    @property
    def completion(self) -> int:
        """Completion tokens counted so far (what a cut stream is billed)."""
        return max(-(-self.chars // 4), self.events)

    def _usage(self, chars: int, events: int) -> tuple[int, int]:
        completion = max(-(-chars // 4), events)
        tokens, nanos = self.spent
        return (
            tokens + self.prompt + completion,
            nanos + self.price.cost(self.prompt, completion),
        )

    def _is_over(self, chars: int, events: int) -> bool:
        tokens, nanos = self._usage(chars, events)
        ticket = self.ticket
        policy = ticket.policy
        if _is_past(policy, ticket, tokens, nanos):
            return True
        team = ticket.team
        return (
            team is not None
            and policy.team is not None
            and _is_past(policy.team, team, tokens, nanos)
        )

    async def _cover(self) -> bool:
        tokens, nanos = self._usage(self.chars, self.events)
        want = (
            tokens + COVER_BLOCK_TOKENS,
            nanos + self.price.output_nanos * COVER_BLOCK_TOKENS,
        )
        return await self.limiter.cover(self.ticket, (tokens, nanos), want)

    def cut_error(self) -> ProxyError:
        """The error a cut stream ends with (each surface writes its event)."""
        policy = self.ticket.policy
        tokens, nanos = self._usage(self.chars, self.events)
        team = self.ticket.team
        whose = "This key's budget"
        layer: LimitLayer = policy
        if (
            policy.team is not None
            and team is not None
            and _is_past(policy.team, team, tokens, nanos)
        ):
            whose, layer = "This key's team's budget", policy.team
        return ProxyError(
            429,
            f"{whose} ({_describe_budget(layer)}) ran out "
            "during the answer; the response is incomplete.",
            error_type="insufficient_quota",
            code="budget_exceeded",
        )


def _is_past(
    layer: LimitLayer, hold: Ticket | TeamTicket, tokens: int, nanos: int
) -> bool:
    """Whether usage is past what a ticket holds of a key's or team's budget."""
    return (layer.budget_tokens is not None and tokens > hold.held_tokens) or (
        layer.budget_nanos is not None and nanos > hold.held_nanos
    )
