"""The response cache's API: its hit rates, and purges (docs/caching.md)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from nexus_lib.permissions import requires
from routing.cache_purge import cache_report, purge_cache
from routing.models import RoutingPolicy


class CachePurgeSerializer(serializers.Serializer[Any]):
    """What to purge: a model's answers, a key's, or (neither) every answer."""

    model = serializers.CharField(required=False, allow_blank=True, max_length=200)
    key = serializers.CharField(required=False, allow_blank=True, max_length=32)


class CacheView(APIView):
    """The response cache's settings and its hits per model and per key."""

    required_permissions = requires(read=("routing.view_routingpolicy",))

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        stored = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
        policy = (stored or RoutingPolicy()).cache_policy()
        settings = {
            "enabled": policy.enabled,
            "ttl_seconds": policy.ttl_seconds,
            "scope": policy.scope,
            "max_entry_bytes": policy.max_entry_bytes,
            "only_deterministic": policy.only_deterministic,
        }
        return Response({"settings": settings, **cache_report()})


class CachePurgeView(APIView):
    """Purge cached answers: ``{"model": ...}``, ``{"key": <prefix>}`` or ``{}``."""

    required_permissions = requires(write=("routing.change_routingpolicy",))

    @extend_schema(request=CachePurgeSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request) -> Response:
        serializer = CachePurgeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        purged = purge_cache(
            model=data.get("model", ""), key_prefix=data.get("key", "")
        )
        return Response(purged)
