from __future__ import annotations

from dataclasses import asdict
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from nexus_lib.permissions import requires
from routing.api.serializers import (
    AliasSerializer,
    EffectiveConfigSerializer,
    FallbackChainSerializer,
    RoutingPolicySerializer,
)
from routing.models import Alias, FallbackChain, RoutingPolicy
from routing.past_requests import explain_request
from routing.snapshot import build_snapshot, read_policy_overrides


class AliasViewSet(viewsets.ModelViewSet[Alias]):
    """Public model names that route to another model (single level)."""

    queryset = Alias.objects.all()
    serializer_class = AliasSerializer
    filterset_fields = ("name", "target")
    ordering_fields = ("name", "target", "updated_at")
    ordering = ("name",)


class FallbackChainViewSet(viewsets.ModelViewSet[FallbackChain]):
    """Models to try, in order, when a model cannot be served."""

    queryset = FallbackChain.objects.prefetch_related("steps")
    serializer_class = FallbackChainSerializer
    filterset_fields = ("model",)
    ordering_fields = ("model", "updated_at")
    ordering = ("model",)


class RoutingPolicyView(generics.RetrieveUpdateAPIView[RoutingPolicy]):
    """The single, global routing policy (the defaults until first saved).

    Environment overrides (NEXUS_ROUTING_*) are not applied here; see
    /api/v1/config for what the router actually uses.
    """

    serializer_class = RoutingPolicySerializer

    def get_object(self) -> RoutingPolicy:
        stored = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
        return stored or RoutingPolicy()


class EffectiveConfigView(APIView):
    """The configuration the router uses, read now, with secrets left out.

    Stored backends, models, aliases, fallback chains, splits and policy, with the
    NEXUS_ROUTING_* environment overrides of this process applied.
    """

    required_permissions = requires(read=("routing.view_routingpolicy",))

    @extend_schema(responses=EffectiveConfigSerializer)
    def get(self, request: Request) -> Response:
        snapshot = build_snapshot()
        policy = snapshot.policy
        config: dict[str, Any] = {
            "version": snapshot.version,
            "policy": {
                "strategy": policy.strategy.value,
                "weights": policy.weights,
                "max_retries": policy.max_retries,
                "fleet": {
                    **asdict(policy.fleet),
                    "hold_seconds": policy.hold_seconds,
                },
                "overrides": read_policy_overrides(),
            },
            "backends": snapshot.backends,
            "aliases": dict(snapshot.aliases),
            "alias_patterns": snapshot.alias_patterns.as_dict(),
            "fallbacks": {
                model: list(steps) for model, steps in snapshot.fallbacks.items()
            },
            "splits": {
                name: {
                    "sticky": split.sticky,
                    "targets": {side.model: side.weight for side in split.sides},
                }
                for name, split in snapshot.splits.items()
            },
            "alias_problems": list(snapshot.alias_problems),
        }
        return Response(EffectiveConfigSerializer(config).data)


class PastRequestExplainView(APIView):
    """How a request already served was routed, from its usage record.

    A list (a client may reuse an id), newest first: the served model and
    backend, status, latency and tokens, the split side, whether it was
    hedged or answered from the cache, and the decision as recorded then
    (candidates with their scores, exclusions, retry order). 404 when no
    usage record has that id (usage is recorded within seconds, and kept
    NEXUS_USAGE_RECORD_RETENTION_HOURS).
    """

    # The decision and the usage record's figures: what may read usage.
    required_permissions = requires(
        read=("usage.view_usagerecord", "routing.view_routingpolicy")
    )

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, request_id: str) -> Response:
        found = explain_request(request_id)
        if not found:
            return Response(
                {"detail": f"No served request with id '{request_id}'."}, status=404
            )
        return Response({"request_id": request_id, "requests": found})
