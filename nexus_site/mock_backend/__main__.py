"""``python -m nexus_site.mock_backend --models a,b``: serve a mock backend."""

from __future__ import annotations

import sys

from nexus_site.mock_backend.cli import main

if __name__ == "__main__":
    sys.exit(main())
