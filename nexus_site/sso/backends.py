"""Authentication backends: the OpenID provider's users, and the break-glass one."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import BaseBackend, ModelBackend
from django.http import HttpRequest
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings

from nexus_site.sso.claims import apply_roles, claimed_groups, roles_for
from nexus_site.sso.discovery import ENDPOINTS, DiscoveryError, endpoint

logger = logging.getLogger(__name__)

USERNAME_PREFIX = "sso:"


def oidc_setting(attr: str, *args: Any) -> Any:
    """mozilla-django-oidc's settings, the endpoints from the discovery document."""
    if attr in ENDPOINTS:
        return endpoint(attr)
    return import_from_settings(attr, *args)


class NexusOIDCBackend(OIDCAuthenticationBackend):
    """Users of the OpenID provider, keyed by its ``sub``; roles from the groups.

    A user whose groups map to no role is refused (and loses the roles an
    earlier sign-in gave them). The endpoints are read when a sign-in needs
    them, so a password login never waits on the provider.
    """

    get_settings = staticmethod(oidc_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.UserModel = get_user_model()
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        if request is None or not settings.NEXUS_OIDC_ENABLED:
            return None
        if "code" not in request.GET or "state" not in request.GET:
            return None  # a password login: not ours
        try:
            self.OIDC_OP_TOKEN_ENDPOINT = endpoint("OIDC_OP_TOKEN_ENDPOINT")
            self.OIDC_OP_USER_ENDPOINT = endpoint("OIDC_OP_USER_ENDPOINT")
            self.OIDC_OP_JWKS_ENDPOINT = endpoint("OIDC_OP_JWKS_ENDPOINT")
        except DiscoveryError:
            return None
        return super().authenticate(request, **kwargs)

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return isinstance(claims.get("sub"), str) and bool(claims["sub"])

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        return self.UserModel.objects.filter(username=_username(claims))

    def create_user(self, claims: dict[str, Any]) -> Any:
        roles = self._roles(claims)
        if not roles:
            logger.warning(
                "Single sign-on refused %s: no group of theirs maps to a role",
                _username(claims),
            )
            return None
        user = self.UserModel.objects.create_user(
            _username(claims), email=claims.get("email", "")
        )
        return self._update(user, claims, roles)

    def update_user(self, user: Any, claims: dict[str, Any]) -> Any:
        return self._update(user, claims, self._roles(claims))

    def _roles(self, claims: dict[str, Any]) -> set[str]:
        groups = claimed_groups(claims, settings.NEXUS_OIDC_GROUPS_CLAIM)
        return roles_for(groups, settings.NEXUS_OIDC_ROLE_MAP)

    def _update(self, user: Any, claims: dict[str, Any], roles: set[str]) -> Any:
        user.email = str(claims.get("email", ""))[:254]
        user.first_name = str(claims.get("name", claims.get("preferred_username", "")))[
            :150
        ]
        user.save(update_fields=["email", "first_name"])
        apply_roles(user, roles)
        if not roles:
            logger.warning(
                "Single sign-on refused %s: no group of theirs maps to a role",
                user.username,
            )
            return None
        return user


def _username(claims: dict[str, Any]) -> str:
    # The provider's subject identifier is stable; names and emails change.
    digest = hashlib.sha256(str(claims.get("sub")).encode()).hexdigest()[:16]
    readable = str(claims.get("preferred_username") or claims.get("email") or "")
    return f"{USERNAME_PREFIX}{readable[:100]}:{digest}"


class BreakGlassBackend(BaseBackend):
    """The superuser named by NEXUS_BREAK_GLASS_USER, whose password is
    NEXUS_BREAK_GLASS_PASSWORD: the way in when local logins are off and the
    provider is down. The user is created (a superuser with no usable
    password of its own) at its first sign-in."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> Any:
        name = settings.NEXUS_BREAK_GLASS_USER
        secret = settings.NEXUS_BREAK_GLASS_PASSWORD
        if not (name and secret and username and password) or username != name:
            return None
        if not hmac.compare_digest(password.encode(), secret.encode()):
            return None
        users = get_user_model().objects
        user, created = users.get_or_create(
            username=name, defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        if not (user.is_active and user.is_staff and user.is_superuser):
            user.is_active = user.is_staff = user.is_superuser = True
            user.save(update_fields=["is_active", "is_staff", "is_superuser"])
        return user

    def get_user(self, user_id: int) -> Any:
        return get_user_model().objects.filter(pk=user_id).first()


class PermissionsOnlyBackend(ModelBackend):
    """Roles and permissions from groups, as ModelBackend, but no password
    login: what NEXUS_LOCAL_LOGIN=false puts in ModelBackend's place."""

    def authenticate(
        self, request: HttpRequest | None, *args: Any, **kwargs: Any
    ) -> Any:
        return None
