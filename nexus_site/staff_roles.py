"""Roles: Django groups whose permissions follow one rule, default deny.

- ``viewer``: sees (view permission) every model of the Nexus apps: the
  dashboard, the admin read-only, usage. Never a secret: client keys and
  worker secrets are stored hashed, backend API keys are write-only.
- ``operator``: a viewer who also changes backends and routing (backends,
  models, aliases, fallback chains, the policy, drain, health actions).
- ``key-admin``: a viewer who also changes the usage app: client keys, their
  limits and budgets, teams, prices.
- ``team-admin``: a role scoped to teams: the client keys of the teams whose
  admins list the user (create, change, revoke; never another team's, never
  a key outside a team) and their usage. No dashboard, no routing.
- ``admin``: every permission, users, groups and admin tokens included.

The rule is by app: a model of an app in ``VIEWED_APPS`` is seen by every
global role and changed by the role ``CHANGED_APPS`` gives that app to. A
model of any other app (a new one) is the admin role's alone until its app is
added here: a new model or endpoint is denied to the other roles by default.
``sync_roles`` sets the groups' permissions by this rule; the migration that
creates the groups runs it, and so does every ``migrate`` (post_migrate), so
the models of later migrations are covered. Edits to the role groups'
permissions are reset then: give a user more through another group.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps as django_apps

VIEWER = "viewer"
OPERATOR = "operator"
KEY_ADMIN = "key-admin"
TEAM_ADMIN = "team-admin"
ADMIN = "admin"
ROLES = (VIEWER, OPERATOR, KEY_ADMIN, TEAM_ADMIN, ADMIN)

VIEWED_APPS = frozenset({"backends", "routing", "usage"})
CHANGED_APPS = {
    OPERATOR: frozenset({"backends", "routing"}),
    KEY_ADMIN: frozenset({"usage"}),
}
# What a team admin may do, on their own teams' keys only (the admin and the
# API narrow the rows: usage.models.TeamQuerySet.visible_to).
TEAM_ADMIN_PERMISSIONS = frozenset(
    {
        "usage.view_apikey",
        "usage.add_apikey",
        "usage.change_apikey",
        "usage.view_team",
        "usage.view_keyspend",
    }
)


def grants(role: str, app_label: str, codename: str) -> bool:
    """Whether `role` has the permission `app_label.codename`."""
    if role == ADMIN:
        return True
    if role == TEAM_ADMIN:
        return f"{app_label}.{codename}" in TEAM_ADMIN_PERMISSIONS
    if app_label not in VIEWED_APPS:
        return False
    if codename.startswith("view_"):
        return True
    return app_label in CHANGED_APPS.get(role, ())


def sync_roles(apps: Any = django_apps) -> None:
    """Create the role groups and give each exactly the permissions of the rule."""
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    permissions = list(
        permission_model.objects.select_related("content_type").order_by("pk")
    )
    for role in ROLES:
        group, _ = group_model.objects.get_or_create(name=role)
        group.permissions.set(
            [
                p
                for p in permissions
                if grants(role, p.content_type.app_label, p.codename)
            ]
        )


def sync_roles_after_migrate(sender: Any, **kwargs: Any) -> None:
    """Re-apply the rule once per migrate, after the last app's permissions.

    post_migrate is sent for each app that has models, in INSTALLED_APPS order.
    """
    with_models = [c for c in django_apps.get_app_configs() if c.models_module]
    if sender.label == with_models[-1].label:
        sync_roles(kwargs.get("apps") or django_apps)


def set_role(user: Any, role: str | None) -> None:
    """Give `user` exactly one role (None: none); a role makes them staff.

    Groups that are not roles are left as they are. Saves the user.
    """
    group_model = django_apps.get_model("auth", "Group")
    user.groups.remove(*group_model.objects.filter(name__in=ROLES))
    if role is not None:
        user.groups.add(group_model.objects.get(name=role))
    user.is_staff = role is not None or user.is_superuser
    user.save(update_fields=["is_staff"])
