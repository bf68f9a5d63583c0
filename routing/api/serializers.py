"""Serializers for aliases, fallback chains and the routing policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from nexus_lib.serializers import ModelCleanSerializer, saving
from routing.core import FLEET_SETTING_NAMES, BackendSpec
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy


class AliasSerializer(ModelCleanSerializer[Alias]):
    """A public model name that routes to another model (single level).

    A name with ``*`` or ``?`` is a pattern (``claude-*``): it covers every
    name that no enabled backend serves and no exact alias names, the longest
    pattern first.
    """

    is_pattern = serializers.BooleanField(
        read_only=True,
        help_text="Whether the name is a pattern (has * or ?), not one model name.",
    )

    class Meta:
        model = Alias
        fields = ("id", "name", "is_pattern", "target", "created_at", "updated_at")
        extra_kwargs: ClassVar[dict[str, dict[str, str]]] = {
            "name": {
                "help_text": "The name clients ask for (gpt-4), or a pattern "
                "with * (any characters) and ? (one character): claude-*."
            }
        }


class FallbackChainSerializer(ModelCleanSerializer[FallbackChain]):
    """A model and the models to try instead, in order, when it cannot be served."""

    fallbacks = serializers.ListField(
        child=serializers.CharField(max_length=200),
        source="fallback_models",
        required=False,
        help_text="Models tried in this order. Omitted on update: kept as they are.",
    )

    class Meta:
        model = FallbackChain
        fields = ("id", "model", "fallbacks", "created_at", "updated_at")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        fallbacks = attrs.get("fallback_models")
        if fallbacks is None:
            return attrs
        chain = self.build_candidate(attrs)
        errors: dict[int, list[str]] = {}
        seen: set[str] = set()
        cleaned = []
        for position, name in enumerate(fallbacks):
            step = ChainStep(chain=chain, position=position, model=name)
            try:
                # The chain may not be saved yet: its own checks ran above.
                step.full_clean(exclude=["chain"])
            except DjangoValidationError as error:
                errors[position] = [
                    message
                    for messages in error.message_dict.values()
                    for message in messages
                ]
                continue
            # The admin's formset applies the one-step-per-model constraint
            # across its rows the same way, before anything is saved.
            if step.model in seen:
                errors[position] = [f"'{step.model}' is listed more than once."]
            seen.add(step.model)
            cleaned.append(step.model)
        if errors:
            detail: dict[str, Any] = {"fallbacks": errors}
            raise serializers.ValidationError(detail)
        attrs["fallback_models"] = cleaned
        return attrs

    def create(self, validated_data: dict[str, Any]) -> FallbackChain:
        fallbacks = validated_data.pop("fallback_models", [])
        with saving():
            chain = super().create(validated_data)
            chain.set_fallbacks(fallbacks)
        return chain

    def update(
        self, instance: FallbackChain, validated_data: dict[str, Any]
    ) -> FallbackChain:
        fallbacks = validated_data.pop("fallback_models", None)
        with saving():
            chain = super().update(instance, validated_data)
            if fallbacks is not None:
                chain.set_fallbacks(fallbacks)
        return chain


ADMISSION_PREFIX = "admission_"


class AdmissionPolicySerializer(serializers.Serializer[Any]):
    """The policy's admission settings, named as in ``[routing.admission]``.

    Every value is checked by the policy's own clean() (as in the admin and
    the TOML importer), so the messages are the same: these fields only read
    the JSON types. Keys it does not know are refused.
    """

    enabled = serializers.BooleanField(source="admission_enabled", required=False)
    flow_key = serializers.CharField(source="admission_flow_key", required=False)
    sizing = serializers.CharField(source="admission_sizing", required=False)
    default_output_tokens = serializers.IntegerField(
        source="admission_default_output_tokens", required=False
    )
    model_output_tokens = serializers.DictField(
        child=serializers.IntegerField(),
        source="admission_model_output_tokens",
        required=False,
        help_text="Output tokens assumed per model when a request sets no max_tokens.",
    )
    watermark_per_backend = serializers.FloatField(
        source="admission_watermark_per_backend", required=False
    )
    percentage_deviation_for_bounds = serializers.FloatField(
        source="admission_percentage_deviation_for_bounds", required=False
    )
    lower_bound_per_backend = serializers.FloatField(
        source="admission_lower_bound_per_backend", required=False, allow_null=True
    )
    upper_bound_per_backend = serializers.FloatField(
        source="admission_upper_bound_per_backend", required=False, allow_null=True
    )
    total_capacity = serializers.IntegerField(
        source="admission_total_capacity", required=False
    )
    flow_capacity = serializers.IntegerField(
        source="admission_flow_capacity", required=False
    )
    critical_reserved = serializers.IntegerField(
        source="admission_critical_reserved", required=False
    )
    queue_ttl = serializers.FloatField(source="admission_queue_ttl", required=False)
    critical_share = serializers.IntegerField(
        source="admission_critical_share",
        required=False,
        help_text="Share of the dispatches of critical requests while other "
        "levels wait too (0-100).",
    )
    default_share = serializers.IntegerField(
        source="admission_default_share", required=False
    )
    sheddable_share = serializers.IntegerField(
        source="admission_sheddable_share", required=False
    )
    stock_unit = serializers.ChoiceField(
        choices=["requests", "tokens"],
        source="admission_stock_unit",
        required=False,
        help_text="What the in-flight stock and the band count.",
    )
    watermark_tokens_per_backend = serializers.FloatField(
        source="admission_watermark_tokens_per_backend",
        required=False,
        allow_null=True,
    )
    model_weights = serializers.DictField(
        child=serializers.FloatField(),
        source="admission_model_weights",
        required=False,
        help_text="A model's weight in the fair queue (others weigh 1).",
    )

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = {
                str(name): ["Unknown field."]
                for name in data
                if name not in self.fields
            }
            if unknown:
                raise serializers.ValidationError(unknown)
        return super().to_internal_value(data)


class RoutingPolicySerializer(ModelCleanSerializer[RoutingPolicy]):
    """The global routing policy. Weights are used by the smart strategy, the
    fleet settings (points table, queues) by the fleet strategy.

    ``admission`` holds the admission control settings; an invalid one is
    reported under ``admission`` by its name, in the admin's words.
    """

    admission = AdmissionPolicySerializer(source="*", required=False)

    class Meta:
        model = RoutingPolicy
        fields = (
            "strategy",
            "weight_priority",
            "weight_load",
            "weight_latency",
            "max_retries",
            "admission",
            *FLEET_SETTING_NAMES,
            "context_shift_enabled",
            "context_shift_keep_last_messages",
            "context_shift_max_retries",
            "ensemble_opinions",
            "ensemble_critique_prompt",
            "ensemble_refine_prompt",
            "ensemble_step_timeout_seconds",
            "cache_anthropic_auto_breakpoints",
            "prefix_enabled",
            "prefix_block_chars",
            "prefix_max_imbalance",
            "prefix_max_imbalance_ratio",
            "prefix_cache_blocks",
            "prefix_session_keys",
            "prefix_session_ttl_seconds",
            "cache_enabled",
            "cache_ttl_seconds",
            "cache_scope",
            "cache_max_entry_bytes",
            "cache_only_deterministic",
            "updated_at",
        )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate(attrs)
        except serializers.ValidationError as error:
            raise serializers.ValidationError(_nest_admission(error.detail)) from None


def _nest_admission(detail: Any) -> Any:
    """Move the errors of ``admission_<name>`` fields under admission.<name>."""
    if not isinstance(detail, Mapping):
        return detail
    nested: dict[str, Any] = {}
    admission: dict[str, Any] = {}
    for name, messages in detail.items():
        if name.startswith(ADMISSION_PREFIX):
            admission[name.removeprefix(ADMISSION_PREFIX)] = messages
        else:
            nested[name] = messages
    if admission:
        nested["admission"] = admission
    return nested


class ModelSpecSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    context_length = serializers.IntegerField(allow_null=True)
    supports_vision = serializers.BooleanField(allow_null=True)
    supports_tools = serializers.BooleanField(allow_null=True)
    supports_json_mode = serializers.BooleanField(allow_null=True)
    loaded = serializers.BooleanField()
    enabled = serializers.BooleanField()
    size_gb = serializers.FloatField(allow_null=True)
    vram_gb = serializers.FloatField(allow_null=True)
    loaded_context = serializers.IntegerField(allow_null=True)
    parameters_b = serializers.FloatField(allow_null=True)
    max_concurrency = serializers.IntegerField(allow_null=True)
    kv_bytes_per_token = serializers.IntegerField(allow_null=True)


class BackendSpecSerializer(serializers.Serializer[Any]):
    """A backend as the router sees it. The API key itself is never included."""

    id = serializers.IntegerField(allow_null=True)
    name = serializers.CharField()
    base_url = serializers.CharField()
    kind = serializers.CharField()
    has_api_key = serializers.SerializerMethodField()
    enabled = serializers.BooleanField()
    priority = serializers.IntegerField()
    max_concurrency = serializers.IntegerField(allow_null=True)
    request_timeout = serializers.FloatField()
    status = serializers.CharField()
    avg_latency_ms = serializers.FloatField(allow_null=True)
    memory_ceiling_gb = serializers.FloatField(allow_null=True)
    memory_used_gb = serializers.FloatField(allow_null=True)
    memory_total_gb = serializers.FloatField(
        allow_null=True, help_text="The memory the node last reported (GB)."
    )
    memory_reported_used_gb = serializers.FloatField(
        allow_null=True,
        help_text="What the node last reported in use, listed models or not (GB).",
    )
    memory_pressure = serializers.BooleanField()
    slots = serializers.IntegerField(allow_null=True)
    tier = serializers.CharField()
    models = ModelSpecSerializer(many=True)

    def get_has_api_key(self, backend: BackendSpec) -> bool:
        return bool(backend.api_key)


class WeightsSerializer(serializers.Serializer[Any]):
    priority = serializers.IntegerField()
    load = serializers.IntegerField()
    latency = serializers.IntegerField()


class EffectivePolicySerializer(serializers.Serializer[Any]):
    strategy = serializers.CharField()
    weights = WeightsSerializer()
    max_retries = serializers.IntegerField()
    fleet = serializers.DictField(
        child=serializers.FloatField(),
        help_text="The fleet strategy's settings in force (hold_seconds with the "
        "strategy's preset applied).",
    )
    overrides = serializers.DictField(
        child=serializers.CharField(),
        help_text="Environment variables that override the stored policy.",
    )


class EffectiveConfigSerializer(serializers.Serializer[Any]):
    """What the router uses: stored configuration with environment overrides."""

    version = serializers.IntegerField()
    policy = EffectivePolicySerializer()
    backends = BackendSpecSerializer(many=True)
    aliases = serializers.DictField(
        child=serializers.CharField(), help_text="Exact aliases: name -> target."
    )
    alias_patterns = serializers.DictField(
        child=serializers.CharField(),
        help_text="Pattern aliases (claude-*), in the order they are matched "
        "(longest first): pattern -> target.",
    )
    fallbacks = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField())
    )
    splits = serializers.DictField(
        child=serializers.DictField(),
        help_text='Weighted splits: name -> {"sticky", "targets": {model: weight}}.',
    )
    alias_problems = serializers.ListField(child=serializers.CharField())
