"""What a finished request leaves behind: its usage, its metrics, its log line.

Every request the proxy answers for an endpoint ends here once, served or
refused: the key's limit ticket is settled with what it cost, a usage event
goes to the in-process buffer (memory only, no I/O) and the live counters,
the request metrics are observed and the access log gets its line.

A request the pipeline takes is opened first (``open()``): a ``UsageOpen``
with the same event id goes to the buffer and the request is tracked by the
gateway's ``OpenRequests`` until its usage event settles it, so a process
killed mid-request leaves a record of what it had started (usage/lost.py).
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from typing import Any

from gateway.exchange import Exchange
from gateway.metrics import UNKNOWN, GatewayMetrics
from gateway.protocols.prompt_cache import cache_counts
from gateway.proxy.errors import ProxyError
from gateway.proxy.legs import ProxyExchange
from routing.core import Decision, LiveStats
from routing.core.fleet import observe_decoding
from routing.state import GatewayState
from usage.buffer import UsageBuffer, UsageEvent, UsageOpen, new_event_id, process_id
from usage.limits.limiter import Limiter
from usage.limits.policy import FREE
from usage.live import LiveUsage
from usage.progress import OpenRequests, Progress

access_logger = logging.getLogger("nexus.access")

# A count a backend reports is believed up to this (far above any real request).
MAX_REPORTED_TOKENS = 10**12


class Accounting:
    """Records finished requests for one gateway (see the module docstring)."""

    def __init__(
        self,
        limiter: Limiter,
        metrics: GatewayMetrics,
        buffer: UsageBuffer,
        live_usage: LiveUsage,
        access_log: bool,
        open_requests: OpenRequests | None = None,
        stats: LiveStats | None = None,
    ) -> None:
        self.limiter = limiter
        # Where decoding speeds teach the fleet strategy each node's bandwidth.
        self.stats = stats
        self.metrics = metrics
        self.buffer = buffer
        self.live_usage = live_usage
        self.access_log = access_log
        self.open_requests = open_requests or OpenRequests(buffer, 1.0)
        self.open_requests.progress_of = _progress_of

    def open(self, exchange: ProxyExchange) -> None:
        """Note the request as begun: its open goes to the buffer (memory only)."""
        event_id = exchange.event_id = new_event_id()
        opened = UsageOpen(
            event_id,
            process_id(),
            exchange.request_id,
            exchange.endpoint,
            exchange.key_prefix,
            exchange.requested_model,
            exchange.stream,
            time.time(),
            ensemble_id=exchange.ensemble_id,
            batch_id=exchange.batch_id,
        )
        self.open_requests.open(opened, exchange)

    def record(self, exchange: ProxyExchange) -> tuple[int, int]:
        """Hand the request's usage to the gateway (memory only, no I/O).

        Returns the tokens and the cost (nano-USD) it was recorded with.
        """
        prompt, completion, total, reported = token_counts(exchange)
        read, written = (
            cache_counts(exchange.usage, prompt)
            if reported and not exchange.cache_hit
            else (0, 0)
        )
        cost = _cost(exchange, prompt, completion, read, written)
        event_id = exchange.event_id
        if event_id:
            self.open_requests.settle(event_id)
        else:
            event_id = new_event_id()
        if exchange.limit_ticket is not None:
            self.limiter.settle(exchange.limit_ticket, total, cost)
            exchange.limit_ticket = None
        if cost:
            self.metrics.observe_spend(exchange.key_prefix, cost)
        if exchange.error == "budget_exceeded":
            self.metrics.budget_cutoffs.inc()
        if exchange.batch_id:
            self.metrics.batch_line_done(exchange.status < 400)
        now = time.perf_counter()
        event = UsageEvent(
            request_id=exchange.request_id,
            endpoint=exchange.endpoint,  # type: ignore[arg-type]
            api_key_prefix=exchange.key_prefix,
            backend=exchange.backend,
            requested_model=exchange.requested_model,
            served_model=exchange.served_model,
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total,
            estimated=not reported,
            latency_ms=(now - exchange.started) * 1000,
            status=exchange.status,
            streamed=exchange.stream,
            error=exchange.error,
            cost_nanos=cost,
            event_id=event_id,
            context_shifts=exchange.context_shifts,
            ensemble_id=exchange.ensemble_id,
            cache_read_tokens=read,
            cache_write_tokens=written,
            cache_hit=exchange.cache_hit,
            **_route_fields(exchange),
            batch_id=exchange.batch_id,
        )
        self.buffer.append(event)
        model = _model_label(exchange)
        # A refusal that named no model stays "" in the live series.
        named = exchange.served_model or exchange.requested_model
        self.live_usage.record(event, model=model if named else "")
        self._observe(exchange, model, now, prompt, completion)
        if reported:
            self._observe_decoding(exchange, completion, now)
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            _log_access(exchange, event.latency_ms, prompt, completion)
        return total, cost

    def refuse(self, exchange: ProxyExchange, error: ProxyError) -> None:
        """Record a request refused before any backend saw it.

        It counts as a request and an error all the same, of no model and no
        tokens, whatever its body asked for.
        """
        refused: ProxyExchange = Exchange(
            request_id=exchange.request_id,
            endpoint=exchange.endpoint,
            path=exchange.path,
            key_prefix=exchange.key_prefix,
            state=exchange.state,
            started=time.perf_counter(),
            status=error.status,
            error=error.code or error.error_type,
        )
        self.record(refused)

    def _observe(
        self,
        exchange: ProxyExchange,
        model: str,
        now: float,
        prompt: int,
        completion: int,
    ) -> None:
        first_byte = exchange.first_byte
        metrics = self.metrics
        metrics.observe_request(
            exchange.endpoint,
            model,
            exchange.backend,
            exchange.status,
            now - exchange.started,
            None if first_byte is None else first_byte - exchange.started,
        )
        metrics.observe_tokens(model, exchange.backend, prompt, completion)

    def _observe_decoding(
        self, exchange: ProxyExchange, completion: int, now: float
    ) -> None:
        """A streamed answer's speed (reported tokens from its first byte to
        its end) teaches its node's memory bandwidth (routing.core.fleet)."""
        first_byte, state, stats = exchange.first_byte, exchange.state, self.stats
        if not exchange.stream or first_byte is None or state is None or stats is None:
            return
        backend = state.routes.backend(exchange.backend)
        model = (
            None
            if backend is None
            else backend.models_by_name.get(exchange.served_model)
        )
        if backend is not None and model is not None:
            observe_decoding(stats, backend, model, completion, now - first_byte)


def _progress_of(exchange: ProxyExchange) -> Progress | None:
    """What an open request would be billed if it ended now (None: nothing yet)."""
    if not exchange.backend:
        return None  # still waiting (queued, held, routed): no tokens spent
    prompt, completion, total, reported = token_counts(exchange)
    if not reported:
        # Mid-stream: what was relayed so far, or the budget meter's count.
        live, meter = exchange.live_chars, exchange.meter
        seen = 0 if live is None else -(-live() // 4)
        if meter is not None:
            seen = max(seen, meter.completion)
        if seen > completion:
            total += seen - completion
            completion = seen
    read, written = cache_counts(exchange.usage, prompt) if reported else (0, 0)
    cost = _cost(exchange, prompt, completion, read, written)
    served = exchange.served_model
    return (exchange.backend, served, prompt, completion, total, cost, exchange.status)


def _cost(
    exchange: ProxyExchange,
    prompt: int,
    completion: int,
    cache_read: int = 0,
    cache_write: int = 0,
) -> int:
    state = exchange.state
    if state is None:
        return 0
    if exchange.cache_hit:
        price = state.prices.get(exchange.served_model, FREE)
        return price.cache_hit_cost(prompt + completion)
    if not exchange.backend:
        return 0
    price = state.prices.get(exchange.served_model, FREE)
    cost = price.cost(prompt, completion, cache_read, cache_write)
    return price.batch_cost(cost) if exchange.batch_id else cost


def token_counts(exchange: ProxyExchange) -> tuple[int, int, int, bool]:
    """Return prompt, completion and total tokens, and whether they were reported.

    A backend's usage block when it has one, else the estimate: the prompt's
    from the request, a quarter of the characters of text answered.
    """
    usage = exchange.usage or {}
    prompt = _token_count(usage.get("prompt_tokens"))
    completion = _token_count(usage.get("completion_tokens", 0))
    reported = prompt is not None and completion is not None
    if not exchange.backend and not exchange.cache_hit:
        # Refused before any backend: no tokens were spent.
        prompt = completion = 0
        reported = True
    elif prompt is None or completion is None:
        requirements = exchange.requirements
        prompt = 0 if requirements is None else requirements.estimated_tokens
        completion = exchange.counted_completion
        if completion is None:
            completion = -(-exchange.completion_chars // 4)  # ceil(chars / 4)
    total = _token_count(usage.get("total_tokens")) if reported else None
    if not isinstance(total, int):
        total = prompt + completion
    return prompt, completion, total, reported


def _token_count(value: Any) -> int | None:
    """A token count a backend reported, if it is one (clamped into range)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return min(max(value, 0), MAX_REPORTED_TOKENS)


def _model_label(exchange: ProxyExchange) -> str:
    """The model a metric label and a live series name for the request.

    The model served, or the one asked for if the configuration knows it,
    else "unknown": what a client makes up (any number of names, lone
    surrogates that msgpack cannot encode) never becomes a label or a series.
    """
    if exchange.served_model:
        return exchange.served_model
    state = exchange.state
    if state is None:
        return UNKNOWN
    return _known_model(state, exchange.requested_model)


def _route_fields(exchange: ProxyExchange) -> dict[str, Any]:
    """The split side, hedging and the decision, for the usage event.

    The decision is written to JSON later, by whoever hands the event on
    (usage/buffer.py): only references are taken here.
    """
    route = exchange.route
    decision = route.decision if route is not None else None
    if decision is None:
        return {"decision": _CACHE_HIT} if exchange.cache_hit else {}
    split = decision.split
    facts = {
        "served_by": exchange.backend,
        "retries": exchange.retries,
        "hedged": exchange.hedged,
        "hedge_backends": list(exchange.hedge_backends),
        "cache_hit": exchange.cache_hit,
    }
    return {
        "split": split.split if split is not None else "",
        "split_side": split.side if split is not None else "",
        "hedged": exchange.hedged,
        "decision": partial(_decision_json, decision, facts),
    }


_CACHE_HIT = '{"cache_hit":true}'


def _decision_json(decision: Decision, facts: dict[str, Any]) -> str:
    return json.dumps(decision.summary() | facts, separators=(",", ":"), default=str)


def _known_model(state: GatewayState, model: str) -> str:
    """The model's name if the configuration knows it (the pattern alias
    covering it, for a name only a pattern knows), else "unknown"."""
    routes = state.routes
    if model in routes.routes or model in routes.aliases or model in routes.splits:
        return model
    # A name a pattern alias covers is counted under the pattern: clients
    # choose those names, the operator chooses the patterns.
    return routes.alias_pattern_for(model) or UNKNOWN


def _log_access(
    exchange: ProxyExchange, latency_ms: float, prompt: int, completion: int
) -> None:
    access_logger.info(
        "request_id=%s endpoint=%s model=%s backend=%s status=%d "
        "latency_ms=%.1f tokens_in=%d tokens_out=%d retries=%d%s%s%s",
        exchange.request_id,
        exchange.endpoint,
        # Client-chosen: escaped so that it cannot forge log lines.
        exchange.requested_model[:128].encode("unicode_escape").decode(),
        exchange.backend or "-",
        exchange.status,
        latency_ms,
        prompt,
        completion,
        exchange.retries,
        " stream=1" if exchange.stream else "",
        f" error={exchange.error}" if exchange.error else "",
        f" ensemble={exchange.ensemble_id}" if exchange.ensemble_id else "",
    )
