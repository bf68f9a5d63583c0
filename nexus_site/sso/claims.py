"""Group claims to roles: what a user signed in through the provider may do."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.contrib.auth.models import Group

from nexus_site.sso.role_map import TEAM_ADMIN_PREFIX
from nexus_site.staff_roles import ROLES, TEAM_ADMIN
from usage.models import Team


def claimed_groups(claims: Mapping[str, Any], claim: str) -> list[str]:
    """The values of the group claim: a list of strings, or one string."""
    value = claims.get(claim)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return []


def roles_for(groups: Iterable[str], role_map: Mapping[str, str]) -> set[str]:
    """The roles (and "team-admin:TEAM" entries) the groups map to."""
    return {role_map[group] for group in groups if group in role_map}


def apply_roles(user: Any, roles: set[str]) -> None:
    """Make the user's role groups and administered teams exactly ``roles``.

    Groups that are not roles, and teams the user administers through a
    local grant, are kept only for what the claims do not decide: SSO owns a
    user's roles. A user with any role is staff; one with none is not.
    """
    global_roles = {role for role in roles if role in ROLES}
    teams = {
        role[len(TEAM_ADMIN_PREFIX) :]
        for role in roles
        if role.startswith(TEAM_ADMIN_PREFIX)
    }
    if teams:
        global_roles.add(TEAM_ADMIN)
    user.groups.remove(
        *Group.objects.filter(name__in=ROLES).exclude(name__in=global_roles)
    )
    user.groups.add(*Group.objects.filter(name__in=global_roles))
    user.administered_teams.set(Team.objects.filter(name__in=teams))
    user.is_staff = bool(global_roles) or user.is_superuser
    user.save(update_fields=["is_staff"])
