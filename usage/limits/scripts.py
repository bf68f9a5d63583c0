"""The limiter's Lua scripts, read once at import from ``lua/``.

Each file opens with comments (its KEYS, ARGV and reply) that are not sent to
Redis: what is sent is what Redis hashes for ``EVALSHA``, and the settle goes
whole (``EVAL``) with every settle, so only the code after the opening
comments is kept. Scripts that read Redis's clock start with ``now.lua``; the
admission scripts then have ``gcra.lua``'s bucket arithmetic.
"""

from __future__ import annotations

from importlib.resources import files

from usage.limits.reserve import RESERVE_SHARE


def _read(name: str) -> str:
    """The code of ``lua/<name>.lua``: the file less its opening comment lines."""
    lines = (
        files(__package__)
        .joinpath("lua", f"{name}.lua")
        .read_text(encoding="utf-8")
        .splitlines(keepends=True)
    )
    start = 0
    while start < len(lines) and lines[start].startswith("--"):
        start += 1
    return "".join(lines[start:])


def limit_arg(value: int | None) -> int:
    """A limit as the scripts take it: -1 for none."""
    return -1 if value is None else value


_NOW = _read("now")

_GCRA = _read("gcra")

ADMIT = _NOW + _GCRA + _read("admit").replace("RESERVE_SHARE", repr(RESERVE_SHARE))
ADMIT_LAYERS = _NOW + _GCRA + _read("admit_layers")
RETURN = _NOW + _read("return")
COVER = _NOW + _read("cover")
SETTLE = _read("settle")
ACQUIRE = _NOW + _read("acquire")
PLACES = _NOW + _read("places")
RENEW = _NOW + _read("renew")
HOLDS = _read("holds")
RAISE_SPENT = _read("raise_spent")
