"""The configuration history over the API: list versions, read one, revert to one.

``GET config/versions`` lists the versions newest first, each with who made it
and its structural difference from the version before; ``GET
config/versions/{n}`` adds the version's TOML export; ``POST
config/versions/{n}/revert`` (``{"dry_run": true}`` to preview) makes the
configuration what it was at version n, as a new version. A version that
cannot be applied answers 400 with every problem, like the import, and
changes nothing.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import generics, serializers
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from routing.api.config_file import (
    ConfigImportView,
    ConfigProblemsSerializer,
    problems_response,
)
from routing.config_file import ConfigError
from routing.history.revert import VersionNotFound, find_version, revert_to
from routing.models import ConfigRevision


class ConfigVersionSerializer(serializers.ModelSerializer[ConfigRevision]):
    version = serializers.IntegerField(source="number")
    created = serializers.DateTimeField(source="created_at")
    diff = serializers.JSONField(
        help_text='Changes from the version before: {"path": [...], "change": '
        '"added" | "removed" | "changed", "before", "after"}; a secret\'s change '
        'has "secret": true and no values.'
    )

    class Meta:
        model = ConfigRevision
        fields: tuple[str, ...] = (
            "version",
            "created",
            "author",
            "via",
            "reverted_to",
            "diff",
        )


class ConfigVersionDetailSerializer(ConfigVersionSerializer):
    toml = serializers.CharField(
        source="snapshot", help_text="The configuration at this version (export)."
    )

    class Meta(ConfigVersionSerializer.Meta):
        fields = (*ConfigVersionSerializer.Meta.fields, "toml")


class RevertOptionsSerializer(serializers.Serializer[Any]):
    dry_run = serializers.BooleanField(
        default=False, help_text="Report what would change; save nothing."
    )


class RevertResultSerializer(serializers.Serializer[Any]):
    reverted_to = serializers.IntegerField()
    version = serializers.IntegerField(
        allow_null=True,
        help_text="The new version; null for a dry run or when nothing changed.",
    )
    dry_run = serializers.BooleanField()
    changes = serializers.JSONField(help_text="From the configuration before.")
    warnings = serializers.ListField(child=serializers.CharField())


class ConfigVersionListView(generics.ListAPIView[ConfigRevision]):
    """Versions of the configuration, newest first."""

    queryset = ConfigRevision.objects.defer("snapshot", "secret_marks").order_by(
        "-number"
    )
    serializer_class = ConfigVersionSerializer
    filter_backends = ()


class ConfigVersionDetailView(generics.RetrieveAPIView[ConfigRevision]):
    """One version, with its TOML export."""

    serializer_class = ConfigVersionDetailSerializer

    def get_object(self) -> ConfigRevision:
        try:
            return find_version(self.kwargs["number"])
        except VersionNotFound as error:
            raise NotFound(str(error)) from None


class ConfigVersionRevertView(APIView):
    """Make the configuration what it was at a version (recorded as a new one)."""

    # A revert is an import of the old version: it needs what an import needs.
    required_permissions = ConfigImportView.required_permissions

    @extend_schema(
        request=RevertOptionsSerializer,
        responses={
            200: RevertResultSerializer,
            400: OpenApiResponse(ConfigProblemsSerializer),
        },
    )
    def post(self, request: Request, number: int) -> Response:
        options = RevertOptionsSerializer(data=request.data or {})
        options.is_valid(raise_exception=True)
        try:
            result = revert_to(number, dry_run=options.validated_data["dry_run"])
        except VersionNotFound as error:
            raise NotFound(str(error)) from None
        except ConfigError as error:
            return problems_response(error)
        return Response(
            {
                "reverted_to": result.target,
                "version": result.version,
                "dry_run": result.dry_run,
                "changes": result.changes,
                "warnings": result.warnings,
            }
        )
