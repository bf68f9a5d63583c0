"""Compare a client's answer with a shadow model's: pure, no Django.

Both answers are OpenAI chat completions (canonical). The similarity is the
normalised overlap of their words (an F1 score over word counts, after
lower-casing and dropping punctuation: 1.0 for the same words, 0.0 for none
in common); tool calls are compared by the names called, in order; when the
request asked for JSON, whether the shadow's text is valid JSON.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"\w+")
# Words compared per answer: the rest is kept, not scored (bounded cost).
WORDS_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class AnswerSummary:
    """What is compared of one answer."""

    text: str
    tool_names: tuple[str, ...]
    finish_reason: str
    completion_tokens: int


def summarize(reply: dict[str, Any] | None) -> AnswerSummary:
    """Read the first choice of a chat completion (an empty one if unreadable)."""
    if not isinstance(reply, dict):
        return AnswerSummary("", (), "", 0)
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls")
    names = tuple(
        str(call["function"].get("name", ""))
        for call in (calls if isinstance(calls, list) else ())
        if isinstance(call, dict) and isinstance(call.get("function"), dict)
    )
    finish = choice.get("finish_reason")
    usage = reply.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return AnswerSummary(
        text,
        names,
        finish if isinstance(finish, str) else "",
        tokens if isinstance(tokens, int) and tokens >= 0 else 0,
    )


def text_similarity(first: str, second: str) -> float:
    """The overlap of two texts' words, 0.0 to 1.0 (both empty: 1.0)."""
    a = Counter(_WORD.findall(first.lower())[:WORDS_LIMIT])
    b = Counter(_WORD.findall(second.lower())[:WORDS_LIMIT])
    if not a and not b:
        return 1.0
    common = sum((a & b).values())
    total = sum(a.values()) + sum(b.values())
    return round(2 * common / total, 4) if total else 0.0


def wants_json(payload: dict[str, Any]) -> bool:
    """Whether a chat request asked for JSON (response_format)."""
    response_format = payload.get("response_format")
    return isinstance(response_format, dict) and response_format.get("type") in (
        "json_object",
        "json_schema",
    )


def is_json(text: str) -> bool:
    """Whether the text is one JSON value."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Comparison:
    """How a shadow's answer compares with the client's."""

    similarity: float
    tools_match: bool | None  # None: neither called a tool
    json_valid: bool | None  # None: JSON was not asked for


def compare(
    primary: AnswerSummary, shadow: AnswerSummary, asked_json: bool
) -> Comparison:
    """Compare the two answers (see the module)."""
    tools = None
    if primary.tool_names or shadow.tool_names:
        tools = primary.tool_names == shadow.tool_names
    return Comparison(
        similarity=text_similarity(primary.text, shadow.text),
        tools_match=tools,
        json_valid=is_json(shadow.text) if asked_json else None,
    )


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One comparison as the gateway made it (plain data)."""

    model: str  # the shadowed model: which Shadow row it belongs to
    request_id: str
    created_at: float
    prompt: str
    primary_model: str
    primary_answer: str
    primary_latency_ms: float
    primary_tokens: int
    primary_finish: str
    shadow_answer: str
    shadow_latency_ms: float
    shadow_tokens: int
    shadow_finish: str
    shadow_error: str
    similarity: float
    tools_match: bool | None
    json_valid: bool | None
