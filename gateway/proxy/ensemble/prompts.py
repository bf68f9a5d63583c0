"""The words of an ensemble: the question, the critique and refine prompts, votes.

Pure functions over canonical (OpenAI chat) requests and plain text: what
the critics and the refining backend are asked, how their critiques' scores
are read ("Answer 2: 7/10", robustly: a missing or garbled score is no vote),
and which answer the votes choose (ties: the earliest).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# What of a client's text goes into a prompt, at most: an answer or a
# critique quoted to another backend, and the question.
MAX_QUOTED_CHARS = 16_000
MAX_QUESTION_CHARS = 64_000
# Only this much of a critique is searched for scores.
MAX_CRITIQUE_SCAN = 64_000

_ANSWER_MENTION = re.compile(
    r"answer\s*(?:#|no\.?|number)?\s*(\d{1,2})\b", re.IGNORECASE
)
_SCORE = re.compile(r"(\d{1,2}(?:\.\d+)?)\s*(?:/|out\s+of)\s*10\b", re.IGNORECASE)
# Request fields that the steps do not carry over from the client's request.
_NOT_CARRIED = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "n",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
    }
)


@dataclass(frozen=True, slots=True)
class Opinion:
    """One backend's answer, numbered as the critics see it (from 1)."""

    number: int
    text: str


def text_of(content: Any) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    pieces = []
    for part in content:
        if isinstance(part, dict):
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif part.get("type") == "image_url":
                pieces.append("[image]")
    return "\n".join(pieces)


def question_of(canonical: Mapping[str, Any]) -> str:
    """The client's request as the critics read it.

    A lone user message is its text; a conversation is written out turn by
    turn ("User: ...", "Assistant: ..."), its system prompt first.
    """
    messages = [m for m in canonical.get("messages") or () if isinstance(m, dict)]
    turns = [m for m in messages if m.get("role") != "system"]
    if len(turns) == 1 and len(messages) == 1:
        return _clip(text_of(turns[0].get("content")), MAX_QUESTION_CHARS)
    lines = []
    for message in messages:
        role = str(message.get("role") or "user").capitalize()
        lines.append(f"{role}: {text_of(message.get('content'))}")
    return _clip("\n\n".join(lines), MAX_QUESTION_CHARS)


def answer_request(canonical: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An opinion's request: the client's chat, whole, for `model`."""
    request = _carried(canonical, model)
    request["messages"] = canonical.get("messages") or []
    return request


def critique_request(
    template: str, question: str, others: Sequence[Opinion], model: str
) -> dict[str, Any]:
    """A critic's request: the others' answers to score (never its own)."""
    answers = "\n\n".join(
        f"--- Answer {opinion.number} ---\n{_clip(opinion.text, MAX_QUOTED_CHARS)}"
        for opinion in others
    )
    prompt = _fill(template, question=question, answers=answers)
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": False,
    }


def refine_request(
    template: str,
    canonical: Mapping[str, Any],
    best: str,
    critiques: Sequence[str],
    model: str,
) -> dict[str, Any]:
    """The refining backend's request: the question, the best answer, the
    critiques; the client's system prompt and sampling settings kept."""
    written = "\n\n".join(
        f"Reviewer {index}:\n{_clip(text, MAX_QUOTED_CHARS)}"
        for index, text in enumerate(critiques, 1)
    )
    prompt = _fill(
        template,
        question=question_of(canonical),
        answer=_clip(best, MAX_QUOTED_CHARS),
        critiques=written or "(none)",
    )
    request = _carried(canonical, model)
    system = [
        m
        for m in canonical.get("messages") or ()
        if isinstance(m, dict) and m.get("role") == "system"
    ]
    request["messages"] = [*system, {"role": "user", "content": prompt}]
    return request


def parse_scores(critique: str, shown: Sequence[int]) -> dict[int, float]:
    """The scores (0 to 10) a critique gives the answers it was shown.

    A line naming "Answer <n>" followed on that line by "<score>/10" (or
    "<score> out of 10") is a vote; the last one for an answer counts.
    Anything else (no score, another number, an answer not shown, a score
    out of range) is no vote.
    """
    allowed = set(shown)
    scores: dict[int, float] = {}
    for line in critique[:MAX_CRITIQUE_SCAN].splitlines():
        mentions = list(_ANSWER_MENTION.finditer(line))
        for index, mention in enumerate(mentions):
            end = mentions[index + 1].start() if index + 1 < len(mentions) else None
            found = _SCORE.search(line, mention.end(), end or len(line))
            number = int(mention.group(1))
            if found is None or number not in allowed:
                continue
            score = float(found.group(1))
            if 0 <= score <= 10:
                scores[number] = score
    return scores


def rank(numbers: Sequence[int], votes: Sequence[Mapping[int, float]]) -> list[int]:
    """Answer numbers best first: by mean score, ties (and no votes) earliest.

    An answer no critique scored comes after every scored one.
    """
    means = mean_scores(numbers, votes)
    position = {number: index for index, number in enumerate(numbers)}
    return sorted(
        numbers,
        key=lambda n: (n not in means, -means.get(n, 0.0), position[n]),
    )


def mean_scores(
    numbers: Sequence[int], votes: Sequence[Mapping[int, float]]
) -> dict[int, float]:
    """Each scored answer's mean score."""
    means = {}
    for number in numbers:
        given = [vote[number] for vote in votes if number in vote]
        if given:
            means[number] = sum(given) / len(given)
    return means


def _carried(canonical: Mapping[str, Any], model: str) -> dict[str, Any]:
    request = {k: v for k, v in canonical.items() if k not in _NOT_CARRIED}
    request["model"] = model
    request["stream"] = False
    return request


def _fill(template: str, **values: str) -> str:
    """Replace each ``{name}`` by its value, as plain text (no format syntax)."""
    if not values:
        return template
    pattern = re.compile("|".join(re.escape("{" + name + "}") for name in values))
    return pattern.sub(lambda match: values[match.group(0)[1:-1]], template)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"
