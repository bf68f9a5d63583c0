"""Shadow traffic: a share of a model's requests also sent to another model.

For a served model with ``[routing.shadows."<model>"]``, ``pick`` draws
whether this request is mirrored (``percent``) and, if so, has the relay
keep the client's answer as it passes (the response cache's ``Pending``).
Once the client has its whole answer, ``launch`` starts a separate task: the
same chat, not streamed, to the shadow model, in admission's sheddable band
under the ``shadow`` pseudo-key, with its own timeout, never retried (one
backend) and never hedged. Its usage is recorded under the ``shadow`` key,
never the client's (whose budget and limits it never touches). Both answers
and their comparison (routing.core.shadow_compare) go to the gateway's
bounded comparison store, which keeps the newest N per shadow in the
database (gateway/shadow_store.py, routing/shadow_store.py).

A client never waits for a shadow: nothing here runs before its answer is
complete, and at most ``MAX_RUNNING`` shadows run at once per process (more
are dropped, counted as ``shed``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.admission import CRITICALITY_HEADER
from gateway.cache.entries import Pending
from gateway.fleet.scheduler import Placement
from gateway.proxy.accounting import Accounting
from gateway.proxy.errors import ProxyError
from gateway.proxy.forward import Upstream, forward
from gateway.proxy.legs import ProxyExchange
from routing.admission import AdmissionError
from routing.core import RequestRequirements, RoutingError
from routing.core.shadow_compare import (
    AnswerSummary,
    ComparisonRow,
    compare,
    summarize,
    wants_json,
)
from routing.core.traffic import ShadowPolicy
from routing.state import GatewayState

if TYPE_CHECKING:
    from gateway.process import Gateway

SHADOW_KEY = "shadow"
MAX_RUNNING = 32
# The client's answer kept for comparison: at most this many bytes of text.
CAPTURE_BYTES = 262_144
_SHEDDABLE = [(CRITICALITY_HEADER, b"sheddable")]
_SHADOWED_ENDPOINTS = frozenset({"chat"})


@dataclass(slots=True)
class ShadowJob:
    """One mirrored request: the client's side, and where the shadow goes."""

    policy: ShadowPolicy
    state: GatewayState
    payload: dict[str, Any]
    request_id: str
    primary_model: str
    capture: Pending
    primary_reply: dict[str, Any] | None = None
    primary_latency_ms: float = 0.0
    created_at: float = field(default_factory=time.time)


class Shadows:
    """Picks, runs and compares one serving process's shadow requests."""

    def __init__(
        self,
        gateway: Gateway,
        upstream: Upstream,
        accounting: Accounting,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.gateway = gateway
        self.upstream = upstream
        self.accounting = accounting
        self._rng = rng or random.Random()
        self._running: set[asyncio.Task[None]] = set()

    def pick(
        self, exchange: ProxyExchange, state: GatewayState, model: str
    ) -> ShadowJob | None:
        """A job if this request is mirrored (most: one lookup in a mapping)."""
        if not state.shadows:
            return None
        policy = state.shadows.get(model)
        if policy is None or not policy.is_picked(self._rng.random()):
            return None
        payload = _chat_payload(exchange)
        if payload is None:
            return None
        job = ShadowJob(policy, state, payload, exchange.request_id, model, _capture())
        _keep_answer(exchange, job)
        return job

    def launch(self, job: ShadowJob, exchange: ProxyExchange) -> None:
        """Start the shadow once the client has its whole answer (never waits)."""
        metrics = self.gateway.metrics.shadow_requests
        if exchange.status != 200 or exchange.error or job.primary_reply is None:
            return  # nothing to compare with
        if len(self._running) >= MAX_RUNNING:
            metrics.labels(job.primary_model, "shed").inc()
            return
        job.primary_latency_ms = (time.perf_counter() - exchange.started) * 1000
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, job: ShadowJob) -> None:
        policy = job.policy
        started = time.perf_counter()
        reply: dict[str, Any] | None = None
        error = ""
        outcome = "compared"
        try:
            async with asyncio.timeout(policy.timeout_seconds):
                reply, error = await self._ask(job)
        except TimeoutError:
            error, outcome = f"timed out after {policy.timeout_seconds:g} s", "timeout"
        except AdmissionError as refused:
            error, outcome = f"shed by admission: {refused.message}", "shed"
        if error and outcome == "compared":
            outcome = "failed"
        self.gateway.metrics.shadow_requests.labels(job.primary_model, outcome).inc()
        if outcome == "shed":
            return
        latency = (time.perf_counter() - started) * 1000
        self.gateway.shadow_comparisons.add(_row(job, reply, error, latency))

    async def _ask(self, job: ShadowJob) -> tuple[dict[str, Any] | None, str]:
        """Send the chat to the shadow model; its reply, or an error."""
        gateway, state = self.gateway, job.state
        payload = {**job.payload, "model": job.policy.shadow}
        requirements = RequestRequirements.from_request(payload)
        admission = gateway.admission
        ticket = admission.prepare(state, requirements, payload, SHADOW_KEY, _SHEDDABLE)
        try:
            if ticket is not None:
                await admission.admit(ticket)
            try:
                route = gateway.router.select(requirements, state.routes, gateway.stats)
            except RoutingError as refused:
                return None, refused.message
            exchange = ProxyExchange(
                request_id=f"{job.request_id}-shadow",
                endpoint="chat",
                path="/v1/chat/completions",
                requested_model=job.policy.shadow,
                key_prefix=SHADOW_KEY,
                state=state,
                requirements=requirements,
                payload=payload,
                raw=json.dumps(payload, separators=(",", ":")).encode(),
                request_headers=list(_SHEDDABLE),
                started=time.perf_counter(),
                route=route,
            )
            answer = _Collected()
            try:
                # No retry target: a shadow is never retried.
                await forward(
                    self.upstream, exchange, Placement(route.target, ()), answer.send
                )
            except ProxyError as failed:
                exchange.status, exchange.error = failed.status, failed.code or "error"
                return None, failed.message
            finally:
                self.accounting.record(exchange)
            return answer.reply(), "" if exchange.status == 200 else (
                f"HTTP {exchange.status}"
            )
        finally:
            admission.release(ticket)


class _Collected:
    """The shadow's whole (not streamed) answer, bounded."""

    def __init__(self) -> None:
        self.body = bytearray()

    async def send(self, message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.body":
            room = CAPTURE_BYTES * 4 - len(self.body)
            self.body += message.get("body", b"")[: max(room, 0)]

    def reply(self) -> dict[str, Any] | None:
        try:
            reply = json.loads(bytes(self.body))
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None


def _chat_payload(exchange: ProxyExchange) -> dict[str, Any] | None:
    """The request as a plain OpenAI chat body (any surface), not streamed."""
    call = exchange.call
    if call is None:
        if exchange.endpoint not in _SHADOWED_ENDPOINTS:
            return None
        canonical = exchange.payload
    else:
        if call.inbound.canonical_endpoint not in _SHADOWED_ENDPOINTS:
            return None
        canonical = call.inbound.canonical
    payload = {k: v for k, v in canonical.items() if k != "stream_options"}
    payload["stream"] = False
    return payload


def _capture() -> Pending:
    return Pending("", "", "chat", 0.0, CAPTURE_BYTES)


def _keep_answer(exchange: ProxyExchange, job: ShadowJob) -> None:
    """Have the relay keep the client's answer for the job, beside the
    response cache's own keeping when a cache miss has it."""
    pending = exchange.cache
    if pending is None:
        pending = exchange.cache = job.capture
    keep = pending.on_complete

    async def on_complete() -> None:
        job.primary_reply = _whole_reply(pending)
        if keep is not None:
            await keep()

    pending.on_complete = on_complete


def _whole_reply(pending: Pending) -> dict[str, Any] | None:
    if pending.body is not None:
        try:
            reply = json.loads(pending.body)
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None
    if pending.reply is not None:
        return pending.reply
    if pending.collector is not None:
        return pending.collector.reply()
    return None


def _prompt(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    part.get("text", "")
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
    return ""


def _row(
    job: ShadowJob, reply: dict[str, Any] | None, error: str, latency_ms: float
) -> ComparisonRow:
    primary = summarize(job.primary_reply)
    shadow = summarize(reply) if reply is not None else AnswerSummary("", (), "", 0)
    compared = compare(primary, shadow, wants_json(job.payload))
    return ComparisonRow(
        model=job.primary_model,
        request_id=job.request_id,
        created_at=job.created_at,
        prompt=_prompt(job.payload),
        primary_model=job.primary_model,
        primary_answer=primary.text,
        primary_latency_ms=round(job.primary_latency_ms, 1),
        primary_tokens=primary.completion_tokens,
        primary_finish=primary.finish_reason,
        shadow_answer=shadow.text,
        shadow_latency_ms=round(latency_ms, 1),
        shadow_tokens=shadow.completion_tokens,
        shadow_finish=shadow.finish_reason,
        shadow_error=error,
        similarity=compared.similarity if not error else 0.0,
        tools_match=compared.tools_match,
        json_valid=compared.json_valid,
    )
