"""ASGI entry point: Channels' ProtocolTypeRouter in front of Django."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")

# Set up Django (apps, settings) before anything imports models: consumers and the
# proxy are imported below this line for that reason.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter

application = ProtocolTypeRouter({"http": django_asgi_app})
