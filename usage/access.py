"""Who sees the dashboard and the usage stream: roles with the usage view.

The dashboard shows every key's and team's spend and the fleet's load, so it
is for the global roles (viewer, operator, key-admin, admin: they view
``usage.TokenUsage``); a team admin sees their teams' usage in the admin and
the API instead.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

DASHBOARD_PERMISSION = "usage.view_tokenusage"


def may_see_dashboard(user: Any) -> bool:
    return bool(
        user is not None
        and user.is_authenticated
        and user.is_active
        and user.is_staff
        and user.has_perm(DASHBOARD_PERMISSION)
    )


def dashboard_viewer_required(
    view: Callable[..., HttpResponse],
) -> Callable[..., HttpResponse]:
    """Send anonymous browsers to the login page; refuse staff without the role."""
    # Here, not at the top: a gateway-only process (NEXUS_ROLE=gateway) imports
    # this module (the usage stream's check) and must not load the admin.
    from django.contrib.admin.views.decorators import (
        staff_member_required,
    )

    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not may_see_dashboard(request.user):
            raise PermissionDenied
        return view(request, *args, **kwargs)

    return staff_member_required(checked)
