"""The batch surfaces: OpenAI's Files and Batches APIs, Anthropic's Message Batches.

Django views (they read and write the batch models; not the proxy's hot
path): ``views`` (the endpoints), ``shapes`` (the SDKs' object shapes),
``clients`` (the caller's key, errors in each API's shape). The work is in
``usage.batches``; nexus_site/asgi.py sends these paths to Django.
"""

from __future__ import annotations

# Paths under /v1 served by Django rather than the proxy.
BATCH_PATH_PREFIXES = ("/v1/files", "/v1/batches", "/v1/messages/batches")
