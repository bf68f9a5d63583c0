"""The protocol surfaces in the benchmark: what translation and pass-through cost.

On the first single-process Nexus target, beside the plain OpenAI path
(``/v1/chat/completions`` to the OpenAI mock), two more paths are measured
with the same load:

- ``translated``: an Anthropic client (``POST /v1/messages``) served by the
  OpenAI mock: the request is made canonical and written back as chat
  completions, the answer and every streamed chunk translated to Anthropic's;
- ``pass-through``: the same Anthropic request to a mock of kind
  ``anthropic``: the body is relayed, only usage is read on the way;
- ``responses``: an OpenAI Responses client (``POST /v1/responses``) served by
  the OpenAI mock, translated both ways like ``translated``;
- ``ollama``: an Ollama client (``POST /api/chat``) served by the OpenAI mock,
  translated both ways (NDJSON streams).

Each is reported as a ratio to the plain path on the same target:
throughput of non-stream requests at c=16 and of streams at c=8, and the
CPU time per request and per streamed chunk that the path adds.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from backends.models import Backend, BackendModel, HealthStatus
from tests.bench.clients import Endpoint
from tests.bench.goals import ratio
from tests.bench.plan import Plan

ANTHROPIC_BACKEND = "nexus-bench-claude"
ANTHROPIC_MODEL = "nexus-bench-claude"
PATHS = ("translated", "pass-through", "responses", "ollama")
PLAN = Plan(chat=(16,), probe=False, paced_stream=False, streams=(8,))
MESSAGE_REPLY = b'"content"'
MESSAGE_END = b"message_stop"
TRANSLATED_GOAL = 0.9  # issue 14: translated non-stream within 10 % of plain


@contextlib.contextmanager
def install_anthropic_rows(mock_url: str) -> Iterator[None]:
    """Register the Anthropic-kind mock as a healthy backend; remove it after."""
    with transaction.atomic():
        Backend.objects.filter(name=ANTHROPIC_BACKEND).delete()
        backend = Backend.objects.create(
            name=ANTHROPIC_BACKEND,
            base_url=mock_url,
            kind="anthropic",
            priority=0,
            status=HealthStatus.HEALTHY,
        )
        BackendModel.objects.create(
            backend=backend, name=ANTHROPIC_MODEL, context_length=8192
        )
    try:
        yield
    finally:
        Backend.objects.filter(name=ANTHROPIC_BACKEND).delete()


def messages_endpoints(
    base_url: str, key: str, chat_body: dict[str, Any], model: str
) -> tuple[Endpoint, Endpoint]:
    """The Messages request equivalent to the plain chat request, for ``model``."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    system = chat_body["messages"][0]["content"]
    body = {
        "model": model,
        "max_tokens": chat_body["max_tokens"],
        "temperature": chat_body["temperature"],
        "system": system,
        "messages": chat_body["messages"][1:],
    }
    headers = (("x-api-key", key), ("anthropic-version", "2023-06-01"))
    plain = json.dumps(body, separators=(",", ":")).encode()
    stream = json.dumps({**body, "stream": True}, separators=(",", ":")).encode()
    return (
        Endpoint(host, int(port), "/v1/messages", plain, headers),
        Endpoint(host, int(port), "/v1/messages", stream, headers),
    )


def responses_endpoints(
    base_url: str, key: str, chat_body: dict[str, Any], model: str
) -> tuple[Endpoint, Endpoint]:
    """The Responses request equivalent to the plain chat request."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    body = {
        "model": model,
        "instructions": chat_body["messages"][0]["content"],
        "input": chat_body["messages"][1:],
        "max_output_tokens": chat_body["max_tokens"],
        "temperature": chat_body["temperature"],
    }
    headers = (("authorization", f"Bearer {key}"),)
    plain = json.dumps(body, separators=(",", ":")).encode()
    stream = json.dumps({**body, "stream": True}, separators=(",", ":")).encode()
    return (
        Endpoint(host, int(port), "/v1/responses", plain, headers),
        Endpoint(host, int(port), "/v1/responses", stream, headers),
    )


def ollama_endpoints(
    base_url: str, key: str, chat_body: dict[str, Any], model: str
) -> tuple[Endpoint, Endpoint]:
    """The Ollama /api/chat request equivalent to the plain chat request."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    body = {
        "model": model,
        "messages": chat_body["messages"],
        "options": {
            "num_predict": chat_body["max_tokens"],
            "temperature": chat_body["temperature"],
        },
    }
    headers = (("authorization", f"Bearer {key}"),)
    plain = json.dumps({**body, "stream": False}, separators=(",", ":")).encode()
    stream = json.dumps({**body, "stream": True}, separators=(",", ":")).encode()
    return (
        Endpoint(host, int(port), "/api/chat", plain, headers),
        Endpoint(host, int(port), "/api/chat", stream, headers),
    )


@dataclass(frozen=True)
class SurfacePath:
    """One measured surface path: its requests and how a good answer looks."""

    name: str
    endpoints: Callable[[str, str, dict[str, Any], str], tuple[Endpoint, Endpoint]]
    anthropic_backend: bool  # served by the Anthropic-kind mock
    chat_marker: bytes
    stream_marker: bytes


SURFACE_PATHS = (
    SurfacePath("translated", messages_endpoints, False, MESSAGE_REPLY, MESSAGE_END),
    SurfacePath("pass-through", messages_endpoints, True, MESSAGE_REPLY, MESSAGE_END),
    SurfacePath(
        "responses",
        responses_endpoints,
        False,
        b'"output_text"',
        b"response.completed",
    ),
    SurfacePath("ollama", ollama_endpoints, False, b'"done":true', b'"done":true'),
)


def compare_surfaces(plain: dict[str, Any], chunks: int) -> dict[str, Any]:
    """Ratios of each surface path to the plain path of the same target."""
    out: dict[str, Any] = {}
    base_chat = plain["chat"].get("16")
    base_stream = plain["stream"].get("8")
    for name, data in plain.get("surfaces", {}).items():
        chat, stream = data["chat"]["16"], data["stream"]["8"]
        added_request = _minus(_server_ms(chat), _server_ms(base_chat))
        added_stream = _minus(_server_ms(stream), _server_ms(base_stream))
        out[name] = {
            "chat_ratio": ratio(chat["requests_per_s"], base_chat["requests_per_s"]),
            "stream_ratio": ratio(
                stream["streams_per_s"], base_stream["streams_per_s"]
            ),
            "added_cpu_ms_per_request": added_request,
            "added_cpu_ms_per_chunk": None
            if added_stream is None or added_request is None
            else round((added_stream - added_request) / chunks, 4),
        }
    return out


def surface_lines(report: dict[str, Any]) -> list[str]:
    """The printed table of the surface paths, with the goal's verdict."""
    lines: list[str] = []
    for target, data in report["servers"].items():
        compared = data.get("surface_comparison")
        if not compared:
            continue
        base = data
        lines += [
            "",
            f"Protocol surfaces on {target} (ratio to plain /v1/chat/completions)",
        ]
        rows = [
            ["path", "req/s c=16", "ratio", "streams/s c=8", "ratio"]
            + ["+CPU ms/req", "+CPU ms/chunk"]
        ]
        rows.append(
            [
                "plain chat completions",
                f"{base['chat']['16']['requests_per_s']:,.0f}",
                "1.00",
                f"{base['stream']['8']['streams_per_s']:,.0f}",
                "1.00",
                "-",
                "-",
            ]
        )
        for name, cells in compared.items():
            measured = data["surfaces"][name]
            rows.append(
                [
                    _describe(name),
                    f"{measured['chat']['16']['requests_per_s']:,.0f}",
                    _fmt(cells["chat_ratio"]),
                    f"{measured['stream']['8']['streams_per_s']:,.0f}",
                    _fmt(cells["stream_ratio"]),
                    _fmt(cells["added_cpu_ms_per_request"], "{:+.3f}"),
                    _fmt(cells["added_cpu_ms_per_chunk"], "{:+.4f}"),
                ]
            )
        width = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [str(cell).ljust(width[i]) for i, cell in enumerate(row)]
            lines.append("  " + "  ".join(cells).rstrip())
        translated = compared.get("translated", {}).get("chat_ratio")
        verdict = (
            "-"
            if translated is None
            else "PASS"
            if translated >= TRANSLATED_GOAL
            else "MISS"
        )
        lines.append(
            f"  goal (issue 14): translated non-stream >= {TRANSLATED_GOAL:.2f}x "
            f"plain: {verdict}"
        )
    return lines


def _describe(name: str) -> str:
    return {
        "translated": "translated (Anthropic client, OpenAI backend)",
        "pass-through": "pass-through (Anthropic client and backend)",
        "responses": "translated (Responses client, OpenAI backend)",
        "ollama": "translated (Ollama client, OpenAI backend)",
    }[name]


def _fmt(value: float | None, form: str = "{:.2f}") -> str:
    return "-" if value is None else form.format(value)


def _server_ms(cell: dict[str, Any]) -> float | None:
    """The Nexus server's CPU ms per request (or stream) of one measurement."""
    value = cell["cpu_ms_per_request"].get("server")
    return value if isinstance(value, int | float) else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)
