"""Anthropic clients: a Messages request to canonical, canonical answers back.

``messages_to_canonical`` checks a ``POST /v1/messages`` body and writes it as
an OpenAI chat request; ``canonical_to_message`` writes a ``chat.completion``
as a Message (``MessageStreamWriter``, in ``streams``, does the same for a
stream); ``estimate_input_tokens`` answers ``count_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocols.anthropic.wire import (
    FINISH_TO_STOP,
    image_url_from_source,
    usage_from_canonical,
)
from gateway.protocols.base import TranslationError

UNSUPPORTED = "unsupported_content"
# Blocks that carry nothing a chat model needs to see again.
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# Sampling fields with the same name and meaning on both sides.
_SAME_FIELDS = ("temperature", "top_p", "stream")
# A guess for an image of unknown size (Anthropic: about width*height/750).
IMAGE_TOKENS = 1600


def messages_to_canonical(
    body: dict[str, Any], *, skip_unsupported: bool = False
) -> dict[str, Any]:
    """Check a Messages request and return it as an OpenAI chat request.

    Raises TranslationError (400) for a malformed body, naming the field.
    Valid content that chat completions cannot carry (documents, server tools,
    ...) raises TranslationError with code ``unsupported_content``, unless
    ``skip_unsupported``: then it is left out (for routing a request that will
    be passed through to an Anthropic backend untranslated).
    """
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("model: a model name (string) is required.", "model")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad("max_tokens: Field required (a positive integer).", "max_tokens")
    if max_tokens < 1:
        raise _bad("max_tokens: must be at least 1.", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: a non-empty array of messages is required.", "messages")
    reader = _Reader(skip_unsupported)
    out: list[dict[str, Any]] = []
    system = reader.system(body.get("system"))
    if system is not None:
        out.append(system)
    for index, message in enumerate(messages):
        out += reader.message(message, f"messages.{index}")
    canonical: dict[str, Any] = {
        "model": model,
        "messages": out,
        "max_tokens": max_tokens,
    }
    for name in _SAME_FIELDS:
        value = body.get(name)
        if value is not None:
            canonical[name] = value
    if canonical.get("stream") not in (None, True, False):
        raise _bad("stream: must be a boolean.", "stream")
    if canonical.get("stream"):
        canonical["stream_options"] = {"include_usage": True}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop_sequences: must be an array of strings.", "stop_sequences")
        if stop:
            canonical["stop"] = stop
    tools = body.get("tools")
    if tools is not None:
        converted = reader.tools(tools)
        if converted:
            canonical["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        canonical.update(_tool_choice(choice))
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        canonical["user"] = metadata["user_id"]
    return canonical


class _Reader:
    __slots__ = ("skip_unsupported",)

    def __init__(self, skip_unsupported: bool) -> None:
        self.skip_unsupported = skip_unsupported

    def unsupported(self, what: str, where: str) -> None:
        if not self.skip_unsupported:
            raise TranslationError(
                400,
                f"{where}: {what} cannot be sent to this model: it is served by a "
                "backend that does not speak Anthropic's API, and chat completions "
                "have no equivalent.",
                param=where,
                code=UNSUPPORTED,
            )

    def system(self, system: Any) -> dict[str, Any] | None:
        if system is None or system == "":
            return None
        if isinstance(system, str):
            return {"role": "system", "content": system}
        if isinstance(system, list):
            parts = []
            for index, block in enumerate(system):
                where = f"system.{index}"
                if not isinstance(block, dict) or block.get("type") != "text":
                    raise _bad(f"{where}: system blocks must be text blocks.", where)
                parts.append({"type": "text", "text": _text(block, where)})
            return {"role": "system", "content": parts} if parts else None
        raise _bad("system: must be a string or an array of text blocks.", "system")

    def message(self, message: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(message, dict):
            raise _bad(f"{where}: each message must be an object.", where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be 'user' or 'assistant'.", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            return [{"role": role, "content": content}]
        if not isinstance(content, list):
            raise _bad(
                f"{where}.content: must be a string or an array of content blocks.",
                f"{where}.content",
            )
        if role == "assistant":
            return [self.assistant(content, where)]
        return self.user(content, where)

    def user(self, blocks: list[Any], where: str) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        for index, block in enumerate(blocks):
            at = f"{where}.content.{index}"
            kind = _block_type(block, at)
            if kind == "text":
                parts.append({"type": "text", "text": _text(block, at)})
            elif kind == "image":
                url = image_url_from_source(block.get("source"), at)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "tool_result":
                result, images = self.tool_result(block, at)
                results.append(result)
                parts += images
            elif kind not in _DROPPED_BLOCKS:
                self.unsupported(f"a '{kind}' block", at)
        out = results
        if parts:
            out.append({"role": "user", "content": parts})
        elif not results:
            out.append({"role": "user", "content": ""})
        return out

    def tool_result(
        self, block: dict[str, Any], where: str
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A tool message, and the images of the result (for a user message)."""
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"{where}.tool_use_id: a string is required.", where)
        content = block.get("content", "")
        images: list[dict[str, Any]] = []
        if isinstance(content, list):
            texts = []
            for index, part in enumerate(content):
                at = f"{where}.content.{index}"
                kind = _block_type(part, at)
                if kind == "text":
                    texts.append({"type": "text", "text": _text(part, at)})
                elif kind == "image":
                    url = image_url_from_source(part.get("source"), at)
                    images.append({"type": "image_url", "image_url": {"url": url}})
                else:
                    self.unsupported(f"a '{kind}' block in a tool result", at)
            content = texts
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(
                f"{where}.content: must be a string or an array of blocks.", where
            )
        return {"role": "tool", "tool_call_id": call_id, "content": content}, images

    def assistant(self, blocks: list[Any], where: str) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(blocks):
            at = f"{where}.content.{index}"
            kind = _block_type(block, at)
            if kind == "text":
                parts.append({"type": "text", "text": _text(block, at)})
            elif kind == "tool_use":
                call_id, name, arguments = block.get("id"), block.get("name"), None
                if not isinstance(call_id, str) or not isinstance(name, str):
                    raise _bad(f"{at}: tool_use needs a string 'id' and 'name'.", at)
                if not isinstance(block.get("input"), dict):
                    raise _bad(f"{at}.input: must be an object.", f"{at}.input")
                arguments = json.dumps(block["input"], ensure_ascii=False)
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            elif kind not in _DROPPED_BLOCKS:
                self.unsupported(f"a '{kind}' block", at)
        message: dict[str, Any] = {"role": "assistant", "content": parts or None}
        if calls:
            message["tool_calls"] = calls
        elif not parts:
            message["content"] = ""
        return message

    def tools(self, tools: Any) -> list[dict[str, Any]]:
        if not isinstance(tools, list):
            raise _bad("tools: must be an array of tool definitions.", "tools")
        out = []
        for index, tool in enumerate(tools):
            where = f"tools.{index}"
            if not isinstance(tool, dict):
                raise _bad(f"{where}: each tool must be an object.", where)
            if tool.get("type") not in (None, "custom"):
                self.unsupported(f"the server tool '{tool.get('type')}'", where)
                continue
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not name:
                raise _bad(f"{where}.name: a string is required.", f"{where}.name")
            if not isinstance(schema, dict):
                raise _bad(
                    f"{where}.input_schema: a JSON schema object is required.",
                    f"{where}.input_schema",
                )
            if "$schema" in schema:
                # JSON Schema's dialect tag (Claude Code sends one per tool):
                # not a parameter, and some OpenAI-style servers refuse it.
                schema = {k: v for k, v in schema.items() if k != "$schema"}
            function: dict[str, Any] = {"name": name, "parameters": schema}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if not isinstance(choice, dict):
        raise _bad("tool_choice: must be an object with a 'type'.", "tool_choice")
    kind = choice.get("type")
    out: dict[str, Any]
    if kind == "auto":
        out = {"tool_choice": "auto"}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "none":
        out = {"tool_choice": "none"}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out = {
            "tool_choice": {"type": "function", "function": {"name": choice["name"]}}
        }
    else:
        raise _bad(
            "tool_choice: type must be 'auto', 'any', 'none' or 'tool' (with a name).",
            "tool_choice",
        )
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{where}: a content block must be an object with a 'type'.", where)
    return str(block["type"])


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text: a string is required.", f"{where}.text")
    return text


def _bad(message: str, param: str) -> TranslationError:
    return TranslationError(400, message, param=param)


# Answers


def canonical_to_message(reply: dict[str, Any], model: str) -> dict[str, Any]:
    """Write a ``chat.completion`` as an Anthropic Message (the first choice)."""
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    message = message if isinstance(message, dict) else {}
    content: list[dict[str, Any]] = []
    text = _content_text(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{len(content)}",
                "name": function.get("name") or "",
                "input": parse_arguments(function.get("arguments")),
            }
        )
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    return {
        "id": message_id(reply.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": FINISH_TO_STOP.get(finish or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": usage_from_canonical(reply.get("usage")),
    }


def message_id(completion_id: Any) -> str:
    """A Message id made from a completion's id (``msg_`` and the same suffix)."""
    if isinstance(completion_id, str) and completion_id:
        return "msg_" + completion_id.removeprefix("chatcmpl-")
    return "msg_nexus"


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's JSON arguments as the object Anthropic's ``input`` is."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        # A model that wrote broken JSON: keep what it wrote, visibly.
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


# count_tokens


def estimate_input_tokens(canonical: dict[str, Any]) -> int:
    """Estimate a request's input tokens: characters / 4, plus a guess per image.

    Over the system prompt, every message's text and tool arguments, and the
    tool definitions. Not a tokenizer: models count differently.
    """
    chars = 0
    images = 0
    for message in canonical.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    images += 1
                elif isinstance(part.get("text"), str):
                    chars += len(part["text"])
        for call in message.get("tool_calls") or ():
            chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
    for tool in canonical.get("tools") or ():
        chars += len(json.dumps(tool["function"], ensure_ascii=False))
    return -(-chars // 4) + images * IMAGE_TOKENS
