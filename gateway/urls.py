"""The management API's live endpoints, answered by this serving process."""

from __future__ import annotations

from django.urls import path

from gateway.api import LiveUsageView, RouteExplainView

urlpatterns = [
    path("route/explain", RouteExplainView.as_view(), name="route-explain"),
    # Listed with the usage endpoints, but it reads this process's gateway.
    path("usage/live", LiveUsageView.as_view(), name="usage-live"),
]
