"""Django's admin as an app, on Nexus's admin site (nexus_site/admin_site.py).

Apart from nexus_site/apps.py: importing it loads the admin, which a
gateway-only process (NEXUS_ROLE=gateway) never does.
"""

from __future__ import annotations

from django.contrib.admin import apps as admin_apps


class NexusAdminConfig(admin_apps.AdminConfig):
    """Django's admin, on Nexus's admin site (nexus_site/admin_site.py)."""

    default_site = "nexus_site.admin_site.NexusAdminSite"
