"""Serializers for backends and their models, and the base that validates like the admin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rest_framework import serializers

from backends.models import (
    CAPABILITY_FIELDS,
    HEALTH_FIELDS,
    LOADED_FIELDS,
    SIZE_FIELDS,
    Backend,
    BackendModel,
    Worker,
)
from backends.workers import MODEL_RULE_FIELDS
from nexus_lib.serializers import ModelCleanSerializer, saving


class BackendSerializer(ModelCleanSerializer[Backend]):
    """A backend. ``api_key`` is write-only: send it to set it, "" to clear it."""

    api_key = serializers.CharField(
        write_only=True,
        required=False,
        allow_blank=True,
        max_length=500,
        style={"input_type": "password"},
        help_text="Write-only. Omit to keep the current key; send an empty string "
        "to remove it.",
    )
    has_api_key = serializers.BooleanField(read_only=True)
    model_count = serializers.IntegerField(read_only=True, default=0)

    read_only_hints: ClassVar[Mapping[str, str]] = {
        "status": "Health checks set it; to stop or restart traffic, POST to "
        "/api/v1/backends/{id}/drain or /undrain.",
        "is_demo": "Demo backends are managed by nexus_run.",
    }

    class Meta:
        model = Backend
        fields = (
            "id",
            "name",
            "base_url",
            "kind",
            "api_key",
            "has_api_key",
            "enabled",
            "priority",
            "max_concurrency",
            "request_timeout",
            "memory_ceiling_gb",
            "tier",
            "prefix_cache_tokens",
            "is_demo",
            "model_count",
            *HEALTH_FIELDS,
            "created_at",
            "updated_at",
        )
        read_only_fields = ("is_demo", *HEALTH_FIELDS)


class BackendModelSerializer(ModelCleanSerializer[BackendModel]):
    """A model served by a backend, with its capabilities."""

    backend_name = serializers.CharField(source="backend.name", read_only=True)

    class Meta:
        model = BackendModel
        fields = (
            "id",
            "backend",
            "backend_name",
            "name",
            *CAPABILITY_FIELDS,
            *SIZE_FIELDS,
            "max_concurrency",
            "loaded",
            *LOADED_FIELDS,
            "discovered",
            "enabled",
            "manual_fields",
            "created_at",
            "updated_at",
        )
        read_only_fields = ("discovered", "manual_fields", *LOADED_FIELDS)

    def update(
        self, instance: BackendModel, validated_data: dict[str, Any]
    ) -> BackendModel:
        # As in the admin: what an operator changes, model discovery keeps.
        instance.claim_fields(
            name
            for name, value in validated_data.items()
            if value != getattr(instance, name)
        )
        return super().update(instance, validated_data)


class RefusedModelSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    reason = serializers.CharField()


class WorkerSerializer(ModelCleanSerializer[Worker]):
    """A relay worker. Its secret is shown once: on create and on rotate.

    ``allowed_models`` and ``may_shadow_direct_backends`` say which of the
    models it announces it is sent; ``refused_models`` lists the others, as
    of its last registration or models_update.
    """

    connected = serializers.BooleanField(source="is_connected", read_only=True)
    backend: serializers.SlugRelatedField[Backend] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    refused_models = RefusedModelSerializer(
        many=True,
        read_only=True,
        help_text="Models it announced and is not sent, with why (at most 100).",
    )

    read_only_hints: ClassVar[Mapping[str, str]] = {
        "name": "A worker's name is its backend's name in routing: create "
        "another worker for another name.",
        "is_active": "Revoke with POST /api/v1/workers/{id}/revoke; rotate the "
        "secret to let it back.",
    }

    class Meta:
        model = Worker
        fields: tuple[str, ...] = (
            "id",
            "name",
            "prefix",
            "is_active",
            "connected",
            "backend",
            *MODEL_RULE_FIELDS,
            "refused_models",
            "last_seen_at",
            "last_address",
            "created_at",
        )
        read_only_fields = (
            "prefix",
            "is_active",
            "last_seen_at",
            "last_address",
            "created_at",
        )

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        if self.instance is not None:
            fields["name"].read_only = True
        return fields

    def update(self, instance: Worker, validated_data: dict[str, Any]) -> Worker:
        # Only what was sent: the worker's consumer writes its connection
        # fields meanwhile, which a whole-row save would put back.
        with saving():
            for name, value in validated_data.items():
                setattr(instance, name, value)
            instance.save(update_fields=tuple(validated_data))
            if set(MODEL_RULE_FIELDS) & set(validated_data):
                instance.refresh_models_on_commit()
        return instance


class NewWorkerSerializer(WorkerSerializer):
    """A worker with its secret: the only time the secret is shown."""

    secret = serializers.CharField(
        read_only=True,
        help_text="For nexus-worker --secret (nxw-...). Only its hash is stored: "
        "copy it now.",
    )

    class Meta(WorkerSerializer.Meta):
        fields = (*WorkerSerializer.Meta.fields, "secret")


class DrainWorkerSerializer(serializers.Serializer[Any]):
    timeout = serializers.FloatField(
        default=60.0,
        min_value=0.0,
        max_value=86_400.0,
        help_text="Seconds the worker lets its requests in flight finish.",
    )
