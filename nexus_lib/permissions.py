"""Who may call a management API endpoint: its model permissions, default deny.

Every management API view is guarded by ``RolePermission`` (the default
permission class): an active staff user passes when their roles (Django
groups with permissions, nexus_site/staff_roles.py) grant what the view needs. A
view over a model needs that model's permission for the action: view for
reads, add for a create, change for an update or any other write (a
viewset's custom actions: drain, revoke, rotate), delete for a delete. A
view without a model declares ``required_permissions`` ({"read": (...),
"write": (...)}; an empty tuple: any staff user). A view that declares
neither is for superusers only. Token users get their user's permissions.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from django.db.models import Model
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request


def requires(
    read: tuple[str, ...] | None = None, write: tuple[str, ...] | None = None
) -> Mapping[str, tuple[str, ...]]:
    """A view's ``required_permissions``: for reads, for writes (None: denied)."""
    needed = {"read": read, "write": write}
    return MappingProxyType({k: v for k, v in needed.items() if v is not None})


# A viewset action -> the model permission it needs (others: by method).
_ACTIONS = {
    "list": "view",
    "retrieve": "view",
    "create": "add",
    "update": "change",
    "partial_update": "change",
    "destroy": "delete",
}


def required_permissions(view: Any, method: str) -> tuple[str, ...] | None:
    """The permissions `view` needs for `method` (None: superusers only)."""
    declared = getattr(view, "required_permissions", None)
    kind = "read" if method in SAFE_METHODS else "write"
    if declared is not None:
        needed = declared.get(kind)
        return None if needed is None else tuple(needed)
    model = _model_of(view)
    if model is None:
        return None
    action = _ACTIONS.get(getattr(view, "action", None) or "")
    if action is None:
        action = "view" if kind == "read" else "change"
    meta = model._meta
    return (f"{meta.app_label}.{action}_{meta.model_name}",)


def _model_of(view: Any) -> type[Model] | None:
    queryset = getattr(view, "queryset", None)
    if queryset is not None:
        return queryset.model
    serializer = getattr(view, "serializer_class", None)
    meta = getattr(serializer, "Meta", None)
    return getattr(meta, "model", None)


def is_staff_user(user: Any) -> bool:
    return bool(user and user.is_authenticated and user.is_active and user.is_staff)


class RolePermission(BasePermission):
    """Active staff users whose roles grant the view's permissions."""

    message = "Your role does not allow this."

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not is_staff_user(user):
            return False
        if user.is_superuser:
            return True
        needed = required_permissions(view, request.method or "GET")
        return needed is not None and user.has_perms(needed)


class AnyStaffPermission(BasePermission):
    """Any active staff user, whatever their role (the API's index, its schema)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return is_staff_user(request.user)
