"""Routing model validation: aliases, fallback chains and the policy singleton."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from routing.core import Strategy
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from tests.factories import (
    AliasFactory,
    ChainStepFactory,
    FallbackChainFactory,
    RoutingPolicyFactory,
)


def _messages(instance: object) -> str:
    with pytest.raises(ValidationError) as caught:
        instance.full_clean()  # type: ignore[attr-defined]
    return " ".join(caught.value.messages)


@pytest.mark.django_db
def test_alias_cannot_target_itself() -> None:
    assert "cannot target itself" in _messages(Alias(name="gpt-4", target="gpt-4"))
    with pytest.raises(IntegrityError), transaction.atomic():
        Alias.objects.create(name="gpt-4", target="gpt-4")


@pytest.mark.django_db
def test_alias_cannot_target_another_alias() -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    message = _messages(Alias(name="gpt-4-turbo", target="gpt-4"))

    assert "'gpt-4' is itself an alias" in message


@pytest.mark.django_db
def test_a_name_another_alias_targets_cannot_become_an_alias() -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    message = _messages(Alias(name="llama3:70b", target="llama3:8b"))

    assert "Alias 'gpt-4' already targets 'llama3:70b'" in message


@pytest.mark.django_db
def test_an_alias_may_be_retargeted() -> None:
    alias = AliasFactory(name="gpt-4", target="llama3:70b")

    alias.target = "mistral:7b"
    alias.full_clean()


@pytest.mark.django_db
def test_alias_names_are_unique() -> None:
    AliasFactory(name="gpt-4")

    assert _messages(Alias(name="gpt-4", target="mistral:7b"))
    with pytest.raises(IntegrityError), transaction.atomic():
        Alias.objects.create(name="gpt-4", target="mistral:7b")


@pytest.mark.django_db
def test_weights_must_sum_to_100() -> None:
    policy = RoutingPolicyFactory()
    policy.weight_priority = 60

    assert "must sum to 100 (they sum to 110)" in _messages(policy)


@pytest.mark.django_db
def test_database_rejects_weights_not_summing_to_100() -> None:
    RoutingPolicyFactory()

    with pytest.raises(IntegrityError), transaction.atomic():
        RoutingPolicy.objects.update(weight_latency=25)


@pytest.mark.django_db
def test_weights_summing_to_100_in_any_split_are_valid() -> None:
    policy = RoutingPolicy(weight_priority=100, weight_load=0, weight_latency=0)

    policy.full_clean()


@pytest.mark.django_db
def test_routing_policy_is_a_singleton() -> None:
    first = RoutingPolicy.load()

    # save() pins the primary key, so even an explicit id cannot add a row.
    with pytest.raises(IntegrityError), transaction.atomic():
        RoutingPolicy(id=2, strategy="random").save()

    assert list(RoutingPolicy.objects.values_list("pk", "strategy")) == [
        (first.pk, "smart")
    ]
    assert RoutingPolicy.load().pk == first.pk


@pytest.mark.django_db
def test_database_rejects_a_second_policy_row() -> None:
    RoutingPolicy.load()

    with pytest.raises(IntegrityError), transaction.atomic():
        RoutingPolicy.objects.bulk_create([RoutingPolicy(id=2)])


@pytest.mark.django_db
def test_load_creates_the_policy_with_defaults() -> None:
    policy = RoutingPolicy.load()

    assert (policy.strategy, policy.max_retries) == ("smart", 2)
    assert (policy.weight_priority, policy.weight_load, policy.weight_latency) == (
        50,
        30,
        20,
    )


@pytest.mark.django_db
def test_unknown_strategy_and_too_many_retries_are_rejected() -> None:
    policy = RoutingPolicy.load()
    policy.strategy = "fastest"
    policy.max_retries = 11

    with pytest.raises(ValidationError) as caught:
        policy.full_clean()

    assert set(caught.value.message_dict) == {"strategy", "max_retries"}


@pytest.mark.django_db
def test_a_model_cannot_fall_back_to_itself() -> None:
    chain = FallbackChainFactory(model="llama3:70b")

    step = ChainStep(chain=chain, position=0, model="llama3:70b")

    assert "cannot be a fallback for itself" in _messages(step)
    with pytest.raises(ValidationError):
        chain.set_fallbacks(["llama3:8b", "llama3:70b"])


@pytest.mark.django_db
def test_a_fallback_is_listed_once_per_chain() -> None:
    step = ChainStepFactory(model="llama3:8b")

    assert _messages(ChainStep(chain=step.chain, position=5, model="llama3:8b"))
    with pytest.raises(IntegrityError), transaction.atomic():
        ChainStep.objects.create(chain=step.chain, position=5, model="llama3:8b")
    with pytest.raises(ValidationError):
        step.chain.set_fallbacks(["mistral:7b", "mistral:7b"])


@pytest.mark.django_db
def test_set_fallbacks_replaces_the_steps_in_order() -> None:
    chain = FallbackChainFactory(model="llama3:70b")
    chain.set_fallbacks(["a", "b"])

    chain.set_fallbacks(["mistral:7b", "llama3:8b", "phi3"])

    assert FallbackChain.objects.get(pk=chain.pk).fallback_models == [
        "mistral:7b",
        "llama3:8b",
        "phi3",
    ]


@pytest.mark.django_db
def test_a_model_has_at_most_one_chain() -> None:
    FallbackChainFactory(model="llama3:70b")

    assert _messages(FallbackChain(model="llama3:70b"))


def test_the_policy_offers_every_strategy_the_router_knows() -> None:
    field = RoutingPolicy._meta.get_field("strategy")
    assert [value for value, _ in field.choices] == [s.value for s in Strategy]
    assert dict(field.choices)["smart"] == "Smart (priority, load, latency)"


@pytest.mark.django_db
def test_a_fallback_step_naming_an_alias_of_the_chains_model_is_rejected() -> None:
    Alias.objects.create(name="loop", target="llama3:70b")
    chain = FallbackChain.objects.create(model="llama3:70b")
    step = ChainStep(chain=chain, position=0, model="loop")
    with pytest.raises(ValidationError) as caught:
        step.full_clean()
    assert "'loop' is an alias for 'llama3:70b', the model this chain is for" in str(
        caught.value
    )
    # An alias leading elsewhere is a valid step: the router resolves it.
    Alias.objects.create(name="small", target="llama3:8b")
    ChainStep(chain=chain, position=0, model="small").full_clean()


@pytest.mark.django_db
def test_an_alias_closing_a_fallback_cycle_is_rejected() -> None:
    chain = FallbackChain.objects.create(model="llama3:70b")
    ChainStep.objects.create(chain=chain, position=0, model="big")
    with pytest.raises(ValidationError) as caught:
        Alias(name="big", target="llama3:70b").full_clean()
    assert "would make the chain a cycle" in str(caught.value)
