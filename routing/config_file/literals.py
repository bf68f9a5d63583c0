"""TOML literals: keys, strings and scalars written the way the file format needs."""

from __future__ import annotations

import re

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# Characters a TOML basic string must escape; the rest are written as they are.
SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def format_string(value: str) -> str:
    """Return ``value`` as a TOML basic string, quotes included."""
    out = []
    for char in value:
        if char in SHORT_ESCAPES:
            out.append(SHORT_ESCAPES[char])
        elif char < " " or char == "\x7f":
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def format_key(key: str) -> str:
    """Return ``key`` bare when TOML allows it, quoted otherwise."""
    return key if BARE_KEY.fullmatch(key) else format_string(key)


def format_scalar(value: str | bool | float) -> str:
    """Return a string, boolean, integer or finite float as a TOML value."""
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    # repr() of a float is its shortest exact form, and is always valid TOML
    # for finite values (300.0, 0.5, 1e-07, 1e+16).
    return repr(value)
