"""The management API's JSON parser: nesting too deep is a 400, not a 500.

DRF's ``JSONParser`` lets the ``RecursionError`` of a body nested thousands of
levels deep escape as a server error; no configuration Nexus takes nests more
than a few levels, so such a body is refused as the client's mistake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

TOO_DEEP = "JSON parse error - the body is nested too deeply."


class BoundedJSONParser(JSONParser):
    """``JSONParser`` that answers a too-deeply nested body with a 400."""

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(TOO_DEEP) from None
