"""NEXUS_OIDC_ROLE_MAP, checked when the settings load (no models imported)."""

from __future__ import annotations

from collections.abc import Mapping

from django.core.exceptions import ImproperlyConfigured

from nexus_site.staff_roles import ROLES, TEAM_ADMIN

# A claim value may map to "team-admin:TEAM": team admin of that team.
TEAM_ADMIN_PREFIX = f"{TEAM_ADMIN}:"


def check_role_map(role_map: Mapping[str, str]) -> dict[str, str]:
    """Return the claim value -> role map, or raise naming a value it cannot use."""
    for claim, role in role_map.items():
        if role in ROLES and role != TEAM_ADMIN:
            continue
        if role.startswith(TEAM_ADMIN_PREFIX) and role[len(TEAM_ADMIN_PREFIX) :]:
            continue
        raise ImproperlyConfigured(
            f"NEXUS_OIDC_ROLE_MAP: {claim}={role}: the role must be one of "
            f"{', '.join(r for r in ROLES if r != TEAM_ADMIN)} or team-admin:TEAM"
        )
    return dict(role_map)
