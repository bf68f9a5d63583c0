from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from usage.api.views import (
    ApiKeyViewSet,
    ModelPriceViewSet,
    TeamViewSet,
    TokenUsageView,
    UsageStatsView,
)

router = SimpleRouter(trailing_slash=False)
router.register("keys", ApiKeyViewSet, basename="api-key")
router.register("prices", ModelPriceViewSet, basename="model-price")
router.register("teams", TeamViewSet, basename="team")

urlpatterns = [
    path("usage/tokens", TokenUsageView.as_view(), name="usage-tokens"),
    path("usage/stats", UsageStatsView.as_view(), name="usage-stats"),
    *router.urls,
]
