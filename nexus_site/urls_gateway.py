"""The Django URLs of a gateway-only process (NEXUS_ROLE=gateway): /health.

/v1, Ollama's paths, /metrics and /health/live|ready never reach Django
(nexus_site/asgi.py); everything else is the control plane's, answered with
a JSON 404 that says so (nexus_site/roles.py).
"""

from __future__ import annotations

from django.urls import path

from gateway import views as gateway_views
from nexus_site import roles

urlpatterns = [
    path("health", gateway_views.health, name="health"),
]

handler400 = roles.gateway_bad_request
handler403 = roles.gateway_forbidden
handler404 = roles.gateway_not_found
handler500 = roles.gateway_server_error
