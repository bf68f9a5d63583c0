"""Admin pages for aliases, fallback chains and the routing policy."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from routing.admin import AliasAdmin
from routing.core import FLEET_SETTINGS
from routing.models import Alias, FallbackChain, RoutingPolicy
from tests.factories import (
    AliasFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
    RoutingPolicyFactory,
)

pytestmark = pytest.mark.django_db

ALIAS_ADD = reverse("admin:routing_alias_add")
CHAIN_ADD = reverse("admin:routing_fallbackchain_add")
POLICY_CHANGELIST = reverse("admin:routing_routingpolicy_changelist")
POLICY_CHANGE = reverse(
    "admin:routing_routingpolicy_change", args=(RoutingPolicy.SINGLETON_PK,)
)


def form_errors(response: Any) -> list[str]:
    """Return every error message on a re-rendered admin form."""
    form = response.context["adminform"].form
    return [str(error) for errors in form.errors.values() for error in errors]


def chain_form(
    model: str, steps: list[tuple[str, str]], **extra: str
) -> dict[str, str]:
    """Return the POST body of a new fallback chain with (step, model) rows."""
    data = {
        "model": model,
        "steps-TOTAL_FORMS": str(len(steps)),
        "steps-INITIAL_FORMS": "0",
        "steps-MIN_NUM_FORMS": "0",
        "steps-MAX_NUM_FORMS": "1000",
        **extra,
    }
    for index, (step, step_model) in enumerate(steps):
        data[f"steps-{index}-step"] = step
        data[f"steps-{index}-model"] = step_model
    return data


def policy_form(**fields: str) -> dict[str, str]:
    return {
        "strategy": "smart",
        "max_retries": "2",
        "weight_priority": "50",
        "weight_load": "30",
        "weight_latency": "20",
        **ADMISSION_DEFAULTS,
        **FLEET_DEFAULTS,
        **CONTEXT_SHIFT_DEFAULTS,
        **ENSEMBLE_DEFAULTS,
        **PREFIX_DEFAULTS,
        **CACHE_DEFAULTS,
        **fields,
    }


# The response cache's part of the policy form, at its defaults.
CACHE_DEFAULTS = {
    "cache_ttl_seconds": "3600",
    "cache_scope": "key",
    "cache_max_entry_bytes": "1048576",
    "cache_only_deterministic": "on",
}


# Context shift's part of the policy form, at its defaults.
CONTEXT_SHIFT_DEFAULTS = {
    "context_shift_enabled": "on",
    "context_shift_keep_last_messages": "1",
    "context_shift_max_retries": "2",
}


# Multiple opinions' part of the policy form, at its defaults.
ENSEMBLE_DEFAULTS = {
    "ensemble_opinions": "3",
    "ensemble_step_timeout_seconds": "120",
    "ensemble_critique_prompt": "",
    "ensemble_refine_prompt": "",
}


# Prefix-aware routing's part of the policy form, at its defaults (off: an
# unchecked box is absent from a form).
PREFIX_DEFAULTS = {
    "prefix_block_chars": "256",
    "prefix_max_imbalance": "4",
    "prefix_max_imbalance_ratio": "0.5",
    "prefix_cache_blocks": "4096",
    "prefix_session_keys": "x-session-id,user,metadata.user_id",
    "prefix_session_ttl_seconds": "600",
}


# The fleet strategy's part of the policy form, at its defaults.
FLEET_DEFAULTS = {
    setting.name: "" if setting.default is None else str(setting.default)
    for setting in FLEET_SETTINGS
}


# The admission control part of the policy form, as the admin renders it.
ADMISSION_DEFAULTS = {
    "admission_enabled": "on",
    "admission_flow_key": "key",
    "admission_sizing": "tokens",
    "admission_default_output_tokens": "256",
    "admission_total_capacity": "1000",
    "admission_flow_capacity": "100",
    "admission_critical_reserved": "100",
    "admission_queue_ttl": "30",
    "admission_watermark_per_backend": "2",
    "admission_percentage_deviation_for_bounds": "0.1",
    "admission_lower_bound_per_backend": "",
    "admission_upper_bound_per_backend": "",
    "admission_model_weights": "{}",
    "admission_critical_share": "70",
    "admission_default_share": "25",
    "admission_sheddable_share": "5",
    "admission_stock_unit": "requests",
    "admission_watermark_tokens_per_backend": "",
}


def test_routing_pages_render_for_a_superuser(admin_client: Client) -> None:
    alias = AliasFactory()
    chain = ChainStepFactory().chain

    for url in (
        reverse("admin:routing_alias_changelist"),
        ALIAS_ADD,
        reverse("admin:routing_alias_change", args=(alias.pk,)),
        reverse("admin:routing_fallbackchain_changelist"),
        CHAIN_ADD,
        reverse("admin:routing_fallbackchain_change", args=(chain.pk,)),
        reverse("admin:routing_fallbackchain_history", args=(chain.pk,)),
    ):
        assert admin_client.get(url).status_code == 200, url


# --- aliases ------------------------------------------------------------------


def test_alias_is_added_and_searchable(admin_client: Client) -> None:
    response = admin_client.post(ALIAS_ADD, {"name": "gpt-4", "target": "llama3:70b"})

    assert response.status_code == 302
    assert Alias.objects.get().target == "llama3:70b"
    found = admin_client.get(reverse("admin:routing_alias_changelist"), {"q": "llama"})
    assert [a.name for a in found.context["cl"].result_list] == ["gpt-4"]


def test_an_alias_whose_target_nobody_serves_is_flagged(admin_client: Client) -> None:
    BackendModelFactory(name="llama3:8b")
    BackendModelFactory(name="retired", enabled=False)
    saved = admin_client.post(
        ALIAS_ADD, {"name": "gpt-4", "target": "retired"}, follow=True
    )
    assert "No enabled backend serves &#x27;retired&#x27; (nor a model" in (
        saved.content.decode()
    )
    admin_client.post(ALIAS_ADD, {"name": "fast", "target": "llama3:8b"})
    listed = admin_client.get(reverse("admin:routing_alias_changelist"))
    served = {
        alias.name: AliasAdmin.routes(None, alias)  # type: ignore[arg-type]
        for alias in listed.context["cl"].result_list
    }
    assert served == {"fast": True, "gpt-4": False}


def test_alias_to_another_alias_is_a_form_error(admin_client: Client) -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    response = admin_client.post(ALIAS_ADD, {"name": "gpt-5", "target": "gpt-4"})

    assert response.status_code == 200
    assert form_errors(response) == [
        (
            "'gpt-4' is itself an alias; aliases are single-level, so target a "
            "model name instead."
        )
    ]
    assert "is itself an alias" in response.content.decode()
    assert not Alias.objects.filter(name="gpt-5").exists()


def test_alias_to_itself_is_a_form_error(admin_client: Client) -> None:
    response = admin_client.post(ALIAS_ADD, {"name": "gpt-4", "target": "gpt-4"})

    assert response.status_code == 200
    assert form_errors(response) == ["Alias 'gpt-4' cannot target itself."]
    assert not Alias.objects.exists()


def test_target_of_an_alias_cannot_become_an_alias(admin_client: Client) -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    response = admin_client.post(
        ALIAS_ADD, {"name": "llama3:70b", "target": "mistral:7b"}
    )

    assert response.status_code == 200
    assert "already targets 'llama3:70b'" in form_errors(response)[0]


def test_duplicate_alias_name_is_a_form_error(admin_client: Client) -> None:
    AliasFactory(name="gpt-4")

    response = admin_client.post(ALIAS_ADD, {"name": "gpt-4", "target": "phi3"})

    assert response.status_code == 200
    assert form_errors(response) == ["Alias with this Name already exists."]


# --- fallback chains ----------------------------------------------------------


def test_chain_steps_are_saved_and_listed_in_position_order(
    admin_client: Client,
) -> None:
    response = admin_client.post(
        CHAIN_ADD,
        chain_form(
            "llama3:70b",
            [("3", "phi3"), ("1", "llama3:8b"), ("2", "mistral:7b")],
        ),
    )

    assert response.status_code == 302
    chain = FallbackChain.objects.get(model="llama3:70b")
    assert chain.fallback_models == ["llama3:8b", "mistral:7b", "phi3"]
    listing = admin_client.get(reverse("admin:routing_fallbackchain_changelist"))
    assert "llama3:70b → llama3:8b → mistral:7b → phi3" in listing.content.decode()
    change = admin_client.get(
        reverse("admin:routing_fallbackchain_change", args=(chain.pk,))
    )
    inline_models = [
        form.form.instance.model for form in change.context["inline_admin_formsets"][0]
    ]
    assert inline_models[:3] == ["llama3:8b", "mistral:7b", "phi3"]


def test_steps_are_reordered_by_editing_step_numbers(admin_client: Client) -> None:
    chain = FallbackChainFactory(model="llama3:70b")
    first = ChainStepFactory(chain=chain, position=0, model="llama3:8b")
    second = ChainStepFactory(chain=chain, position=1, model="mistral:7b")

    response = admin_client.post(
        reverse("admin:routing_fallbackchain_change", args=(chain.pk,)),
        {
            "model": "llama3:70b",
            "steps-TOTAL_FORMS": "2",
            "steps-INITIAL_FORMS": "2",
            "steps-MIN_NUM_FORMS": "0",
            "steps-MAX_NUM_FORMS": "1000",
            "steps-0-id": str(first.pk),
            "steps-0-chain": str(chain.pk),
            "steps-0-step": "5",
            "steps-0-model": "llama3:8b",
            "steps-1-id": str(second.pk),
            "steps-1-chain": str(chain.pk),
            "steps-1-step": "1",
            "steps-1-model": "mistral:7b",
        },
    )

    assert response.status_code == 302
    chain.refresh_from_db()
    assert chain.fallback_models == ["mistral:7b", "llama3:8b"]
    second.refresh_from_db()
    first.refresh_from_db()
    assert (second.position, first.position) == (0, 1)  # gaps closed


def test_steps_left_unnumbered_are_numbered_in_row_order(admin_client: Client) -> None:
    response = admin_client.post(
        CHAIN_ADD,
        chain_form(
            "gpt-4",
            [("", "llama3:70b"), ("", "llama3:8b"), ("1", "mixtral"), ("", "")],
        ),
    )

    assert response.status_code == 302
    chain = FallbackChain.objects.get(model="gpt-4")
    assert chain.fallback_models == ["mixtral", "llama3:70b", "llama3:8b"]
    assert list(chain.steps.values_list("position", flat=True)) == [0, 1, 2]
    change = admin_client.get(
        reverse("admin:routing_fallbackchain_change", args=(chain.pk,))
    )
    forms = change.context["inline_admin_formsets"][0].formset.forms
    # The saved rows show 1, 2, 3; the empty rows for new steps show nothing.
    assert [form["step"].value() for form in forms] == [1, 2, 3, None, None, None]


def test_chain_step_rules_from_the_model_show_on_the_form(
    admin_client: Client,
) -> None:
    chain = FallbackChainFactory(model="llama3:70b")

    response = admin_client.post(
        reverse("admin:routing_fallbackchain_change", args=(chain.pk,)),
        chain_form("llama3:70b", [("0", "llama3:70b")]),
    )

    assert response.status_code == 200
    assert "cannot be a fallback for itself" in response.content.decode()
    assert chain.steps.count() == 0


def test_a_new_chain_cannot_fall_back_to_its_own_model(admin_client: Client) -> None:
    response = admin_client.post(
        CHAIN_ADD, chain_form("llama3:70b", [("0", "llama3:70b")])
    )

    assert response.status_code == 200
    assert "cannot be a fallback for itself" in response.content.decode()
    assert not FallbackChain.objects.exists()


def test_a_model_listed_twice_in_a_chain_is_a_form_error(
    admin_client: Client,
) -> None:
    response = admin_client.post(
        CHAIN_ADD, chain_form("llama3:70b", [("1", "phi3"), ("2", "phi3")])
    )

    assert response.status_code == 200
    assert "Please correct the duplicate data" in response.content.decode()
    assert not FallbackChain.objects.exists()


def test_chain_changelist_query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    for chain in FallbackChainFactory.create_batch(30):
        ChainStepFactory.create_batch(3, chain=chain)

    with django_assert_max_num_queries(8):
        response = admin_client.get(reverse("admin:routing_fallbackchain_changelist"))

    assert len(response.context["cl"].result_list) == 30


def test_alias_changelist_query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    AliasFactory.create_batch(40)

    # The rows are judged against one routing snapshot (a fixed number of reads).
    with django_assert_max_num_queries(13):
        response = admin_client.get(reverse("admin:routing_alias_changelist"))

    assert len(response.context["cl"].result_list) == 40


# --- the routing policy singleton ---------------------------------------------


def test_policy_list_opens_the_single_policy_creating_it(admin_client: Client) -> None:
    assert not RoutingPolicy.objects.exists()

    response = admin_client.get(POLICY_CHANGELIST, follow=True)

    assert response.redirect_chain == [(POLICY_CHANGE, 302)]
    assert response.status_code == 200
    assert RoutingPolicy.objects.count() == 1
    html = response.content.decode()
    assert "deletelink" not in html
    assert "_addanother" not in html


def test_policy_cannot_be_added_or_deleted(admin_client: Client) -> None:
    add_before = admin_client.get(reverse("admin:routing_routingpolicy_add"))
    RoutingPolicyFactory()

    add = admin_client.get(reverse("admin:routing_routingpolicy_add"))
    delete = admin_client.post(
        reverse(
            "admin:routing_routingpolicy_delete", args=(RoutingPolicy.SINGLETON_PK,)
        ),
        {"post": "yes"},
    )

    assert add_before.status_code == add.status_code == 403
    assert delete.status_code == 403
    assert RoutingPolicy.objects.count() == 1


def test_policy_is_saved_from_its_page(admin_client: Client) -> None:
    RoutingPolicyFactory()

    response = admin_client.post(
        POLICY_CHANGE,
        policy_form(
            strategy="round_robin",
            weight_priority="40",
            weight_load="40",
            max_retries="4",
        ),
    )

    assert response.status_code == 302
    policy = RoutingPolicy.load()
    assert policy.strategy == "round_robin"
    assert (policy.weight_priority, policy.weight_load, policy.weight_latency) == (
        40,
        40,
        20,
    )
    assert policy.max_retries == 4


def test_weights_not_summing_to_100_are_a_form_error(admin_client: Client) -> None:
    RoutingPolicyFactory()

    response = admin_client.post(POLICY_CHANGE, policy_form(weight_priority="60"))

    assert response.status_code == 200
    assert (
        "The priority, load and latency weights must sum to 100 (they sum to 110)."
        in form_errors(response)
    )
    assert "must sum to 100 (they sum to 110)" in response.content.decode()
    assert RoutingPolicy.load().weight_priority == 50


def test_weight_error_is_reported_once_in_plain_words(admin_client: Client) -> None:
    RoutingPolicyFactory()

    response = admin_client.post(POLICY_CHANGE, policy_form(weight_priority="60"))

    errors = form_errors(response)
    assert len(errors) == 1
    assert "must sum to 100" in errors[0]


def test_out_of_range_policy_values_are_form_errors(admin_client: Client) -> None:
    RoutingPolicyFactory()

    response = admin_client.post(POLICY_CHANGE, policy_form(max_retries="11"))

    assert response.status_code == 200
    assert form_errors(response) == ["Ensure this value is less than or equal to 10."]


def test_admission_settings_are_edited_on_the_policy_page(admin_client: Client) -> None:
    RoutingPolicyFactory()
    response = admin_client.post(
        POLICY_CHANGE,
        policy_form(
            admission_flow_key="key+model",
            admission_watermark_per_backend="4",
            admission_upper_bound_per_backend="6",
            admission_model_weights='{"llama3:70b": 2}',
        ),
    )
    assert response.status_code == 302
    policy = RoutingPolicy.load()
    settings = policy.admission_settings()
    assert (settings.flow_key, settings.upper_per_backend) == ("key+model", 6.0)
    assert settings.lower_per_backend == pytest.approx(3.6)
    assert settings.weight_of("llama3:70b") == 2.0


def test_a_lower_bound_above_the_upper_is_refused_naming_both(
    admin_client: Client,
) -> None:
    RoutingPolicyFactory()
    response = admin_client.post(
        POLICY_CHANGE,
        policy_form(
            admission_lower_bound_per_backend="5",
            admission_upper_bound_per_backend="3",
        ),
    )
    assert response.status_code == 200
    assert form_errors(response) == [
        "lower_bound_per_backend (5) cannot be above upper_bound_per_backend (3)"
    ]
    assert RoutingPolicy.load().admission_lower_bound_per_backend is None


def test_bad_admission_numbers_are_form_errors(admin_client: Client) -> None:
    RoutingPolicyFactory()
    response = admin_client.post(
        POLICY_CHANGE,
        policy_form(
            admission_queue_ttl="0",
            admission_percentage_deviation_for_bounds="1.5",
            admission_model_weights='{"m": -1}',
        ),
    )
    errors = form_errors(response)
    assert sorted(errors) == [
        "must be between 0 and 1 (exclusive), got 1.5",
        "must be more than 0 and at most 3600 seconds, got 0",
        "the weight of 'm' must be more than 0 and at most 1000, got -1",
    ]
