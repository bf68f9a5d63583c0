from __future__ import annotations

from django.urls import path

from usage.api.views import LiveUsageView, TokenUsageView, UsageStatsView

urlpatterns = [
    path("usage/tokens", TokenUsageView.as_view(), name="usage-tokens"),
    path("usage/stats", UsageStatsView.as_view(), name="usage-stats"),
    path("usage/live", LiveUsageView.as_view(), name="usage-live"),
]
