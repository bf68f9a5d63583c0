from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from gateway import dashboard as gateway_dashboard
from gateway import views as gateway_views
from nexus_site import api
from usage import views as usage_views

urlpatterns = [
    # For load balancers and monitoring: no login, no secrets (gateway/views.py).
    path("health", gateway_views.health, name="health"),
    path("admin/", admin.site.urls),
    # Single sign-on: /oidc/authenticate/ and /oidc/callback/ (nexus_site/sso).
    path("oidc/", include("mozilla_django_oidc.urls")),
    path("dashboard/", usage_views.dashboard, name="dashboard"),
    path("dashboard/history", usage_views.history, name="dashboard-history"),
    path("dashboard/fleet", gateway_dashboard.fleet, name="dashboard-fleet"),
    path("api/v1/", api.ApiIndexView.as_view(), name="api-index"),
    path("api/v1/", include("gateway.urls")),
    path("api/v1/", include("routing.api.urls")),
    path("api/v1/", include("backends.api.urls")),
    path("api/v1/", include("usage.api.urls")),
    # OpenAI's Files and Batches, Anthropic's Message Batches (gateway/batches/).
    path("", include("gateway.batches.urls")),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # A browser without a staff session is sent to the admin login first.
    path(
        "api/v1/docs/",
        staff_member_required(SpectacularSwaggerView.as_view(url_name="api-schema")),
        name="api-docs",
    ),
]

# JSON under /api/, Django's pages elsewhere (nexus_site/api.py).
handler400 = api.bad_request
handler403 = api.permission_denied
handler404 = api.page_not_found
handler500 = api.server_error
