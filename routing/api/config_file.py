"""TOML configuration over the API: export it, import it (dry run, replace).

The same reader, checks and importer as ``manage.py nexus_import_config`` and
``nexus_export_config`` (routing/config_file), with one difference: the API
never reads the server's environment, so ``api_key_env`` names a variable
that is not set (send ``api_key`` instead). A staff user may configure the
gateway, not read its process's secrets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from nexus_lib.authorship import VIA_IMPORT
from nexus_lib.parsers import BoundedJSONParser
from nexus_lib.permissions import requires
from routing.config_file import ConfigError, export_config, import_config, read_config
from routing.history.recording import recording_changes

TOML_MEDIA_TYPE = "application/toml"
SOURCE = "request body"
# Far above any real configuration; Django's DATA_UPLOAD_MAX_MEMORY_SIZE
# (2.5 MB) bounds the body before this.
MAX_TOML_CHARS = 1_000_000


class TomlParser(BaseParser):
    """A raw TOML body, as ``{"toml": text}``."""

    media_type = TOML_MEDIA_TYPE

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> dict[str, str]:
        data = stream.read() if stream is not None else b""
        try:
            return {"toml": data.decode("utf-8")}
        except UnicodeDecodeError as error:
            raise ParseError(
                f"The body is not UTF-8 (byte {error.start}); TOML must be UTF-8."
            ) from None


class ConfigImportSerializer(serializers.Serializer[Any]):
    toml = serializers.CharField(
        max_length=MAX_TOML_CHARS,
        allow_blank=True,
        trim_whitespace=False,
        help_text="The configuration file's text.",
    )
    dry_run = serializers.BooleanField(
        default=False, help_text="Check and report what would change; save nothing."
    )
    replace = serializers.BooleanField(
        default=False,
        help_text="Also delete what the file does not mention (demo backends "
        "excepted) and reset routing keys it leaves out.",
    )


class TableChangesSerializer(serializers.Serializer[Any]):
    created = serializers.IntegerField()
    updated = serializers.IntegerField()
    deleted = serializers.IntegerField()
    unchanged = serializers.IntegerField()


class ImportSummarySerializer(serializers.Serializer[Any]):
    dry_run = serializers.BooleanField()
    warnings = serializers.ListField(
        child=serializers.CharField(),
        help_text="Imported anyway: e.g. a disabled backend's key variable unset.",
    )
    tables = serializers.DictField(child=TableChangesSerializer())


class ConfigProblemsSerializer(serializers.Serializer[Any]):
    detail = serializers.CharField()
    problems = serializers.ListField(child=serializers.CharField())


class ConfigImportView(APIView):
    """Import a TOML configuration: checked whole first, then applied at once.

    Send JSON (``{"toml": "...", "dry_run": true, "replace": false}``) or the
    file itself as ``Content-Type: application/toml`` with ``?dry_run=true``
    and ``?replace=true`` in the query string. Every problem is listed in one
    400 answer, and then nothing is changed.
    """

    # A file sets backends, routing, keys' limits, teams and prices at once.
    required_permissions = requires(
        write=(
            "backends.change_backend",
            "routing.change_routingpolicy",
            "usage.change_apikey",
            "usage.change_team",
            "usage.change_modelprice",
        )
    )

    parser_classes = (BoundedJSONParser, TomlParser)

    @extend_schema(
        request={
            "application/json": ConfigImportSerializer,
            TOML_MEDIA_TYPE: OpenApiTypes.STR,
        },
        responses={
            200: ImportSummarySerializer,
            400: OpenApiResponse(ConfigProblemsSerializer),
        },
    )
    def post(self, request: Request) -> Response:
        data = request.data
        if request.content_type.startswith(TOML_MEDIA_TYPE):
            data = {
                "toml": data.get("toml", "") if isinstance(data, Mapping) else "",
                "dry_run": request.query_params.get("dry_run", False),
                "replace": request.query_params.get("replace", False),
            }
        options = ConfigImportSerializer(data=data)
        options.is_valid(raise_exception=True)
        params = options.validated_data
        try:
            config = read_config(params["toml"], SOURCE, environ={})
            with recording_changes(via=VIA_IMPORT):
                summary = import_config(
                    config,
                    source=SOURCE,
                    replace=params["replace"],
                    dry_run=params["dry_run"],
                )
        except ConfigError as error:
            return problems_response(error)
        return Response(summary.as_dict())


def problems_response(error: ConfigError) -> Response:
    """The 400 answer listing every problem of a configuration not applied."""
    count = len(error.problems)
    return Response(
        {
            "detail": f"{count} problem{'s' if count != 1 else ''} in the "
            "configuration; nothing was changed.",
            "problems": error.problems,
        },
        status=400,
    )


class ConfigExportView(APIView):
    """The configuration as a TOML file that the import reads back unchanged.

    API keys are never written; demo backends are left out.
    """

    required_permissions = requires(
        read=(
            "backends.view_backend",
            "routing.view_routingpolicy",
            "usage.view_apikey",
            "usage.view_team",
        )
    )

    @extend_schema(
        responses={(200, TOML_MEDIA_TYPE): OpenApiTypes.STR},
    )
    def get(self, request: Request) -> HttpResponse:
        response = HttpResponse(
            export_config(), content_type=f"{TOML_MEDIA_TYPE}; charset=utf-8"
        )
        response["Content-Disposition"] = 'attachment; filename="nexus.toml"'
        return response
