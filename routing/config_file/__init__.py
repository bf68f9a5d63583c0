"""Routing configuration as a TOML file: read, check, import and export it.

The format::

    [routing]
    strategy = "smart"          # smart | round_robin | priority_only | random
    max_retries = 2
    [routing.weights]           # must sum to 100
    priority = 50
    load = 30
    latency = 20
    [routing.aliases]
    "gpt-4" = "llama3:70b"
    [routing.fallbacks]
    "llama3:70b" = ["llama3:8b", "mistral:7b"]
    [[backends]]
    name = "gpu-1"                      # required
    url = "http://127.0.0.1:11434"      # required
    kind = "ollama"
    priority = 1
    enabled = true
    max_concurrency = 8                 # leave out for no limit
    timeout = 300.0
    api_key_env = "GPU1_KEY"            # or api_key = "..."
    [[backends.models]]
    name = "llama3:8b"                  # required
    context_length = 8192               # leave out when unknown
    vision = false                      # true | false | "auto" (unknown)
    tools = true
    json_mode = true
    enabled = true

Rows are matched by name (backends by name, models by backend and name,
aliases by name, chains by model). A key a backend or model entry leaves out
means the field's default, so the file is the truth for every row it mentions;
a backend entry without api_key or api_key_env keeps its stored key, and so
does a disabled one whose api_key_env variable is not set (a warning; for an
enabled backend it is a problem). A
capability left out or given as "auto" is unknown (the backend decides). Routing
policy keys the file leaves out are kept, or reset to defaults with --replace.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from routing.config_file.exporter import export_config
from routing.config_file.importer import ImportSummary, TableChanges, import_config
from routing.config_file.problems import ConfigError
from routing.config_file.reader import read_config
from routing.config_file.schema import ConfigFile

STDIN = "-"

__all__ = [
    "ConfigError",
    "ConfigFile",
    "ImportSummary",
    "TableChanges",
    "export_config",
    "import_config",
    "import_config_file",
    "read_config",
]


def import_config_file(
    path: str,
    *,
    replace: bool = False,
    dry_run: bool = False,
    environ: Mapping[str, str] | None = None,
) -> ImportSummary:
    """Read the file at ``path`` (``-`` for stdin), check it and import it.

    Raise ConfigError, with nothing changed, listing every problem found.
    """
    source = "<stdin>" if path == STDIN else path
    text = _read_text(path, source)
    config = read_config(text, source, os.environ if environ is None else environ)
    return import_config(config, source=source, replace=replace, dry_run=dry_run)


def _read_text(path: str, source: str) -> str:
    try:
        data = sys.stdin.buffer.read() if path == STDIN else Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(source, [f"cannot read the file: {error.strerror}"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            source,
            [f"not UTF-8 text (byte {error.start}); TOML files must be UTF-8"],
        ) from None
