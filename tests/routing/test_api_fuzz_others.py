"""The API fuzz walk (tests/routing/api_fuzz.py): all but backends' and the policy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.routing.api_fuzz import (
    BACKENDS,
    POLICY,
    api_schema,
    call_and_check,
    fuzz_headers,
    fuzzed,
    walk_settings,
)

__all__ = ["api_schema", "fuzz_headers"]  # the fixtures, found by name


# With both modes running at once on xdist workers of a 2-core machine, a walk
# can outlast the default 120 s.
@pytest.mark.timeout(480)
@fuzzed.exclude(path_regex=BACKENDS).exclude(path_regex=POLICY).parametrize()
@walk_settings
def test_the_api_never_answers_500_to_generated_requests(
    case: Any, fuzz_headers: dict[str, str]
) -> None:
    call_and_check(case, fuzz_headers)
