"""Prefix-aware routing: a prompt's chained block keys, and the choice they make.

A prompt is the text the model server computes, in its order: the tool
definitions, then every message (role and content) in turn, or a
completion's prompt. It is cut into ``block_chars``-character blocks; block
i's key hashes block i with block i-1's key, so equal keys mean equal
prompts up to there, and the longest prefix two prompts share is found by
walking the keys from the start (``PrefixView`` does that against what each
backend computed; gateway/prefix.py holds it per serving process).

``choose_backend`` turns the strategy's choice into the prefix-aware one:
the session's backend, else the candidate holding the longest prefix, as
long as its load (in flight; queue depth under the fleet strategy) is within
the load guard of the least-loaded candidate's; among equal matches the
strategy's own order decides. A prompt nothing holds goes where the
strategy sends it, or (smart, fleet) to the equally placed backend its
first block's anchor hashes to, so that every serving process gives it the
same home. Keys use Python's ``hash`` (salted per process): they are
compared within one process only; the anchor is a CRC every process
computes alike.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from routing.core.prefix_policy import PrefixPolicy

# Blocks of one prompt that are keyed (256 characters each by default: about
# 260,000 characters); the rest of a longer prompt is counted, not keyed.
MAX_KEYED_BLOCKS = 1024
# Separators that keep "ab"+"c" and "a"+"bc" apart in the prompt's text.
_FIELD = "\x1f"
_RECORD = "\x1e"


class Signal(enum.StrEnum):
    """What decided a prefix-aware choice."""

    PREFIX = "prefix"
    SESSION = "session"
    LOAD_GUARD = "load-guard"
    STRATEGY = "strategy"


class PrefixView(Protocol):
    """The live prefix state a choice reads (gateway/prefix.py implements it)."""

    def matched_blocks(self, model: str, keys: Sequence[int]) -> Mapping[str, int]:
        """Backend name -> how many of `keys`, from the first, it holds."""
        ...

    def session_backend(self, model: str, session: str) -> str | None:
        """The backend `session` used last, if within its time to live."""
        ...


class EmptyPrefixView:
    """A view that holds nothing: a process without a live index (nexus_route)."""

    def matched_blocks(self, model: str, keys: Sequence[int]) -> Mapping[str, int]:
        """Nothing matches."""
        return {}

    def session_backend(self, model: str, session: str) -> str | None:
        """No session is known."""
        return None


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """One request's prompt keys and session, with the view to match them in."""

    keys: tuple[int, ...]
    prompt_blocks: int
    session: str | None
    view: PrefixView
    # A hash of the prompt's first block that every process computes alike
    # (keys are salted per process): where a new prompt is placed.
    anchor: int = 0


@dataclass(frozen=True, slots=True)
class PrefixChoice:
    """What prefix routing made of one decision, for explain and metrics."""

    signal: Signal
    matched_blocks: int
    prompt_blocks: int
    # The backend the prefix or session pointed at, when the guard refused it.
    overridden: str | None = None
    # Its load and the least-loaded candidate's, when the guard refused it.
    overridden_load: int = 0
    least_load: int = 0
    session: bool = False

    @property
    def reuse(self) -> float:
        """The expected reuse: matched blocks / prompt blocks (0 for none)."""
        if not self.prompt_blocks:
            return 0.0
        return self.matched_blocks / self.prompt_blocks

    def reason(self) -> str:
        """The x-nexus-route-reason header's value: 'prefix; blocks=12/14'."""
        text = f"{self.signal}; blocks={self.matched_blocks}/{self.prompt_blocks}"
        if self.overridden is not None:
            text += (
                f"; refused={self.overridden} "
                f"(load {self.overridden_load} vs {self.least_load})"
            )
        return text

    def as_dict(self) -> dict[str, object]:
        """Return the JSON shape (the decision record's "prefix")."""
        return {
            "signal": str(self.signal),
            "matched_blocks": self.matched_blocks,
            "prompt_blocks": self.prompt_blocks,
            "reuse": round(self.reuse, 3),
            "session": self.session,
            "overridden": self.overridden,
            "overridden_load": self.overridden_load,
            "least_load": self.least_load,
        }


def prompt_text(body: Mapping[str, object]) -> str:
    """The prompt of a canonical (OpenAI-shaped) body, as one string.

    Tools first (chat templates put them in the system turn), then each
    message's role and text in order (an image part counts as its URL), or a
    completion's ``prompt`` / an embeddings or Responses ``input``.
    """
    parts: list[str] = []
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        parts.append(json.dumps(tools, sort_keys=True, separators=(",", ":")))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                parts.append(_message_text(message))
    else:
        for key in ("prompt", "input"):
            value = body.get(key)
            if isinstance(value, str):
                parts.append(value)
            elif isinstance(value, list):
                parts.append(json.dumps(value, separators=(",", ":")))
    return _RECORD.join(parts)


def chain_keys(text: str, block_chars: int) -> tuple[tuple[int, ...], int]:
    """Return the keys of `text`'s blocks (at most MAX_KEYED_BLOCKS) and its
    number of blocks.

    The last block may be partial: it matches only the same prompt again,
    but it takes room in a server's cache like any other.
    """
    blocks = -(-len(text) // block_chars)
    keys: list[int] = []
    previous = 0
    for start in range(0, min(blocks, MAX_KEYED_BLOCKS) * block_chars, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        keys.append(previous)
    return tuple(keys), blocks


def choose_backend(
    order: Sequence[int],
    names: Sequence[str],
    loads: Sequence[int],
    priorities: Sequence[int],
    model: str,
    request: PrefixRequest,
    policy: PrefixPolicy,
    *,
    placing: bool = True,
) -> tuple[int, PrefixChoice]:
    """Return the candidate to serve the request, and why.

    ``order`` is every candidate's index in the strategy's order (its choice
    first); ``names``, ``loads`` and ``priorities`` are parallel to the
    candidates. With ``placing`` (the load-aware strategies), a prompt no
    backend holds goes to the backend its anchor hashes to among those of the
    chosen one's priority that are no busier than it.
    """
    chosen = order[0]
    least = min(loads)
    allowance = policy.allowance(least)
    view = request.view
    total = request.prompt_blocks
    matched = view.matched_blocks(model, request.keys) if request.keys else {}
    counts = [matched.get(name, 0) for name in names]
    refused: int | None = None
    if request.session is not None:
        home = view.session_backend(model, request.session)
        if home is not None and home in names:
            at = names.index(home)
            if loads[at] - least <= allowance:
                return at, PrefixChoice(Signal.SESSION, counts[at], total, session=True)
            refused = at
    best = max(counts) if counts else 0
    if best and refused is None:
        top = [i for i in order if counts[i] == best]
        if all(loads[i] - least > allowance for i in top):
            refused = top[0]
    allowed = [i for i in order if counts[i] and loads[i] - least <= allowance]
    if allowed:
        most = max(counts[i] for i in allowed)
        pick = next(i for i in allowed if counts[i] == most)
        signal = Signal.PREFIX if refused is None else Signal.LOAD_GUARD
        return pick, _choice(signal, counts[pick], total, refused, names, loads, least)
    # Nothing to follow, or the guard refused it: the strategy's first choice
    # within the guard, or the backend as loaded or less that the prompt's
    # anchor picks (every process alike: one home per prompt, not one each).
    pick = chosen
    if refused is not None:
        pick = next(i for i in order if loads[i] - least <= allowance)
    if placing:
        pick = _anchored(order, pick, names, loads, priorities, request.anchor)
    signal = Signal.STRATEGY if refused is None else Signal.LOAD_GUARD
    return pick, _choice(signal, counts[pick], total, refused, names, loads, least)


def _anchored(
    order: Sequence[int],
    pick: int,
    names: Sequence[str],
    loads: Sequence[int],
    priorities: Sequence[int],
    anchor: int,
) -> int:
    """Among the candidates of `pick`'s priority and at most its load, the one
    the prompt's anchor hashes highest with (rendezvous hashing): every
    serving process places a new prompt alike, and prompts spread evenly."""
    peers = [
        i
        for i in order
        if priorities[i] == priorities[pick] and loads[i] <= loads[pick]
    ]
    if len(peers) < 2:
        return pick
    return max(peers, key=lambda i: _rendezvous(anchor, names[i]))


def _rendezvous(anchor: int, name: str) -> bytes:
    return hashlib.blake2b(f"{anchor}:{name}".encode(), digest_size=8).digest()


def _choice(
    signal: Signal,
    matched: int,
    total: int,
    refused: int | None,
    names: Sequence[str],
    loads: Sequence[int],
    least: int,
) -> PrefixChoice:
    if refused is None:
        return PrefixChoice(signal, matched, total)
    return PrefixChoice(
        signal,
        matched,
        total,
        overridden=names[refused],
        overridden_load=loads[refused],
        least_load=least,
    )


def _message_text(message: Mapping[object, object]) -> str:
    role = message.get("role")
    content = message.get("content")
    pieces = [role if isinstance(role, str) else ""]
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    pieces.append(text)
                else:
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, Mapping) else image
                    if isinstance(url, str):
                        pieces.append(url)
            elif isinstance(part, str):
                pieces.append(part)
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        pieces.append(json.dumps(calls, sort_keys=True, separators=(",", ":")))
    return _FIELD.join(pieces)
