"""A batch's results: the output and error files the runner appends to.

Each finished line is one JSON line in OpenAI's batch output shape, in the
output file when its request succeeded (``response.status_code`` 2xx) and in
the error file otherwise (an HTTP error with its ``response``, or a line that
never ran: ``error.code`` ``batch_cancelled``, ``batch_expired`` or
``budget_exceeded``). These files are the only record of what finished, so a
runner resuming a batch reads them back (``read_progress``), after cutting a
last line a killed runner left half-written: each ``custom_id`` thus appears
exactly once in output and errors together. Anthropic's results stream is
rendered from the same files (``anthropic_results``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from usage.batches import storage
from usage.batches.validation import split_lines

CANCELLED = "batch_cancelled"
EXPIRED = "batch_expired"
BUDGET_EXCEEDED = "budget_exceeded"
NOT_RUN = (CANCELLED, EXPIRED)


@dataclass
class Progress:
    """What the result files hold: lines by outcome, and their tokens."""

    done: set[str] = field(default_factory=set)
    succeeded: int = 0
    errored: int = 0
    cancelled: int = 0
    expired: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def count(self, entry: dict[str, Any], succeeded: bool) -> None:
        """Count one result line (already known not to repeat a custom_id)."""
        self.done.add(entry["custom_id"])
        if succeeded:
            self.succeeded += 1
            body = (entry.get("response") or {}).get("body")
            self._count_tokens(body)
            return
        code = (entry.get("error") or {}).get("code")
        if code == CANCELLED:
            self.cancelled += 1
        elif code == EXPIRED:
            self.expired += 1
        else:
            self.errored += 1

    def _count_tokens(self, body: Any) -> None:
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        for name, value in (
            ("prompt_tokens", prompt),
            ("completion_tokens", completion),
        ):
            if isinstance(value, int) and value > 0:
                setattr(self, name, getattr(self, name) + value)


def read_progress(batch_id: str) -> Progress:
    """Read both result files back, cutting a half-written last line."""
    progress = Progress()
    output, errors = storage.result_paths(batch_id)
    for path, succeeded in ((output, True), (errors, False)):
        _cut_partial_line(path)
        for entry in _entries(path):
            custom_id = entry.get("custom_id")
            if isinstance(custom_id, str) and custom_id not in progress.done:
                progress.count(entry, succeeded)
    return progress


def _cut_partial_line(path: str) -> None:
    """Truncate the file after its last complete line (a killed writer's tail)."""
    target = storage.absolute(path)
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return
    if not size:
        return
    with target.open("rb+") as handle:
        handle.seek(max(0, size - 1))
        if handle.read(1) == b"\n":
            return
        keep = 0
        step = 64 * 1024
        position = size
        while position > 0:
            start = max(0, position - step)
            handle.seek(start)
            block = handle.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())


def _entries(path: str) -> Iterator[dict[str, Any]]:
    for raw in split_lines(storage.read_chunks(path)):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            yield entry


def anthropic_results(batch_id: str) -> Iterator[bytes]:
    """The Message Batch's results as Anthropic's JSONL (one line each)."""
    output, errors = storage.result_paths(batch_id)
    for entry in _entries(output):
        body = (entry.get("response") or {}).get("body")
        result = {"type": "succeeded", "message": body}
        yield _line(entry["custom_id"], result)
    for entry in _entries(errors):
        yield _line(entry["custom_id"], _anthropic_failure(entry))


def _anthropic_failure(entry: dict[str, Any]) -> dict[str, Any]:
    error = entry.get("error") or {}
    code = error.get("code")
    if code == CANCELLED:
        return {"type": "canceled"}
    if code == EXPIRED:
        return {"type": "expired"}
    response = entry.get("response") or {}
    body = response.get("body")
    if isinstance(body, dict) and body.get("type") == "error":
        return {"type": "errored", "error": body}
    message = (
        error.get("message") or f"The request failed ({response.get('status_code')})."
    )
    kind = "invalid_request_error" if code == BUDGET_EXCEEDED else "api_error"
    return {
        "type": "errored",
        "error": {"type": "error", "error": {"type": kind, "message": message}},
    }


def _line(custom_id: str, result: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "result": result}).encode() + b"\n"
