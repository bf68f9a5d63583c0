"""Create the role groups (viewer, operator, key-admin, team-admin, admin)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.management import create_permissions
from django.db import migrations

from nexus_site.staff_roles import sync_roles


def create_roles(apps: Any, schema_editor: Any) -> None:
    # Permissions are made after migrations (post_migrate): make them now.
    for config in apps.get_app_configs():
        config.models_module = True
        create_permissions(config, apps=apps, verbosity=0)
        config.models_module = None
    sync_roles(apps)


def remove_roles(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "Group").objects.filter(
        name__in=("viewer", "operator", "key-admin", "team-admin", "admin")
    ).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("usage", "0016_teams"),
    ]

    operations = [migrations.RunPython(create_roles, remove_roles)]
