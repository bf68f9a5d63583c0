"""``python -m nexus_mock --models a,b``: serve a mock backend."""

from __future__ import annotations

import sys

from nexus_mock.cli import main

if __name__ == "__main__":
    sys.exit(main())
