"""The routing pipeline: filters, aliases, fallbacks and errors.

Each acceptance scenario of the router spec (AC-01..AC-16) and each row of its
edge-case tables has a test here or in test_strategies.py (scoring and
strategies), test_requirements.py, test_core_policy.py and
test_core_decision.py (the decision record, AC-15, AC-16).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core import (
    CapabilityMismatch,
    CircularAlias,
    FallbackChainExhausted,
    InvalidModel,
    LiveStats,
    ModelNotFound,
    NoHealthyBackend,
    Reason,
    RequestRequirements,
    Router,
    RouterSnapshot,
    RoutingError,
)
from tests.routing.core_builders import backend, model, select, snapshot

pytestmark = pytest.mark.mode_independent


def fail(snap: RouterSnapshot, model_name: str, **needs: Any) -> RoutingError:
    with pytest.raises(RoutingError) as caught:
        select(snap, model_name, **needs)
    return caught.value


# AC-01: exact model match


def test_routes_to_the_backend_that_serves_the_requested_model() -> None:
    """AC-01: A has llama3:8b, B has mistral:7b; llama3:8b goes to A."""
    snap = snapshot(backend("a", "llama3:8b"), backend("b", "mistral:7b"))
    route = select(snap, "llama3:8b")
    assert route.target.backend.name == "a"
    assert route.target.model.name == "llama3:8b"
    assert route.decision.via == "direct"
    assert route.decision.resolved_model == "llama3:8b"


def test_unknown_model_is_a_404_model_not_found() -> None:
    """AC-01: no backend has gpt-5."""
    error = fail(snapshot(backend("a", "llama3:8b")), "gpt-5")
    assert isinstance(error, ModelNotFound)
    assert error.status == 404
    assert error.to_openai() == {
        "error": {
            "message": "Model 'gpt-5' not found",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_no_backends_registered_is_model_not_found() -> None:
    error = fail(snapshot(), "llama3:8b")
    assert isinstance(error, ModelNotFound)
    assert error.message == "Model 'llama3:8b' not found"


def test_model_names_are_matched_exactly() -> None:
    snap = snapshot(backend("a", "llama3:8b"))
    assert isinstance(fail(snap, "llama3"), ModelNotFound)
    assert isinstance(fail(snap, "LLAMA3:8B"), ModelNotFound)


# AC-02: health filter


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"status": "unhealthy"}, Reason.UNHEALTHY),
        ({"status": "draining"}, Reason.DRAINING),
        ({"status": "unknown"}, Reason.HEALTH_UNKNOWN),
        ({"status": "healthy", "enabled": False}, Reason.BACKEND_DISABLED),
    ],
)
def test_only_healthy_enabled_backends_are_candidates(
    fields: dict[str, Any], reason: Reason
) -> None:
    """AC-02: the better-scoring backend is skipped when it is not healthy."""
    snap = snapshot(
        backend("preferred", "llama3:8b", priority=0, **fields),
        backend("fallback", "llama3:8b", priority=50),
    )
    route = select(snap, "llama3:8b")
    assert route.target.backend.name == "fallback"
    [excluded] = route.decision.excluded
    assert excluded.target.backend.name == "preferred"
    assert excluded.reasons == (reason,)


def test_a_disabled_model_on_a_healthy_backend_is_not_a_candidate() -> None:
    snap = snapshot(
        backend("a", model("llama3:8b", enabled=False), priority=0),
        backend("b", "llama3:8b", priority=9),
    )
    route = select(snap, "llama3:8b")
    assert route.target.backend.name == "b"
    assert route.decision.excluded[0].reasons == (Reason.MODEL_DISABLED,)


def test_all_backends_unhealthy_is_503_no_healthy_backend() -> None:
    snap = snapshot(
        backend("a", "llama3:8b", status="unhealthy"),
        backend("b", "llama3:8b", status="unhealthy"),
        backend("c", "llama3:8b", status="draining"),
    )
    error = fail(snap, "llama3:8b")
    assert isinstance(error, NoHealthyBackend)
    assert error.status == 503
    assert error.to_openai()["error"]["type"] == "service_unavailable_error"
    assert error.message == (
        "No healthy backend available for model 'llama3:8b' (2 unhealthy, 1 draining)"
    )


def test_unknown_health_is_not_routed_to_until_checked() -> None:
    snap = snapshot(backend("new", "llama3:8b", status="unknown"))
    error = fail(snap, "llama3:8b")
    assert isinstance(error, NoHealthyBackend)
    assert "not yet health-checked" in error.message


def test_unrecognised_status_counts_as_unknown() -> None:
    assert backend("a", status="rebooting").status == "unknown"


# AC-03 / AC-04 / AC-05: capability filters


def test_vision_request_goes_to_the_backend_whose_model_supports_vision() -> None:
    """AC-03: A's copy of the model lacks vision, B's has it."""
    snap = snapshot(
        backend("a", "llava:13b", priority=0),
        backend("b", model("llava:13b", supports_vision=True), priority=50),
    )
    route = select(snap, "llava:13b", needs_vision=True)
    assert route.target.backend.name == "b"
    assert route.decision.excluded[0].reasons == (Reason.NO_VISION,)


def test_vision_request_for_llava_goes_to_the_llava_backend() -> None:
    """AC-03 as written: A has llama3 (no vision), B has llava (vision)."""
    snap = snapshot(
        backend("a", "llama3"), backend("b", model("llava", supports_vision=True))
    )
    body = {
        "model": "llava",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,"},
                    },
                ],
            }
        ],
    }
    requirements = RequestRequirements.from_request(body)
    route = Router().select(requirements, snap, LiveStats())
    assert route.target.backend.name == "b"


def test_tools_request_goes_to_the_backend_whose_model_supports_tools() -> None:
    """AC-04."""
    snap = snapshot(
        backend("a", "llama3", priority=0),
        backend("b", model("llama3", supports_tools=True), priority=50),
    )
    assert select(snap, "llama3", needs_tools=True).target.backend.name == "b"


def test_json_mode_request_goes_to_the_backend_that_supports_it() -> None:
    snap = snapshot(
        backend("a", "llama3", priority=0),
        backend("b", model("llama3", supports_json_mode=True), priority=50),
    )
    assert select(snap, "llama3", needs_json_mode=True).target.backend.name == "b"


def test_long_prompt_goes_to_the_backend_with_enough_context() -> None:
    """AC-05."""
    snap = snapshot(
        backend("short", model("llama3", context_length=4096), priority=0),
        backend("long", model("llama3", context_length=32768), priority=50),
    )
    assert select(snap, "llama3", estimated_tokens=5000).target.backend.name == "long"
    assert select(snap, "llama3", estimated_tokens=4096).target.backend.name == "short"


def test_unknown_context_length_applies_no_limit() -> None:
    snap = snapshot(backend("a", model("llama3", context_length=None)))
    assert select(snap, "llama3", estimated_tokens=10**7).target.backend.name == "a"


def test_vision_request_without_a_vision_backend_is_a_400_naming_vision() -> None:
    """AC-03 / edge case: no backend supports vision for llama3:8b."""
    snap = snapshot(backend("a", "llama3:8b"), backend("b", "llama3:8b"))
    error = fail(snap, "llama3:8b", needs_vision=True)
    assert isinstance(error, CapabilityMismatch)
    assert error.status == 400
    assert error.missing == ("vision",)
    assert error.to_openai()["error"] == {
        "message": "No backend supports required capabilities for model "
        "'llama3:8b': vision",
        "type": "invalid_request_error",
        "param": None,
        "code": "capability_mismatch",
    }


def test_tools_request_without_a_tools_backend_is_a_400_naming_tools() -> None:
    error = fail(snapshot(backend("a", "llama3")), "llama3", needs_tools=True)
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("tools",)


def test_context_too_long_for_every_backend_is_a_400_naming_context_length() -> None:
    snap = snapshot(
        backend("a", model("llama3", context_length=4096)),
        backend("b", model("llama3", context_length=8192)),
    )
    error = fail(snap, "llama3", estimated_tokens=9000)
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("context_length",)
    assert "about 9000 tokens; the longest context is 8192" in error.message


def test_every_missing_capability_is_listed() -> None:
    snap = snapshot(backend("a", model("llama3", context_length=2048)))
    error = fail(
        snap,
        "llama3",
        needs_vision=True,
        needs_tools=True,
        needs_json_mode=True,
        estimated_tokens=4000,
    )
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("vision", "tools", "json_mode", "context_length")


def test_capabilities_split_across_backends_are_all_listed() -> None:
    snap = snapshot(
        backend("a", model("llama3", supports_vision=True)),
        backend("b", model("llama3", supports_tools=True)),
    )
    error = fail(snap, "llama3", needs_vision=True, needs_tools=True)
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("vision", "tools")


def test_only_the_capability_no_backend_has_is_listed() -> None:
    snap = snapshot(
        backend("a", "llama3"),
        backend("b", model("llama3", supports_tools=True)),
    )
    error = fail(snap, "llama3", needs_vision=True, needs_tools=True)
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("vision",)


def test_capable_backend_that_is_down_gives_503_not_400() -> None:
    """Retrying later can work, so the client gets a 503, not 'change your request'."""
    snap = snapshot(
        backend("a", "llama3"),
        backend("b", model("llama3", supports_vision=True), status="unhealthy"),
    )
    error = fail(snap, "llama3", needs_vision=True)
    assert isinstance(error, NoHealthyBackend)
    assert "1 without vision" in error.message and "1 unhealthy" in error.message


# Concurrency limits


def test_backend_at_max_concurrency_is_skipped() -> None:
    snap = snapshot(
        backend("small", "llama3", priority=0, max_concurrency=2),
        backend("big", "llama3", priority=90),
    )
    stats = LiveStats()
    stats.begin("small")
    stats.begin("small")
    route = select(snap, "llama3", stats=stats)
    assert route.target.backend.name == "big"
    [excluded] = route.decision.excluded
    assert excluded.reasons == (Reason.AT_CAPACITY,)
    assert excluded.detail == "at max concurrency (2/2 in flight)"


def test_all_backends_full_is_503_saying_so() -> None:
    snap = snapshot(
        backend("a", "llama3", max_concurrency=1),
        backend("b", "llama3", max_concurrency=1),
    )
    stats = LiveStats()
    stats.begin("a")
    stats.begin("b")
    with pytest.raises(NoHealthyBackend) as caught:
        select(snap, "llama3", stats=stats)
    assert caught.value.message == (
        "No healthy backend available for model 'llama3' (2 at max concurrency)"
    )


def test_backend_below_max_concurrency_is_used() -> None:
    snap = snapshot(backend("a", "llama3", max_concurrency=2))
    stats = LiveStats()
    stats.begin("a")
    assert select(snap, "llama3", stats=stats).target.backend.name == "a"


def test_a_full_model_falls_back_like_an_unavailable_one() -> None:
    snap = snapshot(
        backend("a", "llama3:70b", max_concurrency=1),
        backend("b", "llama3:8b"),
        fallbacks={"llama3:70b": ["llama3:8b"]},
    )
    stats = LiveStats()
    stats.begin("a")
    route = select(snap, "llama3:70b", stats=stats)
    assert (route.target.backend.name, route.decision.via) == ("b", "fallback")


# AC-07 / AC-09: aliases


def test_alias_routes_to_a_backend_with_the_target_model() -> None:
    """AC-07: gpt-4 -> llama3:70b."""
    snap = snapshot(
        backend("a", "llama3:8b"),
        backend("b", "llama3:70b"),
        aliases={"gpt-4": "llama3:70b"},
    )
    route = select(snap, "gpt-4")
    assert route.target.backend.name == "b"
    assert route.target.model.name == "llama3:70b"
    decision = route.decision
    assert (decision.requested_model, decision.resolved_model, decision.via) == (
        "gpt-4",
        "llama3:70b",
        "alias",
    )


def test_alias_whose_target_nobody_serves_is_a_404_naming_both() -> None:
    """AC-07: alias gpt-4 -> llama3:70b but no backend has llama3:70b."""
    snap = snapshot(backend("a", "llama3:8b"), aliases={"gpt-4": "llama3:70b"})
    error = fail(snap, "gpt-4")
    assert isinstance(error, ModelNotFound)
    assert error.status == 404
    assert "'gpt-4'" in error.message and "'llama3:70b'" in error.message
    assert error.message == (
        "Model 'gpt-4' not found: it is an alias for 'llama3:70b', "
        "and no backend serves 'llama3:70b'"
    )


def test_a_model_served_directly_wins_over_its_alias() -> None:
    snap = snapshot(
        backend("real-gpt4", "gpt-4"),
        backend("local", "llama3:70b"),
        aliases={"gpt-4": "llama3:70b"},
    )
    route = select(snap, "gpt-4")
    assert (route.target.backend.name, route.decision.via) == ("real-gpt4", "direct")


def test_alias_is_used_when_the_direct_backends_are_down() -> None:
    snap = snapshot(
        backend("real-gpt4", "gpt-4", status="unhealthy"),
        backend("local", "llama3:70b"),
        aliases={"gpt-4": "llama3:70b"},
    )
    assert select(snap, "gpt-4").decision.via == "alias"


def test_alias_target_down_is_503_naming_target_and_request() -> None:
    snap = snapshot(
        backend("b", "llama3:70b", status="unhealthy"), aliases={"gpt-4": "llama3:70b"}
    )
    error = fail(snap, "gpt-4")
    assert isinstance(error, NoHealthyBackend)
    assert error.message == (
        "No healthy backend available for model 'llama3:70b', requested as "
        "'gpt-4' (1 unhealthy)"
    )


def test_circular_alias_is_detected_and_reported() -> None:
    """AC-09 / edge case a -> b -> a: single level, then a clear error."""
    snap = snapshot(backend("x", "llama3"), aliases={"a": "b", "b": "a"})
    error = fail(snap, "a")
    assert isinstance(error, CircularAlias)
    assert error.status == 404
    assert (
        "'b', which no backend serves and which is itself an alias for 'a' (a loop)"
        in (error.message)
    )
    assert error.decision is not None
    assert [a.model for a in error.decision.attempts] == ["a", "b"]
    assert len(snap.alias_problems) == 2


def test_alias_of_an_alias_is_not_followed() -> None:
    snap = snapshot(
        backend("x", "llama3:70b"), aliases={"gpt-4o": "gpt-4", "gpt-4": "llama3:70b"}
    )
    error = fail(snap, "gpt-4o")
    assert isinstance(error, CircularAlias)
    assert "Aliases are single-level" in error.message
    assert snap.alias_problems == (
        (
            "Alias 'gpt-4o' points to 'gpt-4', which is itself an alias for "
            "'llama3:70b'; aliases are single-level, so 'gpt-4o' only reaches "
            "backends serving 'gpt-4' directly"
        ),
    )


def test_alias_of_an_alias_reaches_a_target_served_under_that_name() -> None:
    snap = snapshot(
        backend("x", "gpt-4"), aliases={"gpt-4o": "gpt-4", "gpt-4": "llama3:70b"}
    )
    assert select(snap, "gpt-4o").target.backend.name == "x"


def test_alias_pointing_at_itself_is_ignored() -> None:
    snap = snapshot(backend("x", "llama3"), aliases={"loop": "loop"})
    assert "loop" not in snap.aliases
    assert isinstance(fail(snap, "loop"), ModelNotFound)


names = st.sampled_from(["a", "b", "c", "d", "e"])


@given(
    aliases=st.dictionaries(names, names, max_size=5),
    fallbacks=st.dictionaries(names, st.lists(names, max_size=4), max_size=5),
    served=st.dictionaries(
        names, st.sampled_from(["healthy", "unhealthy"]), max_size=5
    ),
    requested=names,
    capability=st.booleans(),
)
def test_alias_and_fallback_resolution_terminates_on_any_graph(
    aliases: dict[str, str],
    fallbacks: dict[str, list[str]],
    served: dict[str, str],
    requested: str,
    capability: bool,
) -> None:
    snap = snapshot(
        *(
            backend(f"backend-{name}", model(name, supports_tools=True), status=status)
            for name, status in served.items()
        ),
        aliases=aliases,
        fallbacks=fallbacks,
    )
    requirements = RequestRequirements(model=requested, needs_tools=capability)
    decision = Router().explain(requirements, snap, LiveStats())
    alias = snap.aliases.get(requested)
    first = [requested] if alias is None else [requested, alias]
    tried = [a.model for a in decision.attempts]
    # Requested, then at most one alias hop, then each fallback at most once.
    assert tried[: len(first)] == first[: len(tried)]
    assert len(tried) == len(set(tried))
    assert set(tried[len(first) :]) <= set(snap.fallbacks_for(*first))
    if decision.error is None:
        assert decision.chosen is not None
        assert served[decision.chosen.model.name] == "healthy"
    else:
        assert decision.chosen is None
        json.dumps(decision.as_dict())


# AC-08: fallback chains


def test_fallback_chain_routes_to_the_first_available_fallback() -> None:
    """AC-08: claude-3-opus -> [llama3:70b, mistral:7b]; only mistral exists."""
    snap = snapshot(
        backend("a", "mistral:7b"),
        fallbacks={"claude-3-opus": ["llama3:70b", "mistral:7b"]},
    )
    route = select(snap, "claude-3-opus")
    assert route.target.model.name == "mistral:7b"
    decision = route.decision
    assert (decision.resolved_model, decision.via) == ("mistral:7b", "fallback")
    assert [a.model for a in decision.attempts] == [
        "claude-3-opus",
        "llama3:70b",
        "mistral:7b",
    ]


def test_fallbacks_are_tried_in_chain_order() -> None:
    snap = snapshot(
        backend("a", "mistral:7b", priority=0),
        backend("b", "llama3:8b", priority=50),
        fallbacks={"llama3:70b": ["llama3:8b", "mistral:7b"]},
    )
    assert select(snap, "llama3:70b").target.model.name == "llama3:8b"


def test_exhausted_fallback_chain_is_503_listing_every_model_attempted() -> None:
    """AC-08: all models in the chain unavailable."""
    snap = snapshot(
        backend("a", "llama3:70b", status="unhealthy"),
        backend("b", "mistral:7b", status="draining"),
        fallbacks={"claude-3-opus": ["llama3:70b", "mistral:7b"]},
    )
    error = fail(snap, "claude-3-opus")
    assert isinstance(error, FallbackChainExhausted)
    assert error.status == 503
    assert error.chain == ("claude-3-opus", "llama3:70b", "mistral:7b")
    assert error.message == (
        "All backends in fallback chain unavailable: claude-3-opus (not found), "
        "llama3:70b (no healthy backend), mistral:7b (no healthy backend)"
    )
    assert error.to_openai()["error"]["code"] == "fallback_chain_exhausted"


def test_chain_of_models_nobody_serves_is_still_503_exhausted() -> None:
    snap = snapshot(backend("a", "other"), fallbacks={"claude-3-opus": ["llama3:70b"]})
    error = fail(snap, "claude-3-opus")
    assert isinstance(error, FallbackChainExhausted)
    assert error.chain == ("claude-3-opus", "llama3:70b")


def test_alias_to_unavailable_model_tries_the_aliased_models_chain() -> None:
    snap = snapshot(
        backend("a", "llama3:70b", status="unhealthy"),
        backend("b", "llama3:8b"),
        aliases={"gpt-4": "llama3:70b"},
        fallbacks={"llama3:70b": ["llama3:8b"]},
    )
    route = select(snap, "gpt-4")
    assert route.target.model.name == "llama3:8b"
    assert route.decision.via == "fallback"
    assert [a.model for a in route.decision.attempts] == [
        "gpt-4",
        "llama3:70b",
        "llama3:8b",
    ]


def test_chain_on_the_alias_name_is_tried_before_the_targets_chain() -> None:
    snap = snapshot(
        backend("a", "mistral:7b"),
        backend("b", "llama3:8b"),
        aliases={"claude-3-opus": "llama3:70b"},
        fallbacks={
            "claude-3-opus": ["llama3:70b", "mistral:7b"],
            "llama3:70b": ["llama3:8b"],
        },
    )
    route = select(snap, "claude-3-opus")
    assert route.target.model.name == "mistral:7b"
    assert [a.model for a in route.decision.attempts] == [
        "claude-3-opus",
        "llama3:70b",
        "mistral:7b",
    ]


def test_empty_fallback_chain_is_treated_as_no_fallback() -> None:
    snap = snapshot(
        backend("a", "llama3:70b", status="unhealthy"), fallbacks={"llama3:70b": []}
    )
    assert "llama3:70b" not in snap.fallbacks
    assert isinstance(fail(snap, "llama3:70b"), NoHealthyBackend)


def test_fallbacks_of_a_fallback_are_not_followed() -> None:
    snap = snapshot(
        backend("c", "mistral:7b"),
        fallbacks={"llama3:70b": ["llama3:8b"], "llama3:8b": ["mistral:7b"]},
    )
    error = fail(snap, "llama3:70b")
    assert isinstance(error, FallbackChainExhausted)
    assert error.chain == ("llama3:70b", "llama3:8b")


def test_fallback_goes_through_the_same_capability_filter() -> None:
    snap = snapshot(
        backend("a", "mistral:7b", priority=0),
        backend("b", model("llama3:8b", supports_vision=True), priority=50),
        fallbacks={"llava": ["mistral:7b", "llama3:8b"]},
    )
    route = select(snap, "llava", needs_vision=True)
    assert route.target.model.name == "llama3:8b"


def test_chain_failing_only_on_capabilities_is_a_400_not_a_503() -> None:
    snap = snapshot(
        backend("a", "llama3:70b"),
        backend("b", "mistral:7b"),
        fallbacks={"llama3:70b": ["mistral:7b"]},
    )
    error = fail(snap, "llama3:70b", needs_vision=True)
    assert isinstance(error, CapabilityMismatch)
    assert error.missing == ("vision",)
    assert error.message.endswith("also tried 'mistral:7b'")


def test_a_fallback_naming_an_alias_is_resolved_one_level() -> None:
    snap = snapshot(
        backend("a", "llama3:70b", status="unhealthy"),
        backend("b", "llama3:8b"),
        aliases={"small": "llama3:8b"},
        fallbacks={"llama3:70b": ["small"]},
    )
    route = select(snap, "llama3:70b")
    assert (route.target.backend.name, route.decision.via) == ("b", "fallback")
    assert snap.fallbacks["llama3:70b"] == ("llama3:8b",)


def test_a_fallback_alias_back_to_the_chains_own_model_is_dropped() -> None:
    snap = snapshot(
        backend("a", "m", status="unhealthy"),
        aliases={"loop": "m"},
        fallbacks={"m": ["loop"]},
    )
    assert "m" not in snap.fallbacks
    assert isinstance(fail(snap, "m"), NoHealthyBackend)


# AC-10: every failure is descriptive and OpenAI-shaped


@pytest.mark.parametrize(
    ("snap", "model_name", "needs", "kind", "status"),
    [
        (snapshot(), "gpt-5", {}, ModelNotFound, 404),
        (
            snapshot(backend("a", "m", status="unhealthy")),
            "m",
            {},
            NoHealthyBackend,
            503,
        ),
        (
            snapshot(backend("a", "m")),
            "m",
            {"needs_tools": True},
            CapabilityMismatch,
            400,
        ),
        (
            snapshot(backend("a", "m", status="unhealthy"), fallbacks={"m": ["n"]}),
            "m",
            {},
            FallbackChainExhausted,
            503,
        ),
        (snapshot(aliases={"a": "b", "b": "a"}), "a", {}, CircularAlias, 404),
    ],
    ids=["not-found", "no-healthy", "capability", "chain", "circular-alias"],
)
def test_every_routing_failure_has_a_status_and_an_openai_error_body(
    snap: RouterSnapshot,
    model_name: str,
    needs: dict[str, bool],
    kind: type[RoutingError],
    status: int,
) -> None:
    """AC-10."""
    error = fail(snap, model_name, **needs)
    assert type(error) is kind
    assert error.status == status
    body = error.to_openai()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert model_name in body["error"]["message"]
    assert body["error"]["code"]
    assert json.loads(json.dumps(body)) == body
    assert error.decision is not None
    assert error.decision.error is error
    assert json.dumps(error.decision.as_dict())


def test_empty_model_name_is_a_400_before_routing() -> None:
    with pytest.raises(InvalidModel) as caught:
        select(snapshot(backend("a", "m")), "")
    assert caught.value.status == 400


# Tri-state capabilities (issue 12, item 1): unknown does not filter, yes wins


def test_unknown_tools_support_does_not_filter_a_tools_request() -> None:
    snap = snapshot(backend("a", model("m", supports_tools=None)))
    route = select(snap, "m", needs_tools=True)
    assert route.target.backend.name == "a"
    assert route.decision.excluded == ()


def test_explicit_no_still_filters_while_unknown_serves() -> None:
    snap = snapshot(
        backend("a", model("m", supports_json_mode=False), priority=0),
        backend("b", model("m", supports_json_mode=None), priority=50),
    )
    route = select(snap, "m", needs_json_mode=True)
    assert route.target.backend.name == "b"
    assert [t.backend.name for t in route.retry_targets] == []
    assert route.decision.excluded[0].reasons == (Reason.NO_JSON_MODE,)


def test_a_confirmed_capability_is_preferred_and_unknown_is_tried_after() -> None:
    snap = snapshot(
        backend("a", model("m", supports_tools=None), priority=0),
        backend("b", model("m", supports_tools=True), priority=50),
        backend("c", model("m", supports_tools=True), priority=60),
    )
    route = select(snap, "m", needs_tools=True)
    assert route.target.backend.name == "b"
    assert [t.backend.name for t in route.decision.retry_order] == ["c", "a"]
    [deferred] = route.decision.excluded
    assert deferred.reasons == (Reason.CAPABILITY_UNCONFIRMED,)
    # Without the need, priority decides as usual.
    assert select(snap, "m").target.backend.name == "a"


def test_only_unknown_support_everywhere_routes_by_score() -> None:
    snap = snapshot(
        backend("a", model("m", supports_vision=None), priority=0),
        backend("b", model("m", supports_vision=None), priority=50),
    )
    route = select(snap, "m", needs_vision=True)
    assert route.target.backend.name == "a"
    assert [t.backend.name for t in route.retry_targets] == ["b"]


def test_explain_shows_each_capability_as_yes_no_or_unknown() -> None:
    snap = snapshot(
        backend(
            "a",
            model("m", supports_vision=True, supports_tools=None),
        )
    )
    record = select(snap, "m").decision.as_dict()
    assert record["candidates"][0]["capabilities"] == {
        "vision": "yes",
        "tools": "unknown",
        "json_mode": "no",
    }


# Fallbacks on failure (issue 12, item 2): the retry order continues into the chain


def test_retry_order_continues_into_the_fallback_chain() -> None:
    snap = snapshot(
        backend("a", "m"),
        backend("b", "f1"),
        backend("c", "f2"),
        fallbacks={"m": ["f1", "f2"]},
    )
    route = select(snap, "m")
    assert route.target.backend.name == "a"
    assert [(t.backend.name, t.model.name) for t in route.retry_targets] == [
        ("b", "f1"),
        ("c", "f2"),
    ]
    record = route.decision.as_dict()
    assert [a["model"] for a in record["onward"]] == ["f1", "f2"]
    assert record["retry_order"] == [
        {"backend": "b", "model": "f1"},
        {"backend": "c", "model": "f2"},
    ]


def test_max_retries_bounds_each_model_of_the_retry_order() -> None:
    snap = snapshot(
        *(backend(f"a{i}", "m", priority=i) for i in range(3)),
        *(backend(f"b{i}", "f", priority=i) for i in range(3)),
        fallbacks={"m": ["f"]},
        max_retries=1,
    )
    route = select(snap, "m")
    assert [t.backend.name for t in route.retry_targets] == ["a1", "b0", "b1"]
    assert len(route.decision.retry_order) == 5


def test_a_served_fallback_continues_with_the_rest_of_the_chain() -> None:
    snap = snapshot(
        backend("a", "m", status="unhealthy"),
        backend("b", "f1"),
        backend("c", "f2"),
        fallbacks={"m": ["f1", "f2"]},
    )
    route = select(snap, "m")
    assert (route.target.backend.name, route.decision.via) == ("b", "fallback")
    assert [t.backend.name for t in route.retry_targets] == ["c"]


def test_an_alias_continues_with_its_chain() -> None:
    snap = snapshot(
        backend("a", "target"),
        backend("b", "f"),
        aliases={"public": "target"},
        fallbacks={"target": ["f"]},
    )
    route = select(snap, "public")
    assert route.target.backend.name == "a"
    assert [t.backend.name for t in route.retry_targets] == ["b"]


# Item 4: a model only disabled or vanished rows list is not served at all


@pytest.mark.parametrize(
    "listing",
    [
        {"enabled": False},  # the backend is switched off
        {"model": {"enabled": False}},  # discovery disabled the vanished model
    ],
)
def test_a_model_listed_only_by_disabled_rows_is_404_not_503(
    listing: dict[str, Any],
) -> None:
    fields = {k: v for k, v in listing.items() if k != "model"}
    snap = snapshot(
        backend("a", model("gone", **listing.get("model", {})), **fields),
        backend("b", "other"),
    )
    error = fail(snap, "gone")
    assert isinstance(error, ModelNotFound)
    assert error.status == 404
    assert "gone" not in snap.served_models()


def test_a_disabled_row_beside_an_unhealthy_one_is_still_503() -> None:
    snap = snapshot(
        backend("a", model("m", enabled=False)),
        backend("b", "m", status="unhealthy"),
    )
    assert isinstance(fail(snap, "m"), NoHealthyBackend)


@pytest.mark.parametrize(
    "switched_off",
    [
        {"enabled": False},  # the backend is disabled
        {"models_enabled": False},  # its row for the model is
    ],
)
def test_a_disabled_row_elsewhere_does_not_turn_a_too_long_prompt_into_a_503(
    switched_off: dict[str, bool],
) -> None:
    # A row an operator switched off cannot serve the request later either: the
    # prompt is the client's to shorten (400), not a transient 503 that SDKs
    # retry.
    off_model = model(
        "llama3",
        context_length=None,
        enabled=switched_off.get("models_enabled", True),
    )
    snap = snapshot(
        backend("a", model("llama3", context_length=4096)),
        backend("off", off_model, enabled=switched_off.get("enabled", True)),
    )
    error = fail(snap, "llama3", estimated_tokens=9000)
    assert isinstance(error, CapabilityMismatch)
    assert error.status == 400
    assert error.missing == ("context_length",)
    assert "the longest context is 4096" in error.message
