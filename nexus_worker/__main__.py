"""``python -m nexus_worker --server URL --backend URL``: run a worker."""

from __future__ import annotations

import sys

from nexus_worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
