"""``python -m tests.bench``: configure Django, then run the benchmark."""

from __future__ import annotations

import os
import sys

import django

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")
    django.setup()
    # Imported only now: the benchmark's modules need the app registry ready.
    from tests.bench.cli import main

    sys.exit(main())
