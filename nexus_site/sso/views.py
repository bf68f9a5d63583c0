"""Starting a sign-in at the OpenID provider."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from mozilla_django_oidc.views import OIDCAuthenticationRequestView

from nexus_site.sso.backends import oidc_setting
from nexus_site.sso.discovery import DiscoveryError, endpoint

UNAVAILABLE_URL = "/admin/login/?sso=unavailable"


class SignInView(OIDCAuthenticationRequestView):
    """Send the browser to the provider's authorization endpoint (discovered
    when it is needed; back to the login page if the provider is down)."""

    get_settings = staticmethod(oidc_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    def get(self, request: HttpRequest) -> HttpResponse:
        if not settings.NEXUS_OIDC_ENABLED:
            return HttpResponseRedirect("/admin/login/")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = endpoint("OIDC_OP_AUTHORIZATION_ENDPOINT")
        except DiscoveryError:
            return HttpResponseRedirect(UNAVAILABLE_URL)
        return super().get(request)
