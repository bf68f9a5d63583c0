"""Fuzzing the whole management API against its own OpenAPI schema.

Schemathesis generates requests for every operation (its coverage phase's
boundary and wrong-type values, then a few generated ones) and calls the WSGI
application in this process: none may answer 500 or leak a backend's secret.
The walk is split over three test files (backends, the routing policy, and
everything else) so that pytest-xdist runs the parts on several workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.db import connection
from hypothesis import HealthCheck, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error

from tests.factories import (
    AliasFactory,
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
    StaffUserFactory,
)

SECRET = "sk-upstream-secret-c0ffee"
BACKENDS = r"^/api/v1/(backends|backend-models)(/|$)"
# The routing policy: its admission and fleet settings make it the operation
# with the most generated cases, walked in a file of its own.
POLICY = r"^/api/v1/policy$"


@pytest.fixture
def fuzz_headers(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """An admin token, and data for the generated requests to find and change."""
    # Each request ends with Django closing a connection older than
    # CONN_MAX_AGE (0 in the tests): reopening one per call was a fifth of the
    # walk. The committed data (transactional_db) is the same either way.
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", None)
    connection.close()
    token = Token.objects.create(user=StaffUserFactory(username="fuzzer"))
    # Loopback, a port nothing listens on: nothing generated reaches a network.
    backend = BackendFactory(
        name="fuzz-gpu", api_key=SECRET, base_url="http://127.0.0.1:9"
    )
    BackendModelFactory(backend=backend, name="llama3:8b")
    AliasFactory(name="gpt-4", target="llama3:8b")
    ChainStepFactory(chain=FallbackChainFactory(model="gpt-4"), model="mistral:7b")
    yield {"Authorization": f"Token {token.key}"}
    connection.close()


@pytest.fixture
def api_schema(fuzz_headers: dict[str, str]) -> Any:
    return schemathesis.openapi.from_wsgi(
        "/api/v1/schema/?format=json", get_wsgi_application(), headers=fuzz_headers
    )


# Undrain probes the backend at once, and generated backends may have any URL:
# it is tested against a mock backend instead (tests/backends/test_api.py).
fuzzed = schemathesis.pytest.from_fixture("api_schema").exclude(path_regex=r"/undrain$")

walk_settings = settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


def call_and_check(case: Any, headers: dict[str, str]) -> None:
    response = case.call(headers=headers)

    case.validate_response(response, checks=[not_a_server_error])
    assert SECRET not in response.text
