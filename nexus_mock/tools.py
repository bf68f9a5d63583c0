"""Scripted tool calls: when the mock calls a tool, and with what arguments.

The rule, the same for every protocol the mock speaks: when a request offers
tools, does not forbid them (``tool_choice`` none), and its last turn is the
user's own words (not a tool's result), the mock calls one tool instead of
answering: the one ``tool_choice`` names, else the first offered. The
arguments are the ``tool_arguments`` knob when set, else made from the tool's
JSON schema: each property in ``properties`` gets the last user text (string),
the number of its words (integer, number), ``true`` (boolean), ``[]``
(array), ``{}`` (object) or ``null``. A request whose last turn is a tool
result gets the usual echo reply, of ``tool result: <the result's text>``.

Tokens of a tool call: the words of its JSON arguments (``str.split()``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_BY_TYPE: dict[str, Any] = {"boolean": True, "array": [], "object": {}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The call the mock makes: the tool's name, its arguments, their JSON."""

    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, separators=(",", ":"))

    @property
    def tokens(self) -> int:
        return max(1, len(self.arguments_json.split()))


def choose_tool_call(
    tools: list[tuple[str, Any]],
    named: str | None,
    forbidden: bool,
    user_text: str,
    scripted: dict[str, Any] | None,
) -> ToolCall | None:
    """The tool call for a request whose last turn is the user's, if any.

    ``tools`` are (name, JSON schema) pairs in the order offered; ``named`` is
    the tool ``tool_choice`` names; ``forbidden`` is ``tool_choice`` none.
    """
    if not tools or forbidden:
        return None
    name, schema = tools[0]
    for candidate, candidate_schema in tools:
        if candidate == named:
            name, schema = candidate, candidate_schema
    if scripted is not None:
        return ToolCall(name, dict(scripted))
    properties = schema.get("properties") if isinstance(schema, dict) else None
    arguments: dict[str, Any] = {}
    for key, spec in (properties or {}).items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "string":
            arguments[key] = user_text
        elif kind in ("integer", "number"):
            arguments[key] = len(user_text.split())
        else:
            arguments[key] = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    return ToolCall(name, arguments)


def openai_tool_call(
    payload: dict[str, Any], scripted: dict[str, Any] | None
) -> ToolCall | None:
    """The tool call for a chat completions request, if the rule makes one."""
    messages = payload.get("messages")
    tools = payload.get("tools")
    if not isinstance(tools, list) or not isinstance(messages, list):
        return None
    if not messages or not isinstance(messages[-1], dict):
        return None
    if messages[-1].get("role") != "user":
        return None
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    user_text = content if isinstance(content, str) else ""
    offered = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            offered.append((function["name"], function.get("parameters")))
    choice = payload.get("tool_choice")
    named = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
    return choose_tool_call(offered, named, choice == "none", user_text, scripted)


def render_openai_tool_call(
    call: ToolCall,
    model: str,
    completion_id: str,
    created: int,
    prompt_tokens: int,
    stream: bool,
    include_usage: bool,
    chunks: int,
) -> bytes | tuple[list[bytes], bytes]:
    """A chat completion (or a stream's blocks and tail) that calls the tool."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": call.tokens,
        "total_tokens": prompt_tokens + call.tokens,
    }
    call_id = f"call_{completion_id.rsplit('-', 1)[-1]}"
    head = {
        "id": completion_id,
        "created": created,
        "model": model,
        "system_fingerprint": "fp_mock",
    }
    if not stream:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json},
                }
            ],
        }
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
        reply = {**head, "object": "chat.completion", "choices": [choice]}
        return _encode({**reply, "usage": usage})
    size = len(call.arguments_json)
    pieces = [
        call.arguments_json[size * i // chunks : size * (i + 1) // chunks]
        for i in range(chunks)
    ]
    blocks = []
    for index, piece in enumerate(pieces):
        tool: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        delta: dict[str, Any] = {"tool_calls": [tool]}
        if index == 0:
            tool.update(id=call_id, type="function")
            tool["function"]["name"] = call.name
            delta["role"] = "assistant"
        last = index == chunks - 1
        choice = {
            "index": 0,
            "delta": delta,
            "finish_reason": "tool_calls" if last else None,
        }
        chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
        blocks.append(b"data: " + _encode(chunk) + b"\n\n")
    tail = b""
    if include_usage:
        chunk = {**head, "object": "chat.completion.chunk", "choices": []}
        tail = b"data: " + _encode({**chunk, "usage": usage}) + b"\n\n"
    return blocks, tail + b"data: [DONE]\n\n"


def _encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
