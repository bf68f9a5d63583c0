"""Checking a batch's requests before anything runs, line by line.

An OpenAI batch input is JSONL: one ``{"custom_id", "method": "POST", "url",
"body"}`` object per line, every line for the same endpoint, each custom_id
once. An Anthropic Message Batch is a JSON list of ``{"custom_id", "params"}``.
Problems name their line (1-based) or request index, as the SDKs' errors do;
at most ``MAX_PROBLEMS`` are collected. Whether the key may use each line's
model is not checked here: that line gets the gateway's own 403 in the error
file, as the issue asks (the key's allow-list may change while it runs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# The endpoints a batch line may name, and the usage endpoint each records as.
OPENAI_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/responses",
)
ANTHROPIC_ENDPOINT = "/v1/messages"
MAX_PROBLEMS = 100
MAX_CUSTOM_ID = 512
_ANTHROPIC_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with one request."""

    line: int  # 1-based line (OpenAI) or 0-based index (Anthropic)
    code: str
    message: str


@dataclass
class Checked:
    """What checking a batch's requests found."""

    lines: int = 0
    endpoint: str = ""
    problems: list[Problem] = field(default_factory=list)
    custom_ids: set[str] = field(default_factory=set)

    def add(self, line: int, code: str, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(line, code, message))

    def summary(self, shown: int = 5, word: str = "Line") -> str:
        """The first problems as one message ("Line 3: ...; Line 9: ...")."""
        parts = [f"{word} {p.line}: {p.message}" for p in self.problems[:shown]]
        more = len(self.problems) - shown
        if more > 0:
            parts.append(f"and {more} more problem{'s' if more > 1 else ''}")
        return "; ".join(parts)


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a file given in chunks (without their line ends)."""
    rest = b""
    for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        yield from lines
    if rest:
        yield rest


def check_openai_input(lines: Iterable[bytes], max_lines: int) -> Checked:
    """Check an OpenAI batch input file, line by line (blank lines skipped)."""
    checked = Checked()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        checked.lines += 1
        if checked.lines > max_lines:
            checked.add(
                number,
                "too_many_lines",
                f"a batch may have at most {max_lines} requests",
            )
            break
        _check_openai_line(checked, number, raw)
    if not checked.lines and not checked.problems:
        checked.add(1, "empty_file", "the file has no requests")
    return checked


def _check_openai_line(checked: Checked, number: int, raw: bytes) -> None:
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        checked.add(number, "invalid_json", "not valid JSON")
        return
    if not isinstance(line, dict):
        checked.add(number, "invalid_request", "expected a JSON object")
        return
    _check_custom_id(checked, number, line.get("custom_id"), None)
    if line.get("method") != "POST":
        checked.add(number, "invalid_method", 'method must be "POST"')
    url = line.get("url")
    if url not in OPENAI_ENDPOINTS:
        shown = ", ".join(OPENAI_ENDPOINTS)
        checked.add(
            number, "invalid_url", f"url must be one of {shown}, got {url!r:.80}"
        )
    elif not checked.endpoint:
        checked.endpoint = url
    elif url != checked.endpoint:
        checked.add(
            number,
            "mismatched_endpoint",
            f"every request of a batch must be for the same endpoint: this one is "
            f"for {url}, the first for {checked.endpoint}",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        checked.add(number, "invalid_body", "body must be a JSON object")
    elif not isinstance(body.get("model"), str) or not body["model"]:
        checked.add(number, "missing_model", "body.model must name a model")


def check_anthropic_requests(requests: Any, max_lines: int) -> Checked:
    """Check a Message Batch's ``requests`` (problems by 0-based index)."""
    checked = Checked(endpoint=ANTHROPIC_ENDPOINT)
    if not isinstance(requests, list) or not requests:
        checked.add(0, "invalid_request", "requests must be a non-empty list")
        return checked
    if len(requests) > max_lines:
        checked.add(
            max_lines,
            "too_many_requests",
            f"a batch may have at most {max_lines} requests",
        )
        return checked
    for index, request in enumerate(requests):
        checked.lines += 1
        if not isinstance(request, dict):
            checked.add(index, "invalid_request", "expected an object")
            continue
        _check_custom_id(checked, index, request.get("custom_id"), _ANTHROPIC_ID)
        params = request.get("params")
        if not isinstance(params, dict):
            checked.add(index, "invalid_request", "params: Field required")
            continue
        if not isinstance(params.get("model"), str) or not params["model"]:
            checked.add(index, "invalid_request", "params.model: Field required")
        max_tokens = params.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            checked.add(index, "invalid_request", "params.max_tokens: Field required")
        if not isinstance(params.get("messages"), list):
            checked.add(index, "invalid_request", "params.messages: Field required")
        if params.get("stream") is True:
            checked.add(
                index, "invalid_request", "params.stream: not supported in a batch"
            )
    return checked


def _check_custom_id(
    checked: Checked, number: int, custom_id: Any, pattern: re.Pattern[str] | None
) -> None:
    if not isinstance(custom_id, str) or not custom_id:
        checked.add(number, "missing_custom_id", "custom_id must be a non-empty string")
    elif len(custom_id) > MAX_CUSTOM_ID or (
        pattern is not None and not pattern.fullmatch(custom_id)
    ):
        rule = (
            f"at most {MAX_CUSTOM_ID} characters"
            if pattern is None
            else "1 to 64 letters, digits, '_' or '-'"
        )
        checked.add(number, "invalid_custom_id", f"custom_id must be {rule}")
    elif custom_id in checked.custom_ids:
        checked.add(
            number, "duplicate_custom_id", f"custom_id {custom_id!r:.80} is used twice"
        )
    else:
        checked.custom_ids.add(custom_id)
