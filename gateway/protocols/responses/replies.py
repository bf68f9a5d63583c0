"""Canonical chat completions replies -> Responses ``response`` objects.

``chat_to_response`` writes a ``chat.completion`` as a ``response`` (a
``message`` item with ``output_text``, one ``function_call`` item per tool
call, usage in input/output tokens). The builders of the ``response`` object
and its items are shared with the stream translator, whose snapshots and
items have the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
INCOMPLETE_REASONS = {
    "length": "max_output_tokens",
    "content_filter": "content_filter",
}


def chat_to_response(
    reply: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
) -> dict[str, Any]:
    """Translate a canonical ``chat.completion`` into a Responses ``response``.

    ``request`` is the client's Responses body (its settings are echoed back).
    """
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        message = {}
    output: list[dict[str, Any]] = []
    text = message.get("content")
    refusal = message.get("refusal")
    if isinstance(text, list):
        text = "".join(
            part.get("text", "")
            for part in text
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    parts: list[dict[str, Any]] = []
    if isinstance(text, str) and text:
        parts.append(output_text(text))
    if isinstance(refusal, str) and refusal:
        parts.append({"type": "refusal", "refusal": refusal})
    if parts:
        output.append(message_item(f"msg_{response_id}_0", parts, "completed"))
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if not isinstance(call, Mapping):
                continue
            function = call.get("function")
            if not isinstance(function, Mapping):
                continue
            call_id = call.get("id")
            output.append(
                function_call_item(
                    f"fc_{response_id}_{len(output)}",
                    call_id if isinstance(call_id, str) and call_id else None,
                    str(function.get("name") or ""),
                    _arguments_text(function.get("arguments")),
                    "completed",
                )
            )
    finish = choice.get("finish_reason") if isinstance(choice, Mapping) else None
    model = reply.get("model")
    outcome = Outcome(
        status="incomplete" if finish in INCOMPLETE_REASONS else "completed",
        output=output,
        usage=usage_of_chat(reply.get("usage")),
        incomplete_reason=INCOMPLETE_REASONS.get(finish)
        if isinstance(finish, str)
        else None,
    )
    model_name = model if isinstance(model, str) and model else None
    return response_object(request, response_id, created_at, model_name, outcome)


def usage_of_chat(usage: Any) -> dict[str, Any] | None:
    """Translate a canonical usage block into the Responses API's, or None."""
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    prompt_details = prompt_details if isinstance(prompt_details, Mapping) else {}
    cached = prompt_details.get("cached_tokens")
    written = prompt_details.get("cache_write_tokens")
    reasoning = (
        completion_details.get("reasoning_tokens")
        if isinstance(completion_details, Mapping)
        else None
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached if isinstance(cached, int) else 0,
            "cache_write_tokens": written if isinstance(written, int) else 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": reasoning if isinstance(reasoning, int) else 0
        },
        "total_tokens": total if isinstance(total, int) else prompt + completion,
    }


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a response stands: its status, output so far, usage, why it ended."""

    status: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    incomplete_reason: str | None = None
    error: dict[str, Any] | None = None


def response_object(
    request: Mapping[str, Any],
    response_id: str,
    created_at: int,
    model: str | None,
    outcome: Outcome,
) -> dict[str, Any]:
    """A ``response`` object echoing ``request``'s settings."""
    status, output, usage = outcome.status, outcome.output, outcome.usage
    incomplete_reason, error = outcome.incomplete_reason, outcome.error
    tools = request.get("tools")
    text = request.get("text")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason}
        if incomplete_reason
        else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model or request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": request.get("temperature"),
        "text": text if isinstance(text, Mapping) else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [_echo_tool(tool) for tool in tools if isinstance(tool, Mapping)]
        if isinstance(tools, list)
        else [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def _echo_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A function tool as a response lists it (every field present)."""
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def message_item(
    item_id: str, content: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    """An assistant ``message`` output item."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str | None, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A ``function_call`` output item (a call id made up if none)."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id or f"call_{item_id}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_text(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return ""
    # Some backends send the arguments as an object rather than JSON text.
    return _ENCODER.encode(arguments)
