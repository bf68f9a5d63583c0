from __future__ import annotations

from django.urls import path

from routing.api.views import RouteExplainView

urlpatterns = [
    path("route/explain", RouteExplainView.as_view(), name="route-explain"),
]
