"""Context shift: a chat that no longer fits a model's context, trimmed to fit.

A small-context local model (llama.cpp, Ollama, vLLM with ``n_ctx`` 4096-8192)
answers a long chat with a context overflow error. Rather than pass that on,
``forward`` asks this module whether the answer is such an overflow
(``recognise``: one pattern table per backend kind, tested against the
servers' recorded bodies in tests/fixtures/context_overflow/) and, if so, for
a trimmed request to send to the same backend again (``RequestShift``).

The trim itself (``trim_messages``) is pure: system messages are always kept;
the oldest other messages go first; the newest message never goes; a tool
call goes together with its results; what is left starts with a user
message. The target is the request's own estimate (characters / 4, as the
router estimates) scaled by the server's numbers when it gives them
(``n_ctx`` / ``n_prompt_tokens``), else the model's known context length.
Retry 1 keeps the tool definitions, retry 2 drops them too.

``ContextLimits`` remembers, per process, the limit of a backend x model that
overflowed with a context of at most 32,768 tokens, so later requests to that
pair are trimmed before they are sent (pre-trimming).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.context_limits import ContextLimits
from gateway.protocols.base import dumps
from gateway.proxy.legs import Call, ProxyExchange
from routing.core.context_shift_policy import ContextShiftPolicy

# Aim this far under the computed limit: the estimate is not the server's
# tokenizer, and the answer needs room too.
MARGIN = 0.85
# Error bodies longer than this are not read for an overflow (they are not one).
MAX_ERROR_BODY = 64 * 1024
# Answers that may carry an overflow: 400 (llama.cpp, vLLM, OpenAI, Ollama),
# 413 and 422 (some OpenAI-compatible servers), 500 (llama.cpp before
# build 6390 and Ollama's runner).
OVERFLOW_STATUSES = frozenset({400, 413, 422, 500})
# Endpoints whose requests are a list of messages that may be trimmed.
SHIFTED_ENDPOINTS = frozenset({"chat", "messages", "responses", "ollama-chat"})
HEADER = b"x-nexus-context-shift"


@dataclass(frozen=True, slots=True)
class Overflow:
    """A backend's context overflow and the numbers it gave (None: not given).

    ``n_ctx`` is the context limit, ``n_prompt_tokens`` the prompt as the
    server counted it, ``completion`` the tokens it reserved for the answer.
    """

    n_ctx: int | None = None
    n_prompt_tokens: int | None = None
    completion: int = 0

    def scale(self) -> float | None:
        """The share of the prompt that fits, by the server's own count."""
        if not self.n_ctx or not self.n_prompt_tokens:
            return None
        room = self.n_ctx - self.completion
        # No room at all: the answer's reservation overflows, not the prompt.
        return room / self.n_prompt_tokens if room > 0 else None


@dataclass(frozen=True, slots=True)
class _Pattern:
    """One server's overflow: a regex over its error message, and its numbers."""

    message: re.Pattern[str]
    # Named groups of ``message`` holding n_ctx, n_prompt_tokens, completion.
    numbers: bool = False


_LLAMACPP = _Pattern(
    re.compile(
        r"exceeds? the available context size|request \((?P<n_prompt_tokens>\d+) "
        r"tokens\) exceeds the available context size \((?P<n_ctx>\d+) tokens\)",
        re.IGNORECASE,
    ),
    numbers=True,
)
_VLLM = _Pattern(
    re.compile(
        r"maximum context length is (?P<n_ctx>\d+) tokens\. However, you requested "
        r"(?P<requested>\d+) tokens \((?P<n_prompt_tokens>\d+) in the messages, "
        r"(?P<completion>\d+) in the completion\)"
        r"|maximum context length is (?P<n_ctx2>\d+) tokens.*?(?:resulted in|"
        r"requested) (?P<n_prompt_tokens2>\d+) tokens",
        re.IGNORECASE | re.DOTALL,
    ),
    numbers=True,
)
_OLLAMA = _Pattern(
    re.compile(
        r"input length exceeds the (?:maximum )?context length|"
        r"exceeds (?:the )?context length|context length exceeded",
        re.IGNORECASE,
    )
)

# Per backend kind, the patterns tried in order (OpenAI-compatible servers
# may be any of them behind a proxy, so they get every pattern).
PATTERNS: dict[str, tuple[_Pattern, ...]] = {
    "llamacpp": (_LLAMACPP, _VLLM),
    "ollama": (_OLLAMA, _LLAMACPP),
    "vllm": (_VLLM,),
    "openai": (_VLLM, _LLAMACPP, _OLLAMA),
    "anthropic": (),
}
# Machine-readable markers: llama.cpp's error type, OpenAI's code.
_TYPES = frozenset({"exceed_context_size_error", "context_exceeded"})
_CODES = frozenset({"context_length_exceeded"})


def recognise(kind: str, status: int, body: bytes) -> Overflow | None:
    """Return the overflow this error answer reports, None if it is not one."""
    if status not in OVERFLOW_STATUSES or len(body) > MAX_ERROR_BODY:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = ""
    marked = False
    numbers: dict[str, int] = {}
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        marked = error.get("type") in _TYPES or error.get("code") in _CODES
        for name in ("n_ctx", "n_prompt_tokens"):
            value = error.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                numbers[name] = value
    elif isinstance(error, str):
        message = error  # Ollama: {"error": "..."}
    elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        message = parsed["message"]  # vLLM: {"object": "error", "message": ...}
    for pattern in PATTERNS.get(kind, PATTERNS["openai"]):
        found = pattern.message.search(message)
        if found is None:
            continue
        marked = True
        if pattern.numbers:
            for name, value in found.groupdict().items():
                if value is not None and name != "requested":
                    numbers.setdefault(name.rstrip("2"), int(value))
        break
    if not marked:
        return None
    return Overflow(
        numbers.get("n_ctx"),
        numbers.get("n_prompt_tokens"),
        numbers.get("completion", 0),
    )


# The trim


def estimate(value: Any) -> int:
    """Tokens of a message or tool list: characters / 4, as the router counts."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"))) // 4


def _blocks(message: dict[str, Any], kind: str) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") == kind for block in content
    )


def _is_system(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in ("system", "developer")


def _is_call(message: dict[str, Any]) -> bool:
    """An assistant turn that calls tools (OpenAI, Ollama, Anthropic, Responses)."""
    if message.get("type") == "function_call":
        return True
    return message.get("role") == "assistant" and (
        bool(message.get("tool_calls")) or _blocks(message, "tool_use")
    )


def _is_result(message: dict[str, Any]) -> bool:
    """A tool's result, which goes with its call."""
    if message.get("type") == "function_call_output" or message.get("role") == "tool":
        return True
    return message.get("role") == "user" and _blocks(message, "tool_result")


def _is_user(message: dict[str, Any]) -> bool:
    return message.get("role") == "user" and not _is_result(message)


def trim_messages(
    messages: list[Any],
    budget: int,
    keep_last: int = 1,
    size: Callable[[Any], int] = estimate,
) -> tuple[list[Any], int]:
    """Drop the oldest non-system messages until the rest fit ``budget``.

    Returns the kept messages and how many were dropped (0: nothing could be).
    System messages and the newest ``keep_last`` (at least 1) are never
    dropped; a tool call and the results after it go together; once trimmed,
    leading assistant and tool messages go too, so the first non-system
    message is a user's.
    """
    # Units of non-system messages, oldest first: a tool call with its results.
    units: list[list[int]] = []
    for index, message in enumerate(messages):
        if _is_system(message):
            continue
        if (
            isinstance(message, dict)
            and _is_result(message)
            and units
            and isinstance(messages[units[-1][0]], dict)
            and _is_call(messages[units[-1][0]])
        ):
            units[-1].append(index)
        else:
            units.append([index])
    protected = max(keep_last, 1)
    others = [i for unit in units for i in unit]
    kept_from = others[-protected] if len(others) >= protected else 0
    total = sum(size(message) for message in messages)
    dropped: set[int] = set()
    for unit in units:
        if total <= budget or unit[-1] >= kept_from:
            break
        dropped.update(unit)
        total -= sum(size(messages[i]) for i in unit)
    if dropped:
        # What is left must start with a user's message (chat templates).
        for unit in units:
            if unit[0] in dropped:
                continue
            first = messages[unit[0]]
            if unit[-1] >= kept_from or (isinstance(first, dict) and _is_user(first)):
                break
            dropped.update(unit)
    kept = [m for i, m in enumerate(messages) if i not in dropped]
    return kept, len(dropped)


# One request's shifts


def _messages_key(endpoint: str, payload: dict[str, Any]) -> str | None:
    key = "input" if endpoint == "responses" else "messages"
    return key if isinstance(payload.get(key), list) else None


def _fixed_size(payload: dict[str, Any], key: str, with_tools: bool) -> int:
    """Tokens of what trimming does not touch: Anthropic's system, the tools."""
    fixed = estimate(payload.get("system") or "") + estimate(
        payload.get("instructions") or ""
    )
    if with_tools and payload.get("tools"):
        fixed += estimate(payload["tools"])
    return fixed


def shrink(
    endpoint: str,
    payload: dict[str, Any],
    overflow: Overflow | None,
    known_context: int | None,
    retry: int,
    settings: ContextShiftPolicy,
    limit: int | None = None,
) -> tuple[dict[str, Any], int, bool] | None:
    """The trimmed payload for retry ``retry`` (1, 2, ...), or None.

    Returns (payload, messages dropped, tools dropped); None when nothing
    could be dropped, so the overflow stands. ``limit`` (pre-trimming) is the
    size to trim to, in the estimate's tokens. Retry 1 trims the messages and
    keeps the tools; from retry 2 on (or when no message can go at retry 1)
    the tools go too.
    """
    key = _messages_key(endpoint, payload)
    if key is None:
        return None
    messages = payload[key]
    has_tools = bool(payload.get("tools"))
    whole = estimate(messages) + _fixed_size(payload, key, True)
    scale = overflow.scale() if overflow is not None else None
    if limit is not None:
        budget = limit
    elif scale is not None:
        budget = int(whole * min(scale, 1.0) * MARGIN)
    elif known_context:
        budget = int(known_context * MARGIN)
    else:
        budget = int(whole * 0.5)  # nothing known: halve it
    budget = min(budget, int(whole * MARGIN))  # each retry must drop something

    def attempt(drop_tools: bool) -> tuple[dict[str, Any], int, bool] | None:
        room = budget - _fixed_size(payload, key, not drop_tools)
        kept, dropped = trim_messages(messages, room, settings.keep_last_messages)
        tools_gone = drop_tools and has_tools
        if not dropped and not tools_gone:
            return None
        trimmed = {**payload, key: kept}
        if tools_gone:
            trimmed.pop("tools", None)
            trimmed.pop("tool_choice", None)
        return trimmed, dropped, tools_gone

    if retry < 2:
        return attempt(False) or (attempt(True) if has_tools else None)
    return attempt(True)


def fits(endpoint: str, payload: dict[str, Any], limit: int) -> bool:
    """Whether the request's estimate is within ``limit`` tokens."""
    key = _messages_key(endpoint, payload)
    if key is None:
        return True
    return estimate(payload[key]) + _fixed_size(payload, key, True) <= limit


def estimated_limit(
    endpoint: str, payload: dict[str, Any], overflow: Overflow | None
) -> int | None:
    """The request size, in our estimate's tokens, the server would take."""
    key = _messages_key(endpoint, payload)
    scale = overflow.scale() if overflow is not None else None
    if key is None or scale is None:
        return None
    whole = estimate(payload[key]) + _fixed_size(payload, key, True)
    return int(whole * min(scale, 1.0) * MARGIN)


class RequestShift:
    """One request's context shifts: the trims so far, applied to its exchange.

    The client's body is trimmed in its own surface's shape and made canonical
    again, so every leg (native or translated) is built from the trimmed one.
    """

    __slots__ = ("exchange", "limits", "retries", "settings", "tools")

    def __init__(
        self,
        exchange: ProxyExchange,
        settings: ContextShiftPolicy,
        limits: ContextLimits,
    ) -> None:
        self.exchange = exchange
        self.settings = settings
        self.limits = limits
        self.retries = 0
        self.tools = False

    @classmethod
    def of(cls, exchange: ProxyExchange, limits: ContextLimits) -> RequestShift | None:
        """The request's shift, None when context shift is off or not for it."""
        state = exchange.state
        if state is None or exchange.endpoint not in SHIFTED_ENDPOINTS:
            return None
        settings = state.routes.policy.context_shift
        if not settings.enabled:
            return None
        if _messages_key(exchange.endpoint, exchange.payload) is None:
            return None
        return cls(exchange, settings, limits)

    def fit(self, limit: int) -> bool:
        """Trim to ``limit`` tokens (a known context); True if it changed."""
        exchange = self.exchange
        shrunk = shrink(
            exchange.endpoint, exchange.payload, None, None, 1, self.settings, limit
        )
        return shrunk is not None and not shrunk[2] and self._apply(shrunk)

    def pre_trim(self, backend: str, model: str, context_length: int | None) -> bool:
        """Trim to this pair's remembered limit; True if the request changed."""
        limit = self.limits.limit(backend, model, context_length)
        exchange = self.exchange
        if limit is None or fits(exchange.endpoint, exchange.payload, limit):
            return False
        shrunk = shrink(
            exchange.endpoint, exchange.payload, None, None, 1, self.settings, limit
        )
        return shrunk is not None and self._apply(shrunk)

    def after_overflow(
        self,
        kind: str,
        backend: str,
        model: str,
        context_length: int | None,
        status: int,
        body: bytes,
    ) -> bool:
        """True when the answer was an overflow and a trimmed retry is ready."""
        overflow = recognise(kind, status, body)
        if overflow is None:
            return False
        exchange = self.exchange
        limit = estimated_limit(exchange.endpoint, exchange.payload, overflow)
        if limit is None and context_length:
            limit = int(context_length * MARGIN)
        if limit is not None:
            self.limits.remember(backend, model, limit, context_length, overflow.n_ctx)
        if self.retries >= self.settings.max_retries:
            return False
        self.retries += 1
        shrunk = shrink(
            exchange.endpoint,
            exchange.payload,
            overflow,
            context_length,
            self.retries,
            self.settings,
        )
        return shrunk is not None and self._apply(shrunk)

    def _apply(self, shrunk: tuple[dict[str, Any], int, bool]) -> bool:
        payload, dropped, tools = shrunk
        exchange = self.exchange
        raw = dumps(payload)
        call = exchange.call
        if call is not None:
            exchange.call = Call(
                call.surface,
                call.surface.to_canonical(payload),
                payload,
                raw,
                call.client_headers,
            )
        exchange.payload, exchange.raw = payload, raw
        exchange.context_dropped += dropped
        self.tools = self.tools or tools
        exchange.context_shifts += 1
        return True

    def show(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Set ``x-nexus-context-shift: dropped=N`` (and the tools, if they
        went) on the answer's headers, once whichever backend answers."""
        dropped = self.exchange.context_dropped
        if not dropped and not self.tools:
            return
        value = f"dropped={dropped}" + ("; tools=dropped" if self.tools else "")
        headers[:] = [h for h in headers if h[0] != HEADER]
        headers.append((HEADER, value.encode()))


def overflow_possible(status: int, response: Any) -> bool:
    """Whether this answer's head may be an overflow worth reading whole."""
    if status not in OVERFLOW_STATUSES:
        return False
    length = response.content_length
    content_type = response.headers.get("content-type", "")
    return (
        length is None or length <= MAX_ERROR_BODY
    ) and "event-stream" not in content_type
