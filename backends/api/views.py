"""CRUD endpoints for backends and the models they serve."""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from backends.api.serializers import (
    BackendModelSerializer,
    BackendSerializer,
    DrainWorkerSerializer,
    NewWorkerSerializer,
    WorkerSerializer,
)
from backends.health import check_all
from backends.models import Backend, BackendModel, BackendQuerySet, Worker


class BackendViewSet(viewsets.ModelViewSet[Backend]):
    """Model servers Nexus routes to. The API key is write-only."""

    queryset = Backend.objects.with_model_count()
    serializer_class = BackendSerializer
    filterset_fields = ("name", "kind", "enabled", "status", "is_demo")
    ordering_fields = ("name", "priority", "status", "created_at")
    ordering = ("priority", "name")

    @extend_schema(request=None, responses=BackendSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Send the backend no new requests; requests in flight finish.

        Idempotent: draining a draining backend changes nothing.
        """
        backend = self.get_object()
        self._this(backend).drain()
        return self._answer(backend)

    @extend_schema(request=None, responses=BackendSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str | None = None) -> Response:
        """Check a draining backend's health now, and let it take requests if good.

        As the admin's "Undrain" does: the status becomes what the probe finds.
        A backend that is not draining is left as it is.
        """
        backend = self.get_object()
        check_all(self._this(backend).undrain(), include_disabled=True)
        return self._answer(backend)

    def _this(self, backend: Backend) -> BackendQuerySet:
        return Backend.objects.filter(pk=backend.pk)

    def _answer(self, backend: Backend) -> Response:
        fresh = self.get_queryset().get(pk=backend.pk)
        return Response(self.get_serializer(fresh).data)


class BackendModelFilter(django_filters.FilterSet):
    backend_name = django_filters.CharFilter(field_name="backend__name")

    class Meta:
        model = BackendModel
        fields = ("backend", "backend_name", "name", "enabled", "loaded")


class BackendModelViewSet(viewsets.ModelViewSet[BackendModel]):
    """Models served by backends; filter by ``backend`` (id) or ``backend_name``."""

    queryset = BackendModel.objects.select_related("backend")
    serializer_class = BackendModelSerializer
    filterset_class = BackendModelFilter
    ordering_fields = ("name", "backend__name", "created_at")
    ordering = ("backend__priority", "backend__name", "name")


class WorkerViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet[Worker],
):
    """Relay workers (GPU boxes behind NAT running nexus-worker): create, list,
    change which models they may serve, rotate, revoke, drain.

    A worker is sent only the models its ``allowed_models`` admit (names and
    globs; empty: any) and, unless ``may_shadow_direct_backends``, none that a
    direct backend lists; ``refused_models`` shows the others it announced.

    Only a hash of each secret is stored: the secret is in the answer to the
    create (and rotate) request and nowhere else. A revoked worker is
    disconnected (close 4001) and refused from then on.
    """

    queryset = Worker.objects.select_related("backend")
    serializer_class = WorkerSerializer
    filterset_fields = ("name", "prefix", "is_active")
    ordering_fields = ("name", "created_at", "last_seen_at")
    ordering = ("name",)

    @extend_schema(responses={201: NewWorkerSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker, raw = Worker.objects.create_worker(
            serializer.validated_data["name"],
            serializer.validated_data.get("allowed_models", ""),
            serializer.validated_data.get("may_shadow_direct_backends", False),
        )
        data = {**WorkerSerializer(worker).data, "secret": raw}
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=NewWorkerSerializer)
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        """Give the worker a new secret (shown once); the old one stops working
        and a connected worker is disconnected."""
        worker = self.get_object()
        raw = worker.rotate_secret()
        return Response({**WorkerSerializer(worker).data, "secret": raw})

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Refuse this worker's secret from now on and disconnect it (idempotent)."""
        worker = self.get_object()
        Worker.objects.filter(pk=worker.pk).revoke()
        worker.refresh_from_db()
        return Response(self.get_serializer(worker).data)

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def refresh(self, request: Request, pk: str | None = None) -> Response:
        """Ask the connected worker to list its local models again now."""
        worker = self.get_object()
        Worker.objects.filter(pk=worker.pk).refresh_models()
        return Response(self.get_serializer(worker).data)

    @extend_schema(request=DrainWorkerSerializer, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """No new requests to this worker; it finishes those in flight (up to
        ``timeout`` seconds) and exits."""
        worker = self.get_object()
        params = DrainWorkerSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        Worker.objects.filter(pk=worker.pk).drain(params.validated_data["timeout"])
        worker.refresh_from_db()
        return Response(self.get_serializer(worker).data)
