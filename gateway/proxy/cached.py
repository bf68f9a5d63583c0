"""The response cache on the proxy's side: bypass, hit or miss, and keep.

``CachedAnswers.answer`` runs for every routed request while ``[cache]`` is
on (``ProxyApp`` checks one attribute when it is off), after the body was
read and made canonical and before the pipeline:

* bypass: what is not cacheable (an endpoint other than chat or embeddings,
  an ensemble, content only the client's protocol carries, a sampled
  request under ``only_deterministic`` without ``x-nexus-cache: on``,
  ``Cache-Control: no-store``, ``x-nexus-cache: off``) goes on untouched;
* hit: the key's allow-list is checked, its requests-per-minute limit
  taken (not its tokens per minute nor its budget: nothing was computed),
  and the stored answer sent in the client's surface, whole or as a stream
  like a live one with its usage last; the accounting records it with
  ``cache_hit`` and the stored answer's tokens;
* miss (or ``Cache-Control: no-cache``, which skips the lookup): the
  exchange gets a ``Pending`` the relay fills in as the answer passes, and
  ``keep`` stores the answer once it is whole and went well (a whole 200, a
  stream that completed: never a partial one), before its last byte goes
  out, so that the client's next request finds it.

Every answer of a cacheable request says which in ``x-nexus-cache``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from gateway.cache.entries import Entry, Pending, replay_chunks
from gateway.cache.keys import (
    canonical_request,
    is_deterministic,
    native_fields,
    request_digest,
)
from gateway.cache.service import entry_key, scope_of
from gateway.protocols.openai import ChatStreamWriter
from gateway.proxy import limits
from gateway.proxy.accounting import token_counts
from gateway.proxy.ensemble.plans import ensemble_name
from gateway.proxy.errors import bad_request
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.relays import Send
from gateway.proxy.surfaces import OPENAI
from routing.core import RequestRequirements
from routing.core.cache_policy import TTL_LIMIT, CachePolicy
from routing.state import GatewayState

if TYPE_CHECKING:
    from gateway.process import Gateway

HIT = (b"x-nexus-cache", b"hit")
MISS = (b"x-nexus-cache", b"miss")
BYPASS = (b"x-nexus-cache", b"bypass")
TTL_HEADER = b"x-nexus-cache-ttl"
_CACHEABLE = frozenset({"chat", "embeddings"})
# A streamed hit goes out in ASGI messages of this many events.
EVENTS_PER_MESSAGE = 8
_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


class CachedAnswers:
    """The proxy's use of the gateway's response cache (see the module)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.cache = gateway.cache

    async def look_up(
        self,
        exchange: ProxyExchange,
        state: GatewayState,
        requirements: RequestRequirements,
    ) -> Entry | None:
        """The stored answer to serve (its key's limits taken), or None once
        the miss or the bypass is noted."""
        policy = state.routes.policy.cache
        control = switch = ttl_value = b""
        for name, value in exchange.request_headers:
            if name == b"cache-control":
                control = value.lower()
            elif name == b"x-nexus-cache":
                switch = value.strip().lower()
            elif name == TTL_HEADER:
                ttl_value = value.strip()
        call = exchange.call
        if call is None:
            canonical, endpoint = exchange.payload, exchange.endpoint
            native: dict[str, Any] = {}
        else:
            inbound = call.inbound
            canonical, endpoint = inbound.canonical, inbound.canonical_endpoint
            if inbound.untranslatable is not None:
                self._bypass(exchange)
                return None
            native = native_fields(call.surface.protocol, call.payload)
        routes = state.routes
        if (
            b"no-store" in control
            or switch in (b"off", b"0", b"false")
            or endpoint not in _CACHEABLE
            or (
                policy.only_deterministic
                and switch not in (b"on", b"1", b"true")
                and not is_deterministic(canonical, endpoint)
            )
            or ensemble_name(routes, requirements.model) is not None
        ):
            self._bypass(exchange)
            return None
        ttl = _ttl(ttl_value, policy)
        model = routes.alias_for(requirements.model) or requirements.model
        scope = scope_of(policy, exchange.key_prefix)
        request = canonical_request(canonical, model, endpoint, native)
        request["scope"] = scope
        key = entry_key(model, scope, request_digest(request))
        if b"no-cache" not in control:
            if exchange.policy is not None:
                limits.check_model(
                    exchange.policy, routes, requirements.model, self.gateway.metrics
                )
            entry = await self.cache.fetch(key)
            if (
                entry is not None
                and entry.model == model
                and entry.endpoint == endpoint
                and not policy.is_purged(entry.stored_at, model, scope)
            ):
                await self._take_limits(exchange)
                return entry
        self.cache.misses.inc()
        exchange.response_headers.append(MISS)
        pending = Pending(key, model, endpoint, ttl, policy.max_entry_bytes)
        pending.on_complete = lambda: self.keep(exchange)
        exchange.cache = pending
        return None

    async def keep(self, exchange: ProxyExchange) -> None:
        """Store a miss's answer if it is whole and went well (the relay calls
        this before the answer's last byte: a store takes one round trip to
        Redis, bounded by its timeout, and never fails the request)."""
        pending, exchange.cache = exchange.cache, None
        if (
            pending is None
            or exchange.status != 200
            or exchange.error
            or exchange.client_gone
            or exchange.served_model != pending.model
            or pending.unreadable
        ):
            return
        if pending.body is not None:
            try:
                reply = orjson.loads(pending.body)
            except orjson.JSONDecodeError:
                return
        elif pending.reply is not None:
            reply = pending.reply
        elif pending.collector is not None:
            reply = pending.collector.reply()
            if reply is None:
                if pending.collector.too_large:
                    self.cache.too_large.inc()
                return
        else:
            return
        if not isinstance(reply, dict):
            return
        prompt, completion, _, _ = token_counts(exchange)
        usage = reply.get("usage")
        if not isinstance(usage, dict):
            reply["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        data = (
            pending.body
            if pending.body is not None and isinstance(usage, dict)
            else orjson.dumps(reply)
        )
        now = time.time()
        entry = Entry(
            model=pending.model,
            endpoint=pending.endpoint,
            stored_at=now,
            prompt_tokens=prompt,
            completion_tokens=completion,
            reply=data,
            expires_at=now + pending.ttl,
        )
        await self.cache.keep(pending.key, entry, pending.ttl, pending.max_bytes)

    def _bypass(self, exchange: ProxyExchange) -> None:
        self.cache.bypasses.inc()
        exchange.response_headers.append(BYPASS)

    async def _take_limits(self, exchange: ProxyExchange) -> None:
        """A hit counts against its key's requests per minute and concurrency;
        not its tokens per minute nor its budget (nothing was computed)."""
        policy = exchange.policy
        if policy is not None and policy.is_limited:
            team = policy.team and replace(
                policy.team, tpm=None, budget_tokens=None, budget_nanos=None
            )
            counted = replace(
                policy, tpm=None, budget_tokens=None, budget_nanos=None, team=team
            )
            exchange.limit_ticket = await limits.admit(
                self.gateway.limiter,
                counted,
                0,
                0,
                exchange.response_headers,
                self.gateway.metrics,
            )

    async def serve_hit(
        self, exchange: ProxyExchange, entry: Entry, send: Send
    ) -> None:
        """Send the stored answer (the caller records the request)."""
        self.cache.hits.inc()
        exchange.cache_hit = True
        exchange.served_model = model = entry.model
        exchange.usage = entry.usage
        exchange.status = 200
        headers = exchange.response_headers
        headers += (
            HIT,
            (b"age", str(entry.age()).encode()),
            (b"x-nexus-model", model.encode()),
        )
        call = exchange.call
        if not exchange.stream:
            if call is None:
                body = entry.reply  # OpenAI's own shape, as stored
            else:
                body = call.surface.reply(
                    orjson.loads(entry.reply), model, call.inbound
                )
            exchange.first_byte = time.perf_counter()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        *headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if call is None:
            options = exchange.payload.get("stream_options")
            writer: Any = ChatStreamWriter(
                isinstance(options, dict) and options.get("include_usage") is True
            )
            content_type = OPENAI.stream_content_type
        else:
            writer = call.surface.stream_writer(call.inbound, model)
            content_type = call.surface.stream_content_type
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", content_type),
                    *_STREAM_HEADERS,
                    *headers,
                ],
            }
        )
        exchange.first_byte = time.perf_counter()
        events: list[bytes] = []
        for chunk in replay_chunks(orjson.loads(entry.reply), entry.usage):
            events += writer.feed(chunk)
            if len(events) >= EVENTS_PER_MESSAGE:
                body = b"".join(events)
                events = []
                await send(
                    {"type": "http.response.body", "body": body, "more_body": True}
                )
        events += writer.finish()
        await send({"type": "http.response.body", "body": b"".join(events)})


def _ttl(value: bytes, policy: CachePolicy) -> float:
    """The entry's time to live: the request's x-nexus-cache-ttl, or the policy's."""
    if not value:
        return float(policy.ttl_seconds)
    if value.isdigit() and 1 <= int(value) <= TTL_LIMIT:
        return float(int(value))
    raise bad_request(
        f"x-nexus-cache-ttl must be a whole number of seconds from 1 to {TTL_LIMIT}.",
        param="x-nexus-cache-ttl",
    )
