"""The way of one routed request: key limits, admission, route, slot, forward.

Every surface comes through here once its body is read and made canonical
(gateway/proxy/dispatch.py): the key's allow-list, rate limits, concurrency
and budget are checked first (a refusal costs no place in a queue), then
admission control, then the router (holding the request while its model has
no backend, gateway/fleet), the fleet's slot, and ``forward``. A client that
hangs up cancels it wherever it is. Whatever happens, the accounting records
the request once.

A request for a ``moe-`` model (multiple opinions) takes the same way up to
admission, its key's limits taken for every step; then the ensemble runs
its steps (gateway/proxy/ensemble/) and records each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from gateway.admission import BadAdmissionHeader
from gateway.fleet.errors import FleetRefusal
from gateway.proxy import limits, traces
from gateway.proxy.accounting import Accounting
from gateway.proxy.bodies import Receive
from gateway.proxy.cached import CachedAnswers
from gateway.proxy.context_fit import fit_known_context
from gateway.proxy.ensemble import EnsemblePlan, Ensembles
from gateway.proxy.errors import ProxyError, bad_request, routing_error
from gateway.proxy.forward import Upstream, forward
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.relays import Send
from gateway.proxy.shadows import Shadows
from routing.admission import AdmissionError
from routing.admission.vocabulary import Outcome
from routing.core import RequestRequirements, Route, RouterSnapshot, RoutingError
from routing.core.decision import Via
from routing.core.prefix import PrefixRequest
from routing.state import GatewayState
from usage.limits.policy import KeyPolicy

if TYPE_CHECKING:
    from gateway.process import Gateway

# Status recorded when the client went away before the answer was complete.
CLIENT_CLOSED = 499
# Names the signal behind a prefix-aware choice and the matched length.
ROUTE_REASON = b"x-nexus-route-reason"
# Usage of a request no backend saw (refused or left while queued): nothing.
_NOTHING_BILLED = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class Pipeline:
    """Serves routed requests with one gateway (see the module docstring)."""

    def __init__(
        self, gateway: Gateway, upstream: Upstream, accounting: Accounting
    ) -> None:
        self.gateway = gateway
        self.upstream = upstream
        self.accounting = accounting
        self.default_completion = gateway.config.default_completion_tokens
        self.streams = limits.StreamCap(gateway.config.max_streams_per_key)
        self.ensembles = Ensembles(gateway, upstream, accounting)
        self.cached = CachedAnswers(gateway)
        self.shadows = Shadows(gateway, upstream, accounting)

    async def serve(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
        receive: Receive,
        send: Send,
    ) -> None:
        """Serve the request and record it (an error too: it is raised on)."""
        plan = self.ensembles.plan(exchange, state, requirements)
        if plan is None:
            self.accounting.open(exchange)
        # A key's streams in this process are capped (limits.StreamCap); no
        # key, no cap.
        counted = exchange.key_prefix if exchange.stream else ""
        try:
            if counted:
                self.streams.take(counted, self.gateway.metrics)
            try:
                await self._forward_watching_client(
                    exchange, state, requirements, receive, send, plan
                )
            finally:
                if counted:
                    self.streams.give_back(counted)
        except ProxyError as error:
            exchange.status = error.status
            exchange.error = error.code or error.error_type
            error.recorded = True
            raise
        finally:
            if plan is None:
                self.accounting.record(exchange)
            else:
                self.ensembles.finish(plan, exchange)
            exchange.cache = None  # kept by then, or not to be

    async def _forward_watching_client(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
        receive: Receive,
        send: Send,
        plan: EnsemblePlan | None = None,
    ) -> None:
        """Check the key, wait for admission, route and forward; a client that
        hangs up cancels.

        The key's ticket is settled by the accounting; the admission ticket is
        released in every outcome (answer, error, retries, a stream cut short,
        the client gone while waiting or while served), which is what brings
        the stock back to 0.
        """
        gateway = self.gateway
        if exchange.policy is not None:
            await self._check_key(exchange, state, requirements, exchange.policy, plan)
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(
            _cancel_on_disconnect(receive, task, exchange)
        )
        ticket = None
        try:
            try:
                ticket = gateway.admission.prepare(
                    state,
                    requirements if plan is None else plan.requirements,
                    exchange.payload,
                    exchange.key_prefix,
                    exchange.request_headers,
                    batch=bool(exchange.batch_id),
                )
                if ticket is not None:
                    if exchange.trace is None:
                        await gateway.admission.admit(ticket)
                    else:
                        await traces.admit(gateway.admission, ticket, exchange.trace)
                    if ticket.outcome is Outcome.DISPATCHED:
                        # It waited: route with what is ready now (a backend
                        # that turned ready meanwhile is why it goes).
                        latest = gateway.snapshots.peek()
                        if latest is not None and latest is not state:
                            state = exchange.state = latest
            except BadAdmissionHeader as error:
                raise bad_request(str(error), param=error.header) from None
            except AdmissionError as error:
                raise _admission_error(error, exchange) from None
            if plan is not None:
                await self.ensembles.run(plan, exchange, state, send)
                return
            prefix = self._prefix_request(exchange, state)
            try:
                route, routes = await self._routing(
                    exchange, state, requirements, prefix
                )
            except ProxyError as error:
                # Longer than every candidate's known context: trimmed to fit.
                fitted = fit_known_context(exchange, error.__cause__)
                if fitted is None:
                    raise
                route, routes = await self._routing(exchange, state, fitted, prefix)
            exchange.route = route
            if prefix is not None:
                self._note_prefix(exchange, route, routes, prefix)
            fleet = gateway.fleet
            fleet.after_decision(route, routes)
            try:
                placed = await fleet.take_slot(route, routes)
            except FleetRefusal as error:
                raise _fleet_error(error, exchange) from None
            shadow = self.shadows.pick(exchange, state, route.target.model.name)
            await forward(self.upstream, exchange, placed, send)
            if shadow is not None:
                self.shadows.launch(shadow, exchange)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            task.uncancel()
            exchange.status = CLIENT_CLOSED
            exchange.error = "client_closed"
            if ticket is not None and ticket.outcome is None:
                exchange.usage = _NOTHING_BILLED  # left while queued
        finally:
            watcher.cancel()
            gateway.admission.release(ticket)

    def _prefix_request(
        self, exchange: ProxyExchange, state: GatewayState
    ) -> PrefixRequest | None:
        """The request's prompt keys and session, when prefix routing is on."""
        policy = state.routes.policy.prefix
        if not policy.enabled:
            return None
        call = exchange.call
        canonical = exchange.payload if call is None else call.inbound.canonical
        return self.gateway.prefix.request_for(
            canonical, exchange.payload, exchange.request_headers, policy
        )

    def _note_prefix(
        self,
        exchange: ProxyExchange,
        route: Route,
        routes: RouterSnapshot,
        prefix: PrefixRequest,
    ) -> None:
        """Record where the prompt goes, count it, and say why on the answer."""
        choice = route.decision.prefix
        target = route.target
        self.gateway.prefix.record(
            target.model.name, target.backend, prefix, routes.policy.prefix
        )
        if choice is None:
            return
        self.gateway.metrics.count_prefix_choice(
            choice.signal, choice.matched_blocks, choice.overridden is not None
        )
        exchange.response_headers.append((ROUTE_REASON, choice.reason().encode()))

    def _routing(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
        prefix: PrefixRequest | None,
    ) -> Awaitable[tuple[Route, RouterSnapshot]]:
        """Route the request (``_route``), in a span of its own when traced."""
        routing = self._route(state, requirements, prefix, exchange.key_prefix)
        trace = exchange.trace
        return routing if trace is None else traces.route(trace, routing)

    async def _route(
        self,
        state: GatewayState,
        requirements: RequestRequirements,
        prefix: PrefixRequest | None = None,
        split_key: str = "",
    ) -> tuple[Route, RouterSnapshot]:
        """Route the request, holding it first when its model has no backend.

        With the policy's hold_seconds > 0, a request whose model exists but
        has no backend able to take it now waits for one (gateway/fleet); when
        the time is up it goes down the fallback chain through the full
        pipeline, and is refused if that finds nothing either. Relay workers
        are backends like any other here: requests for busy ones wait in
        admission's queue (before this) or the fleet's lines (after it).
        """
        gateway = self.gateway
        router, stats, fleet = gateway.router, gateway.stats, gateway.fleet
        routes = state.routes
        try:
            route = router.select(requirements, routes, stats, prefix, split_key)
        except RoutingError as error:
            if not fleet.should_hold(error.decision, routes):
                raise routing_error(error) from error
        else:
            if not fleet.should_hold(route.decision, routes):
                return route, routes

        def route_primary(now: RouterSnapshot) -> tuple[Route, RouterSnapshot] | None:
            try:
                found = router.select(requirements, now, stats, prefix, split_key)
            except RoutingError:
                return None
            return None if found.decision.via == Via.FALLBACK else (found, now)

        held = await fleet.hold(route_primary)
        if held is not None:
            return held
        latest = gateway.snapshots.peek()
        routes = routes if latest is None else latest.routes
        try:
            return (
                router.select(requirements, routes, stats, prefix, split_key),
                routes,
            )
        except RoutingError as error:
            raise routing_error(error) from error

    async def _check_key(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
        policy: KeyPolicy,
        plan: EnsemblePlan | None = None,
    ) -> None:
        """Refuse what the key may not do, or take its share of its limits.

        The rate-limit headers go onto the answer's headers (or the
        refusal's); a budgeted stream gets a meter that may cut it short.
        An ensemble needs the key to allow its base model too, and takes
        the limits once for all its steps (its streamed last step gets its
        meter from the ensemble, gateway/proxy/ensemble/runner.py).
        """
        gateway = self.gateway
        metrics = gateway.metrics
        model = requirements.model
        limits.check_model(policy, state.routes, model, metrics)
        steps = 1
        if plan is not None:
            limits.check_model(policy, state.routes, plan.base, metrics)
            model, steps = plan.base, plan.steps
        if not policy.is_limited:
            return
        prompt = requirements.estimated_tokens
        call = exchange.call
        if call is None:
            canonical, endpoint = exchange.payload, exchange.endpoint
        else:
            canonical = call.inbound.canonical
            endpoint = call.inbound.canonical_endpoint
        completion = limits.completion_estimate(
            canonical, endpoint == "embeddings", self.default_completion
        )
        price = limits.price_estimate(state.prices, state.routes, model)
        ticket = await limits.admit(
            gateway.limiter,
            policy,
            (prompt + completion) * steps,
            price.cost(prompt, completion) * steps,
            exchange.response_headers,
            metrics,
        )
        exchange.limit_ticket = ticket
        if exchange.stream and policy.has_any_budget and plan is None:
            exchange.meter = limits.BudgetMeter(
                gateway.limiter, ticket, state.prices, model, prompt
            )


def _fleet_error(error: FleetRefusal, exchange: ProxyExchange) -> ProxyError:
    """The client's answer to a request the fleet queues did not run."""
    exchange.usage = _NOTHING_BILLED
    exchange.response_headers.append((b"retry-after", str(error.retry_after).encode()))
    return ProxyError(503, error.message, error_type="server_error", code=error.code)


def _admission_error(error: AdmissionError, exchange: ProxyExchange) -> ProxyError:
    """The client's answer to a request admission control did not let through."""
    exchange.usage = _NOTHING_BILLED
    if error.retry_after is not None:
        exchange.response_headers.append(
            (b"retry-after", str(error.retry_after).encode())
        )
    return ProxyError(
        error.status, error.message, error_type=error.error_type, code=error.code
    )


async def _cancel_on_disconnect(
    receive: Receive, task: asyncio.Task[Any], exchange: ProxyExchange
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.client_gone = True
            task.cancel()
            return
