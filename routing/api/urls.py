from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from routing.api.cache import CachePurgeView, CacheView
from routing.api.config_file import ConfigExportView, ConfigImportView
from routing.api.history import (
    ConfigVersionDetailView,
    ConfigVersionListView,
    ConfigVersionRevertView,
)
from routing.api.views import (
    AliasViewSet,
    EffectiveConfigView,
    FallbackChainViewSet,
    RoutingPolicyView,
)

router = SimpleRouter(trailing_slash=False)
router.register("aliases", AliasViewSet, basename="alias")
router.register("fallback-chains", FallbackChainViewSet, basename="fallback-chain")

urlpatterns = [
    path("policy", RoutingPolicyView.as_view(), name="routing-policy"),
    path("config", EffectiveConfigView.as_view(), name="effective-config"),
    path("cache", CacheView.as_view(), name="cache"),
    path("cache/purge", CachePurgeView.as_view(), name="cache-purge"),
    path("config/import", ConfigImportView.as_view(), name="config-import"),
    path("config/export", ConfigExportView.as_view(), name="config-export"),
    path(
        "config/versions", ConfigVersionListView.as_view(), name="config-version-list"
    ),
    path(
        "config/versions/<int:number>",
        ConfigVersionDetailView.as_view(),
        name="config-version-detail",
    ),
    path(
        "config/versions/<int:number>/revert",
        ConfigVersionRevertView.as_view(),
        name="config-version-revert",
    ),
    *router.urls,
]
