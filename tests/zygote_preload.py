"""What the tests' forkserver imports once (tests/zygote.py): the libraries the
Nexus servers, mock backends and workers import, and nothing that reads Django's
settings, an event loop or a thread: each forked server reads its settings from
its own environment."""

from __future__ import annotations

import importlib
import os

LIBRARIES = (
    "django.db.models",
    "django.http",
    "django.urls",
    "django.core.handlers.asgi",
    "django.contrib.postgres.fields",
    "django.template",
    "django.forms",
    "rest_framework.fields",
    "rest_framework.serializers",
    "drf_spectacular.utils",
    "channels.generic.websocket",
    "channels.layers",
    "redis.asyncio",
    "celery",
    "kombu",
    "aiohttp",
    "aiohttp.web",
    "httpx",
    "twisted.internet.posixbase",
    "twisted.internet.tcp",
    "twisted.protocols.tls",
    "twisted.web.http",
    "autobahn.twisted.websocket",
    "yaml",
)


def _preload() -> None:
    # With no settings module named, whatever touches Django's settings fails
    # here instead of being configured from the forkserver's environment.
    settings_module = os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    try:
        for name in LIBRARIES:
            importlib.import_module(name)
    finally:
        if settings_module is not None:
            os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    from django.conf import settings

    assert not settings.configured, "the forkserver must not read Django settings"


_preload()
