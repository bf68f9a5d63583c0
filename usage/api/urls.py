from __future__ import annotations

from django.urls import path

from usage.api.views import TokenUsageView, UsageStatsView

urlpatterns = [
    path("usage/tokens", TokenUsageView.as_view(), name="usage-tokens"),
    path("usage/stats", UsageStatsView.as_view(), name="usage-stats"),
]
