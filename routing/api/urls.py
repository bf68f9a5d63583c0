from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from routing.api.views import (
    AliasViewSet,
    EffectiveConfigView,
    FallbackChainViewSet,
    RouteExplainView,
    RoutingPolicyView,
)

router = SimpleRouter(trailing_slash=False)
router.register("aliases", AliasViewSet, basename="alias")
router.register("fallback-chains", FallbackChainViewSet, basename="fallback-chain")

urlpatterns = [
    path("route/explain", RouteExplainView.as_view(), name="route-explain"),
    path("policy", RoutingPolicyView.as_view(), name="routing-policy"),
    path("config", EffectiveConfigView.as_view(), name="effective-config"),
    *router.urls,
]
