from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

admin.site.site_header = "Nexus administration"
admin.site.site_title = "Nexus"
admin.site.index_title = "Gateway configuration"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("routing.api.urls")),
]
