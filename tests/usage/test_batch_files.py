"""Batch input checks and the result files a resumed runner reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from usage import batch_credential
from usage.batches import results, storage
from usage.batches.validation import (
    check_anthropic_requests,
    check_openai_input,
    split_lines,
)

pytestmark = pytest.mark.mode_independent


def line(
    custom_id: str = "a", url: str = "/v1/chat/completions", **extra: Any
) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    entry = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(entry | extra).encode()


def test_a_good_file_gives_its_lines_and_endpoint() -> None:
    checked = check_openai_input([line("a"), b"", line("b")], max_lines=10)
    assert not checked.problems
    assert checked.lines == 2 and checked.endpoint == "/v1/chat/completions"


def test_each_problem_names_its_line() -> None:
    lines = [
        line("a"),
        b"[1, 2]",
        line("a"),
        line("c", method="GET"),
        line("d", url="/v1/images"),
        line("e", body={"messages": []}),
        line("", url="/v1/embeddings"),
    ]
    checked = check_openai_input(lines, max_lines=100)
    found = {(p.line, p.code) for p in checked.problems}
    assert found == {
        (2, "invalid_request"),
        (3, "duplicate_custom_id"),
        (4, "invalid_method"),
        (5, "invalid_url"),
        (6, "missing_model"),
        (7, "missing_custom_id"),
        (7, "mismatched_endpoint"),
    }
    assert checked.summary(shown=1).startswith("Line 2: expected a JSON object")


def test_too_many_lines_and_an_empty_file_are_refused() -> None:
    assert check_openai_input([line(str(i)) for i in range(3)], 2).problems[0].code == (
        "too_many_lines"
    )
    assert check_openai_input([b"", b"  "], 2).problems[0].code == "empty_file"


def test_anthropic_requests_are_checked_by_index() -> None:
    requests = [
        {"custom_id": "ok", "params": {"model": "m", "max_tokens": 5, "messages": []}},
        {"custom_id": "ok", "params": {"model": "m", "max_tokens": 5, "messages": []}},
        {
            "custom_id": "has space",
            "params": {"model": "m", "messages": [], "stream": True},
        },
    ]
    checked = check_anthropic_requests(requests, max_lines=10)
    assert [(p.line, p.code) for p in checked.problems] == [
        (1, "duplicate_custom_id"),
        (2, "invalid_custom_id"),
        (2, "invalid_request"),
        (2, "invalid_request"),
    ]
    assert check_anthropic_requests([], 10).problems


def test_split_lines_joins_lines_across_chunks() -> None:
    chunks = [b'{"a"', b":1}\n{", b'"b":2}\n', b"tail"]
    assert list(split_lines(chunks)) == [b'{"a":1}', b'{"b":2}', b"tail"]


def test_a_half_written_last_line_is_cut_and_the_rest_counted(
    settings: Any, tmp_path: Path
) -> None:
    settings.NEXUS_BATCH_DIR = tmp_path
    output, errors = storage.result_paths("batch_x")
    out = storage.absolute(output)
    out.parent.mkdir(parents=True)
    done = {
        "custom_id": "a",
        "response": {
            "status_code": 200,
            "body": {"usage": {"prompt_tokens": 3, "completion_tokens": 4}},
        },
    }
    out.write_bytes(json.dumps(done).encode() + b'\n{"custom_id": "b", "respo')
    storage.absolute(errors).write_bytes(
        json.dumps({"custom_id": "c", "error": {"code": "batch_cancelled"}}).encode()
        + b"\n"
    )
    progress = results.read_progress("batch_x")
    assert progress.done == {"a", "c"}
    assert (progress.succeeded, progress.cancelled, progress.errored) == (1, 1, 0)
    assert (progress.prompt_tokens, progress.completion_tokens) == (3, 4)
    assert out.read_bytes().endswith(b"}\n")  # the torn line "b" is gone
    rendered = [json.loads(r) for r in results.anthropic_results("batch_x")]
    assert [r["result"]["type"] for r in rendered] == ["succeeded", "canceled"]


def test_the_batch_credential_is_signed() -> None:
    secret = batch_credential.derive_secret("a secret")
    value = batch_credential.sign(secret, "nx-abcdefgh", "batch_1", 2000)
    assert batch_credential.verify(secret, value.encode(), now=1000) == (
        "nx-abcdefgh",
        "batch_1",
    )
    assert batch_credential.verify(secret, value.encode(), now=2001) is None
    anonymous = batch_credential.sign(secret, "", "batch_1", 2000).encode()
    assert batch_credential.verify(secret, anonymous, now=1000) == ("", "batch_1")
    later = value.replace(".2000.", ".9999.").encode()
    assert batch_credential.verify(secret, later, now=1000) is None
    forged = value.replace("nx-abcdefgh", "nx-zzzzzzzz").encode()
    assert batch_credential.verify(secret, forged, now=1000) is None
    other = batch_credential.derive_secret("another secret")
    assert batch_credential.verify(other, value.encode(), now=1000) is None
    assert batch_credential.verify(secret, b"\xff" * 10) is None
