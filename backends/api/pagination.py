"""The management API's pagination: DRF's limit/offset, within bounds."""

from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

# Past this, an offset cannot reach a row anyway; beyond 2**63 the database
# would fail to bind it.
MAX_OFFSET = 2**40


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """``?limit=&offset=`` pages of at most 1000 rows (100 by default)."""

    max_limit = 1000

    def get_offset(self, request: Request) -> int:
        return min(super().get_offset(request), MAX_OFFSET)
