"""What the response cache stores: a canonical answer, and how it is made.

An entry is one line of facts (the served model, the canonical endpoint,
when it was stored, the tokens it cost) and the answer in canonical form: an
OpenAI ``chat.completion`` (or embeddings list) as JSON, whichever surface
asked and whether it streamed. A whole answer is that JSON as the backend
(or the leg's translation) gave it; a streamed one is put together from its
canonical chunks by a ``ReplyCollector`` once the stream completed. A hit
is answered from it in the asking surface's shape, whole or as a stream
(``replay_chunks`` cuts it into chunks like a live one, usage last).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

_SEPARATOR = b"\n"
# A streamed hit's text goes out in pieces of about this many characters, cut
# after whitespace (a live stream sends about a token per event).
REPLAY_PIECE_CHARS = 16
_WORDS = re.compile(r"\S*\s*")


@dataclass(frozen=True, slots=True)
class Entry:
    """One cached answer (see the module docstring)."""

    model: str
    endpoint: str
    stored_at: float
    prompt_tokens: int
    completion_tokens: int
    reply: bytes  # the canonical answer's JSON
    expires_at: float = 0.0  # Unix time; 0: whenever the store says

    def encode(self) -> bytes:
        facts = orjson.dumps(
            {
                "model": self.model,
                "endpoint": self.endpoint,
                "stored_at": self.stored_at,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "expires_at": self.expires_at,
            }
        )
        return facts + _SEPARATOR + self.reply

    @classmethod
    def decode(cls, data: bytes) -> Entry | None:
        """The entry, or None for bytes that are not one (never raises)."""
        facts, found, reply = data.partition(_SEPARATOR)
        if not found:
            return None
        try:
            meta = orjson.loads(facts)
            return cls(
                model=str(meta["model"]),
                endpoint=str(meta["endpoint"]),
                stored_at=float(meta["stored_at"]),
                prompt_tokens=int(meta["prompt_tokens"]),
                completion_tokens=int(meta["completion_tokens"]),
                reply=reply,
                expires_at=float(meta.get("expires_at", 0.0)),
            )
        except (
            orjson.JSONDecodeError,
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
        ):
            return None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    def age(self, now: float | None = None) -> int:
        return max(int((now or time.time()) - self.stored_at), 0)


@dataclass(slots=True)
class Pending:
    """A cacheable request on its way to a backend: where its answer goes.

    The relay fills in the answer as it passes (``body``: an OpenAI
    backend's whole JSON; ``reply``: a leg's, made canonical; ``collector``:
    a stream's chunks); the pipeline keeps it once the request ended well.
    """

    key: str
    model: str
    endpoint: str
    ttl: float
    max_bytes: int
    body: bytes | None = None
    reply: dict[str, Any] | None = None
    collector: ReplyCollector | None = None
    # Set once any try's answer could not be read for the cache.
    unreadable: bool = False
    # What cuts a relayed SSE stream into events for the collector (the
    # proxy's: gateway.proxy.sse.EventSplitter).
    splitter: Any = field(default=None, repr=False)
    # Run by the relay once the answer is whole, before its last byte goes
    # out: keeps it (so the client's next request finds it).
    on_complete: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    def collect(self) -> ReplyCollector:
        """A fresh collector for this try's stream (a retry starts over)."""
        self.collector = ReplyCollector(self.max_bytes)
        self.splitter = None
        self.unreadable = False
        return self.collector


class ReplyCollector:
    """Puts a stream's canonical chunks together into the whole answer.

    Bounded: past ``max_bytes`` of text and arguments it stops collecting
    and the answer is not stored (``too_large``).
    """

    __slots__ = ("_choices", "_head", "max_bytes", "size", "too_large", "usage")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.too_large = False
        self.usage: dict[str, Any] | None = None
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        """Take one canonical chunk (``chat.completion.chunk``)."""
        if self.too_large:
            return
        if not self._head:
            self._head = {
                name: chunk[name]
                for name in ("id", "created", "model", "system_fingerprint")
                if chunk.get(name) is not None
            }
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for raw in chunk.get("choices") or ():
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            index = index if isinstance(index, int) else 0
            choice = self._choices.get(index)
            if choice is None:
                if len(self._choices) >= 128:
                    continue
                choice = self._choices[index] = _Choice()
            self.size += choice.add(raw)
        if self.size > self.max_bytes:
            self.too_large = True
            self._choices.clear()

    def reply(self) -> dict[str, Any] | None:
        """The whole answer, or None when the stream did not complete (a
        choice without its finish reason) or grew too large."""
        if self.too_large or not self._choices:
            return None
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            if choice.finish_reason is None:
                return None
            choices.append(choice.whole(index))
        reply = {
            "id": self._head.get("id", "chatcmpl-cached"),
            "object": "chat.completion",
            "created": self._head.get("created", int(time.time())),
            "model": self._head.get("model", ""),
            "choices": choices,
        }
        if "system_fingerprint" in self._head:
            reply["system_fingerprint"] = self._head["system_fingerprint"]
        if self.usage is not None:
            reply["usage"] = self.usage
        return reply


class _Choice:
    __slots__ = ("content", "finish_reason", "reasoning", "refusal", "role", "tools")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None

    def add(self, raw: dict[str, Any]) -> int:
        """Take one chunk's choice; return the bytes of text it added."""
        added = 0
        delta = raw.get("delta")
        if isinstance(delta, dict):
            role = delta.get("role")
            if isinstance(role, str):
                self.role = role
            for name, parts in (
                ("content", self.content),
                ("reasoning_content", self.reasoning),
                ("refusal", self.refusal),
            ):
                text = delta.get(name)
                if isinstance(text, str) and text:
                    parts.append(text)
                    added += len(text)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    added += self._add_call(call)
        finish = raw.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = finish
        return added

    def _add_call(self, call: dict[str, Any]) -> int:
        index = call.get("index", len(self.tools))
        index = index if isinstance(index, int) else len(self.tools)
        tool = self.tools.setdefault(
            index, {"id": "", "type": "function", "name": "", "arguments": []}
        )
        if isinstance(call.get("id"), str):
            tool["id"] = call["id"]
        function = call.get("function")
        if not isinstance(function, dict):
            return 0
        if isinstance(function.get("name"), str):
            tool["name"] += function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            tool["arguments"].append(arguments)
            return len(arguments)
        return 0

    def whole(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role,
            "content": "".join(self.content)
            if self.content or not self.tools
            else None,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tools:
            message["tool_calls"] = [
                {
                    "id": tool["id"],
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "arguments": "".join(tool["arguments"]),
                    },
                }
                for _, tool in sorted(self.tools.items())
            ]
        return {"index": index, "message": message, "finish_reason": self.finish_reason}


def replay_chunks(
    reply: dict[str, Any], usage: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """A cached answer as the canonical chunks of a live stream: the role,
    the text in pieces, the tool calls, the finish reason; the usage last."""
    head = {
        "id": reply.get("id", "chatcmpl-cached"),
        "object": "chat.completion.chunk",
        "created": reply.get("created", int(time.time())),
        "model": reply.get("model", ""),
    }

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None
    ) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        }

    for position, choice in enumerate(reply.get("choices") or ()):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", position)
        message = choice.get("message")
        message = message if isinstance(message, dict) else {}
        yield chunk(index, {"role": message.get("role") or "assistant", "content": ""})
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            for piece in _pieces(reasoning):
                yield chunk(index, {"reasoning_content": piece})
        content = message.get("content")
        if isinstance(content, str):
            for piece in _pieces(content):
                yield chunk(index, {"content": piece})
        for number, call in enumerate(message.get("tool_calls") or ()):
            if isinstance(call, dict):
                yield chunk(index, {"tool_calls": [{"index": number, **call}]})
        yield chunk(index, {}, choice.get("finish_reason") or "stop")
    yield {**head, "choices": [], "usage": usage}


def _pieces(text: str) -> Iterator[str]:
    piece = ""
    for word in _WORDS.findall(text):
        piece += word
        if len(piece) >= REPLAY_PIECE_CHARS:
            yield piece
            piece = ""
    if piece:
        yield piece
