"""The management API of splits, shadows and hedging (routing.traffic)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers, viewsets

from nexus_lib.serializers import ModelCleanSerializer, saving
from routing.core.traffic import SIDES_LIMIT
from routing.models import Hedging, Shadow, SplitTarget, TrafficSplit
from routing.traffic import SHADOW_FIELDS


class TrafficSplitSerializer(ModelCleanSerializer[TrafficSplit]):
    """A client-facing name shared over several models by weight."""

    targets = serializers.DictField(
        child=serializers.IntegerField(),
        source="side_weights",
        required=False,
        help_text='Model = weight, in order: {"llama3:8b": 90, "qwen2.5:7b": 10}. '
        "Omitted on update: kept as they are.",
    )

    class Meta:
        model = TrafficSplit
        fields = ("id", "name", "sticky", "targets", "created_at", "updated_at")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        targets = attrs.get("side_weights")
        if targets is None:
            if self.instance is None:
                raise serializers.ValidationError(
                    {"targets": ["A split needs at least one target."]}
                )
            return attrs
        if not targets:
            raise serializers.ValidationError(
                {"targets": ["A split needs at least one target."]}
            )
        if len(targets) > SIDES_LIMIT:
            raise serializers.ValidationError(
                {"targets": [f"A split has at most {SIDES_LIMIT} targets."]}
            )
        split = self.build_candidate(attrs)
        errors: dict[str, list[str]] = {}
        for position, (model, weight) in enumerate(targets.items()):
            target = SplitTarget(
                split=split, position=position, model=model, weight=weight
            )
            try:
                # The split may not be saved yet: its own checks ran above.
                target.full_clean(exclude=["split"])
            except DjangoValidationError as error:
                errors[model] = [
                    message
                    for messages in error.message_dict.values()
                    for message in messages
                ]
        if errors:
            raise serializers.ValidationError({"targets": errors})
        return attrs

    def create(self, validated_data: dict[str, Any]) -> TrafficSplit:
        targets = validated_data.pop("side_weights", {})
        with saving():
            split = super().create(validated_data)
            split.set_targets(targets)
        return split

    def update(
        self, instance: TrafficSplit, validated_data: dict[str, Any]
    ) -> TrafficSplit:
        targets = validated_data.pop("side_weights", None)
        with saving():
            split = super().update(instance, validated_data)
            if targets is not None:
                split.set_targets(targets)
        return split


class ShadowSerializer(ModelCleanSerializer[Shadow]):
    """Mirror a share of one model's requests to another, to compare answers."""

    class Meta:
        model = Shadow
        fields = ("id", *SHADOW_FIELDS, "created_at", "updated_at")


class HedgingSerializer(ModelCleanSerializer[Hedging]):
    """When one model's requests get a second attempt at another backend."""

    class Meta:
        model = Hedging
        fields = (
            "id",
            "model",
            "after",
            "after_ms",
            "max_extra",
            "max_body_bytes",
            "created_at",
            "updated_at",
        )


class TrafficSplitViewSet(viewsets.ModelViewSet[TrafficSplit]):
    """Client-facing names shared over several models by weight."""

    queryset = TrafficSplit.objects.prefetch_related("targets")
    serializer_class = TrafficSplitSerializer
    filterset_fields = ("name",)
    ordering = ("name",)


class ShadowViewSet(viewsets.ModelViewSet[Shadow]):
    """Models whose requests are partly mirrored to another model."""

    queryset = Shadow.objects.all()
    serializer_class = ShadowSerializer
    filterset_fields = ("model",)
    ordering = ("model",)


class HedgingViewSet(viewsets.ModelViewSet[Hedging]):
    """Models whose slow first attempts get a second one."""

    queryset = Hedging.objects.all()
    serializer_class = HedgingSerializer
    filterset_fields = ("model",)
    ordering = ("model",)
