"""Allow-lists of model names and glob patterns, as operators write them.

Client keys (usage.limits.policy) and relay workers (backends.worker_models)
take the same syntax: comma-separated names or patterns (``llama3:*``,
``qwen2.5-?b``, ``phi[34]``) without spaces, commas or control bytes.
"""

from __future__ import annotations

import re

# A model name or a glob pattern over one.
_PATTERN = re.compile(r"[^\s,\x00-\x1f]{1,200}")


def split_patterns(text: str) -> tuple[str, ...]:
    """Split a comma-separated allow-list (blanks and duplicates dropped)."""
    seen: dict[str, None] = {}
    for part in text.split(","):
        part = part.strip()
        if part:
            seen[part] = None
    return tuple(seen)


def is_valid_pattern(pattern: str) -> bool:
    return _PATTERN.fullmatch(pattern) is not None


def is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")
