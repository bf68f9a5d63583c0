"""CRUD endpoints for backends and the models they serve."""

from __future__ import annotations

import django_filters
from rest_framework import viewsets
from rest_framework.permissions import IsAdminUser

from backends.api.serializers import BackendModelSerializer, BackendSerializer
from backends.models import Backend, BackendModel


class BackendViewSet(viewsets.ModelViewSet[Backend]):
    """Model servers Nexus routes to. The API key is write-only."""

    queryset = Backend.objects.with_model_count()
    serializer_class = BackendSerializer
    permission_classes = (IsAdminUser,)
    filterset_fields = ("name", "kind", "enabled", "status", "is_demo")
    ordering_fields = ("name", "priority", "status", "created_at")
    ordering = ("priority", "name")


class BackendModelFilter(django_filters.FilterSet):
    backend_name = django_filters.CharFilter(field_name="backend__name")

    class Meta:
        model = BackendModel
        fields = ("backend", "backend_name", "name", "enabled", "loaded")


class BackendModelViewSet(viewsets.ModelViewSet[BackendModel]):
    """Models served by backends; filter by ``backend`` (id) or ``backend_name``."""

    queryset = BackendModel.objects.select_related("backend")
    serializer_class = BackendModelSerializer
    permission_classes = (IsAdminUser,)
    filterset_class = BackendModelFilter
    ordering_fields = ("name", "backend__name", "created_at")
    ordering = ("backend__priority", "backend__name", "name")
