"""GET /dashboard/fleet: the fleet scheduler's state in this serving process.

Apart from /health (gateway/views.py): a staff page of the control plane,
which a gateway-only process (NEXUS_ROLE=gateway) never loads.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from gateway.process import current_gateway
from usage.access import dashboard_viewer_required


@never_cache
@require_safe
@dashboard_viewer_required
def fleet(request: HttpRequest) -> JsonResponse:
    """The fleet scheduler's state in this serving process (the dashboard)."""
    return JsonResponse(dict(current_gateway().fleet.as_dict()))
