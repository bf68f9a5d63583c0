"""Browser assets that Python packages ship outside a static/ directory.

plotly.js (the dashboard's charts) comes with the ``plotly`` package as
``plotly/package_data/plotly.min.js``. This finder serves that one file as
``vendor/plotly/plotly.min.js``, for WhiteNoise (embedded) and collectstatic
(production) alike, and nothing else of that folder (it also holds data sets).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import plotly
from django.contrib.staticfiles.finders import BaseFinder
from django.core.files.storage import FileSystemStorage

PLOTLY_DIR = Path(plotly.__file__).resolve().parent / "package_data"
PLOTLY_FILE = "plotly.min.js"
PREFIX = "vendor/plotly"
PLOTLY_PATH = f"{PREFIX}/{PLOTLY_FILE}"


class PlotlyFinder(BaseFinder):
    """Find ``vendor/plotly/plotly.min.js`` in the installed plotly package."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage = FileSystemStorage(location=str(PLOTLY_DIR))
        self.storage.prefix = PREFIX  # type: ignore[attr-defined]

    def find(self, path: str, find_all: bool = False, **kwargs: Any) -> Any:
        # Nothing found is [] either way, as Django's own finders answer.
        if path != PLOTLY_PATH:
            return []
        found = str(PLOTLY_DIR / PLOTLY_FILE)
        return [found] if find_all else found

    def list(self, ignore_patterns: Any) -> Iterator[tuple[str, FileSystemStorage]]:
        yield PLOTLY_FILE, self.storage
