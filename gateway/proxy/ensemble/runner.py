"""Running a multiple-opinions request: answers, critiques, the refined answer.

``Ensembles.plan`` recognises a request for ``moe-<model>`` (or an alias of
one); the pipeline then checks the key for the whole ensemble, admits it
once, and hands it to ``run``:

1. the router picks up to ``opinions`` backends serving the model (its
   choice first, then its retry order); each answers the client's chat, at
   once, within the step timeout;
2. each backend that answered critiques the others' answers and scores them
   ("Answer 2: 7/10", gateway/proxy/ensemble/prompts.py);
3. the answer with the best mean score (ties: the earliest) wins;
4. its backend refines it with the critiques, and that is what the client
   gets, in its surface's shape, streamed if it asked (the other answering
   backends are tried in score order if it fails; if all fail, the best
   answer as it was).

With one backend there is nothing to compare: its answer is the answer,
streamed as it comes. With one answer (the others failed), that answer.

Every step is an OpenAI chat request sent by ``forward`` (retries aside: a
step is pinned to its backend; under the fleet strategy it waits in that
backend's line first, as a plain request does) and recorded by the
accounting against the caller's key with the ensemble's id; the key's
limits were taken once, for all the steps, and are settled with their sum
(``finish``), the streamed last step metered against the budget meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.exchange import Exchange
from gateway.fleet.errors import FleetRefusal
from gateway.fleet.scheduler import Placement
from gateway.protocols.base import dumps
from gateway.proxy.accounting import Accounting
from gateway.proxy.ensemble import prompts
from gateway.proxy.ensemble.delivery import Collected, FinalAnswer, reply_text
from gateway.proxy.ensemble.plans import EnsemblePlan, plan_for
from gateway.proxy.errors import ProxyError, routing_error
from gateway.proxy.forward import Upstream, forward
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.limits import BudgetMeter
from gateway.proxy.relays import Send
from gateway.proxy.surfaces import OPENAI, Surface
from routing.core import (
    RequestRequirements,
    Route,
    RoutingError,
    Target,
)
from routing.state import GatewayState

if TYPE_CHECKING:
    from gateway.process import Gateway

ENSEMBLE_HEADER = b"x-nexus-ensemble"
ENSEMBLE_ID_HEADER = b"x-nexus-ensemble-id"
CHAT_PATH = "/v1/chat/completions"
CLIENT_CLOSED = 499
# Usage of a step no backend saw (the fleet's line refused it): nothing.
_NOTHING_BILLED = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@dataclass(slots=True)
class _Step:
    """One step's outcome: its reply, or what went wrong."""

    target: Target
    reply: dict[str, Any] | None
    failure: str = ""
    status: int = 0

    @property
    def text(self) -> str:
        return reply_text(self.reply)


class Ensembles:
    """Runs the ensemble requests of one gateway (see the module docstring)."""

    def __init__(
        self, gateway: Gateway, upstream: Upstream, accounting: Accounting
    ) -> None:
        self.gateway = gateway
        self.upstream = upstream
        self.accounting = accounting

    def plan(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
    ) -> EnsemblePlan | None:
        """The request's ensemble, or None for any other request (cheap)."""
        return plan_for(exchange, state, requirements)

    async def run(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        state: GatewayState,
        send: Send,
    ) -> None:
        """Gather the opinions and answer the client (see the module docstring)."""
        gateway = self.gateway
        try:
            route = gateway.router.select(
                plan.requirements, state.routes, gateway.stats
            )
        except RoutingError as error:
            raise routing_error(error) from error
        targets = _opinion_targets(route, plan.policy.opinions)
        model = route.target.model.name
        final = FinalAnswer(exchange, _surface_of(exchange), plan.inbound, send)
        asked = f"opinions={len(targets)} of {plan.policy.opinions}"
        headers = exchange.response_headers
        headers.append((ENSEMBLE_ID_HEADER, plan.ensemble_id.encode()))
        if len(targets) == 1:
            # One backend: nothing to compare, its answer streams as it comes.
            headers.append((ENSEMBLE_HEADER, f"{asked}; answered=1".encode()))
            request = prompts.answer_request(plan.inbound.canonical, model)
            request["stream"] = plan.inbound.stream
            failure, status = await self._final(plan, exchange, final, targets, request)
            if not final.delivered:
                raise _all_failed(plan, [(targets[0], failure, status)])
            return
        opinions = await self._opinions(plan, exchange, targets, model)
        if len(opinions) == 1:
            headers.append((ENSEMBLE_HEADER, f"{asked}; answered=1".encode()))
            await _send_as_is(final, opinions[0][1])
            return
        ranked, verdict = await self._judge(plan, exchange, opinions, model)
        headers.append((ENSEMBLE_HEADER, f"{asked}; {verdict}".encode()))
        best_opinion, best_step, critiques = ranked[0]
        request = prompts.refine_request(
            plan.policy.refine_template,
            plan.inbound.canonical,
            best_opinion.text,
            critiques,
            model,
        )
        request["stream"] = plan.inbound.stream
        order = [step.target for _, step, _ in ranked]
        await self._final(plan, exchange, final, order, request)
        if not final.delivered:
            # No backend refined it: the best answer as it was.
            await _send_as_is(final, best_step)

    async def _opinions(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        targets: list[Target],
        model: str,
    ) -> list[tuple[prompts.Opinion, _Step]]:
        """Every backend's answer, numbered from 1; raises when none answered."""
        request = prompts.answer_request(plan.inbound.canonical, model)
        answers = await self._all(plan, exchange, [(t, request) for t in targets])
        opinions = [
            (prompts.Opinion(number, step.text), step)
            for number, step in enumerate(answers, 1)
            if step.text
        ]
        if not opinions:
            raise _all_failed(
                plan, [(s.target, s.failure or "no text", s.status) for s in answers]
            )
        return opinions

    async def _judge(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        opinions: list[tuple[prompts.Opinion, _Step]],
        model: str,
    ) -> tuple[list[tuple[prompts.Opinion, _Step, list[str]]], str]:
        """The opinions best first (each with every critique's text) and the
        verdict for the header."""
        critiques = await self._critiques(plan, exchange, opinions, model)
        numbers = [opinion.number for opinion, _ in opinions]
        votes = [
            prompts.parse_scores(step.text, [n for n in numbers if n != number])
            for number, step in critiques
        ]
        texts = [step.text for _, step in critiques if step.text]
        by_number = {opinion.number: (opinion, step) for opinion, step in opinions}
        ranked = [(*by_number[n], texts) for n in prompts.rank(numbers, votes)]
        scores = prompts.mean_scores(numbers, votes)
        shown = ",".join(
            f"{n}:{scores[n]:.1f}" if n in scores else f"{n}:-" for n in numbers
        )
        verdict = (
            f"answered={len(opinions)}; "
            f"critiques={sum(1 for vote in votes if vote)}; "
            f"best={ranked[0][0].number}; scores={shown}"
        )
        return ranked, verdict

    def finish(self, plan: EnsemblePlan, exchange: ProxyExchange) -> None:
        """Settle the key's limits with what every step cost.

        An ensemble refused before any step (the key, admission, routing) is
        recorded once, as a refused request.
        """
        if plan.steps_run == 0:
            self.accounting.record(exchange)
            return
        ticket = exchange.limit_ticket
        if ticket is not None:
            exchange.limit_ticket = None
            self.accounting.limiter.settle(ticket, plan.tokens, plan.nanos)

    async def _critiques(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        opinions: list[tuple[prompts.Opinion, _Step]],
        model: str,
    ) -> list[tuple[int, _Step]]:
        """Each answering backend's critique of the others' answers."""
        question = prompts.question_of(plan.inbound.canonical)
        template = plan.policy.critique_template
        requests = []
        for opinion, step in opinions:
            others = [o for o, _ in opinions if o.number != opinion.number]
            requests.append(
                (
                    step.target,
                    prompts.critique_request(template, question, others, model),
                )
            )
        steps = await self._all(plan, exchange, requests)
        return [
            (opinion.number, step)
            for (opinion, _), step in zip(opinions, steps, strict=True)
        ]

    async def _all(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        requests: list[tuple[Target, dict[str, Any]]],
    ) -> list[_Step]:
        """Run one step on several backends at once."""
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._ask(plan, exchange, target, request))
                for target, request in requests
            ]
        return [task.result() for task in tasks]

    async def _ask(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        target: Target,
        request: dict[str, Any],
    ) -> _Step:
        """One backend's whole reply to a step, within the step timeout."""
        sink = Collected()
        step = self._step_exchange(plan, exchange, request)
        failure = await self._forward(
            plan, step, (target,), sink, plan.policy.step_timeout_seconds
        )
        if failure:
            return _Step(target, None, failure, step.status)
        reply = sink.reply()
        if reply is None:
            return _Step(target, None, sink.error(), sink.status)
        return _Step(target, reply)

    async def _final(
        self,
        plan: EnsemblePlan,
        exchange: ProxyExchange,
        final: FinalAnswer,
        order: list[Target],
        request: dict[str, Any],
    ) -> tuple[str, int]:
        """Send the last step's answer to the client (``final.delivered``);
        the targets after the first are its retries. Returns what failed and
        its status."""
        step = final.step = self._step_exchange(plan, exchange, request)
        step.meter = self._meter(plan, exchange, step)
        failure = await self._forward(
            plan, step, tuple(order), final, plan.policy.step_timeout_seconds, final
        )
        return failure or final.failure, step.status

    def _meter(
        self, plan: EnsemblePlan, exchange: ProxyExchange, step: ProxyExchange
    ) -> BudgetMeter | None:
        """The budget meter of the streamed last step, as a budgeted stream of
        any request has (pipeline._check_key): counted on top of what the
        earlier steps spent, against the ensemble's one ticket."""
        ticket, policy, state = exchange.limit_ticket, exchange.policy, exchange.state
        if (
            not step.stream
            or ticket is None
            or policy is None
            or not policy.has_any_budget
            or state is None
        ):
            return None
        prompt = step.requirements.estimated_tokens if step.requirements else 0
        return BudgetMeter(
            self.accounting.limiter,
            ticket,
            state.prices,
            plan.base,
            prompt,
            spent=(plan.tokens, plan.nanos),
        )

    def _step_exchange(
        self, plan: EnsemblePlan, exchange: ProxyExchange, request: dict[str, Any]
    ) -> ProxyExchange:
        try:
            requirements = RequestRequirements.from_request(request)
        except RoutingError:
            requirements = plan.requirements
        step: ProxyExchange = Exchange(
            request_id=exchange.request_id,
            endpoint=exchange.endpoint,
            path=CHAT_PATH,
            requested_model=exchange.requested_model,
            stream=request.get("stream") is True,
            key_prefix=exchange.key_prefix,
            policy=exchange.policy,
            state=exchange.state,
            requirements=requirements,
            payload=request,
            raw=dumps(request),
            ensemble_id=plan.ensemble_id,
            # Each step's attempts are spans of the request's trace.
            trace=exchange.trace,
        )
        return step

    async def _forward(
        self,
        plan: EnsemblePlan,
        step: ProxyExchange,
        targets: tuple[Target, ...],
        sink: Send,
        timeout: float,
        final: FinalAnswer | None = None,
    ) -> str:
        """Send one step through the gateway's forwarding; record it.

        The first of `targets` is its backend, the others its retries. Under
        the fleet strategy the step waits in that backend's line for a slot,
        as a plain request does (the router kept a backend at its limit as a
        candidate for that), within the step's timeout. Returns why it failed
        ("" if the backend answered; the answer may still be an error, which
        the sink holds).
        """
        self.accounting.open(step)
        plan.steps_run += 1
        step.started = time.perf_counter()
        endpoint, step.endpoint = step.endpoint, "chat"  # forward speaks OpenAI chat
        failure = ""
        try:
            async with asyncio.timeout(timeout) as timer:
                if final is not None:
                    # The refined answer may stream for longer than a step.
                    final.on_start = lambda: timer.reschedule(None)
                placement = await self._slot(targets, step)
                await forward(self.upstream, step, placement, sink)
        except FleetRefusal as error:
            step.status = 503
            step.error = error.code
            step.usage = _NOTHING_BILLED
            failure = error.message
        except ProxyError as error:
            step.status = error.status
            step.error = error.code or error.error_type
            failure = error.message
        except TimeoutError:
            step.status = 504
            step.error = "ensemble_step_timeout"
            failure = f"no answer within {timeout:g} s"
        except asyncio.CancelledError:
            step.status = CLIENT_CLOSED
            step.error = "client_closed"
            raise
        finally:
            step.endpoint = endpoint
            tokens, nanos = self.accounting.record(step)
            plan.tokens += tokens
            plan.nanos += nanos
        return failure

    async def _slot(
        self, targets: tuple[Target, ...], step: ProxyExchange
    ) -> Placement:
        """Where the step runs: its backend once the fleet's line lets it in
        (at once outside the fleet strategy), or where the line moved it."""
        target, retries = targets[0], targets[1:]
        state = step.state
        if state is None:
            return Placement(target, retries)
        fleet = self.gateway.fleet
        routes = state.routes
        if fleet.settings_for(routes).enabled:
            fleet.note_sent(target, routes)  # as after_decision does
        placed = await fleet.place(target, retries, routes)
        return Placement(target, retries) if placed is None else placed


def _opinion_targets(route: Route, opinions: int) -> list[Target]:
    """Up to `opinions` backends for the chosen model: the router's choice,
    then its retry order (healthy, capable, circuit closed), one per backend."""
    chosen = route.target
    targets = [chosen]
    seen = {chosen.backend.name}
    for target in route.decision.retry_order:
        if len(targets) >= opinions:
            break
        name = target.backend.name
        if target.model.name == chosen.model.name and name not in seen:
            seen.add(name)
            targets.append(target)
    return targets


async def _send_as_is(final: FinalAnswer, step: _Step) -> None:
    """Answer the client with the reply a step already got."""
    assert step.reply is not None  # only steps with text are opinions
    await final.deliver(step.reply, step.target.backend.name)


def _surface_of(exchange: ProxyExchange) -> Surface:
    call = exchange.call
    return OPENAI if call is None else call.surface


def _all_failed(
    plan: EnsemblePlan, failures: list[tuple[Target, str, int]]
) -> ProxyError:
    """The client's error when no backend gave an opinion."""
    detail = "; ".join(f"{t.backend.name}: {why}" for t, why, _ in failures)
    statuses = {status for _, _, status in failures}
    message = f"No backend gave an opinion for model '{plan.name}': {detail}."
    if len(statuses) == 1 and 400 <= (status := statuses.pop()) < 500:
        # Every backend refused the request itself: the client's to fix.
        return ProxyError(status, message, code="ensemble_failed")
    return ProxyError(502, message, error_type="server_error", code="ensemble_failed")
