"""Prompt caching across protocols: Anthropic's breakpoints, and cached tokens.

Anthropic caches a prompt's prefix up to each ``cache_control`` breakpoint (on
tools, system blocks, message content blocks, or the request itself); at most
``MAX_BREAKPOINTS`` per request. Anthropic-kind backends get the client's
breakpoints untouched (the Messages body is passed through); every translator
to another protocol builds its blocks afresh and so leaves them out, ``ttl``
and all. ``add_breakpoints`` places Nexus's own (``[cache]
anthropic_auto_breakpoints``) when the client set none.

Cached tokens travel in canonical usage as OpenAI writes them:
``prompt_tokens`` counts every input token, ``prompt_tokens_details.
cached_tokens`` those read from a cache, ``prompt_tokens_details.
cache_write_tokens`` those written to one (Anthropic's cache creation).
``cache_counts`` reads both back for usage records.
"""

from __future__ import annotations

from typing import Any

MAX_BREAKPOINTS = 4
EPHEMERAL: dict[str, str] = {"type": "ephemeral"}


def count_breakpoints(body: dict[str, Any]) -> int:
    """Count the ``cache_control`` breakpoints of a Messages request body.

    Where the Messages API defines them: the request, tools, system blocks,
    message content blocks and the blocks of a tool result.
    """
    count = 1 if body.get("cache_control") is not None else 0
    count += _marked(body.get("tools"))
    count += _marked(body.get("system"))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            count += _marked(content)
            if isinstance(content, list):
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "tool_result":
                        count += _marked(block.get("content"))
    return count


def add_breakpoints(body: dict[str, Any]) -> dict[str, Any] | None:
    """A Messages request with breakpoints after its tools and its system prompt.

    Returns None when there is nothing to do: the client set breakpoints of
    its own (it chose what to cache), or the request has neither tools nor a
    system prompt. Adds at most two, so never more than ``MAX_BREAKPOINTS``.
    The body given is not changed.
    """
    if count_breakpoints(body):
        return None
    out = dict(body)
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[-1], dict):
        out["tools"] = [*tools[:-1], {**tools[-1], "cache_control": EPHEMERAL}]
    system = body.get("system")
    if isinstance(system, str) and system:
        out["system"] = [{"type": "text", "text": system, "cache_control": EPHEMERAL}]
    elif isinstance(system, list) and system and isinstance(system[-1], dict):
        out["system"] = [*system[:-1], {**system[-1], "cache_control": EPHEMERAL}]
    changed = out.get("tools") is not tools or out.get("system") is not system
    return out if changed else None


def cache_control_of(part: Any) -> dict[str, Any] | None:
    """A content part's or tool's ``cache_control`` when it is a valid one.

    OpenAI clients that talk to Anthropic models through a gateway (LiteLLM,
    OpenRouter conventions) set it on text parts and tools; Anthropic takes
    ``{"type": "ephemeral"}`` with an optional ``ttl``.
    """
    control = part.get("cache_control") if isinstance(part, dict) else None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        return None
    kept = {"type": "ephemeral"}
    if isinstance(control.get("ttl"), str):
        kept["ttl"] = control["ttl"]
    return kept


def cache_counts(usage: Any, prompt_tokens: int) -> tuple[int, int]:
    """Return the input tokens read from and written to a cache, of canonical usage.

    Both are clamped so that together they never exceed ``prompt_tokens``.
    """
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return 0, 0
    read = min(_count(details.get("cached_tokens")), prompt_tokens)
    written = min(_count(details.get("cache_write_tokens")), prompt_tokens - read)
    return read, written


def usage_with_cache_timings(payload: dict[str, Any]) -> dict[str, Any] | None:
    """A chat reply's (or chunk's) usage, with llama.cpp's cached tokens in it.

    llama.cpp's server reports the prompt tokens it reused from its cache as
    ``timings.cache_n`` (and older builds as ``tokens_cached``) beside the
    usage block rather than in ``prompt_tokens_details``; those become
    ``cached_tokens`` when the usage block has none. Returns the usage block
    (a copy when changed), or None when there is none.
    """
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    timings = payload.get("timings")
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    if cached is None:
        cached = payload.get("tokens_cached")
    cached = _count(cached)
    if not cached:
        return usage
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens"):
        return usage
    prompt = _count(usage.get("prompt_tokens"))
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = min(cached, prompt)
    return {**usage, "prompt_tokens_details": details}


def _marked(blocks: Any) -> int:
    if isinstance(blocks, dict):
        return 1 if blocks.get("cache_control") is not None else 0
    if not isinstance(blocks, list):
        return 0
    return sum(
        1
        for block in blocks
        if isinstance(block, dict) and block.get("cache_control") is not None
    )


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(value, 0)
