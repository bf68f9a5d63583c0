"""``python -m tests.soak``: configure Django, then run the soak."""

from __future__ import annotations

import os
import sys

import django

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")
    django.setup()
    # Imported only now: the soak's modules need the app registry ready.
    from tests.soak.run import main

    sys.exit(main(sys.argv[1:]))
