"""Pattern aliases: an alias name with ``*`` or ``?`` stands for many names.

``claude-*`` sends every name starting ``claude-`` that is neither served nor
an exact alias to its target. A pattern is matched after exact names and
exact aliases, the longest pattern first (ties in name order), so
``claude-3-5-haiku-*`` wins over ``claude-*``. Only ``*`` (any run of
characters, none included) and ``?`` (one character) are special; everything
else matches itself, case included.

Matching runs on the request path: the patterns are sorted once per
snapshot, a pattern's literal prefix and suffix rule most names out at once,
and each name's answer is kept in a bounded dict, so a name asked
again costs one dict lookup.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

# Same bound as an alias name's column.
MAX_PATTERN_LENGTH = 200
# Names whose answer is remembered per snapshot; past it, names are matched
# without being remembered (clients choose names: memory must not grow).
CACHE_SIZE = 4096
_NO_MATCH = ("", "")


def is_alias_pattern(name: str) -> bool:
    """Whether an alias name is a pattern (has ``*`` or ``?``)."""
    return "*" in name or "?" in name


def check_alias_pattern(name: str) -> str | None:
    """Return why `name` cannot be an alias pattern, or None when it can."""
    if len(name) > MAX_PATTERN_LENGTH:
        return f"A pattern is at most {MAX_PATTERN_LENGTH} characters."
    if any(char in name for char in "[]{}"):
        return (
            "A pattern may use only '*' (any characters) and '?' (one character); "
            "'[', ']', '{' and '}' are not patterns here."
        )
    return None


def matches_alias_pattern(pattern: str, name: str) -> bool:
    """Whether `pattern` covers the whole of `name`.

    The two-pointer glob match: on a mismatch after a ``*``, the star takes
    one more character. At most len(pattern) * len(name) steps, whatever the
    input (a regular expression with several ``.*`` can take far more).
    """
    p = n = 0
    star = -1
    resume = 0
    while n < len(name):
        if p < len(pattern) and pattern[p] in ("?", name[n]) and pattern[p] != "*":
            p += 1
            n += 1
        elif p < len(pattern) and pattern[p] == "*":
            star, resume = p, n
            p += 1
        elif star >= 0:
            resume += 1
            p, n = star + 1, resume
        else:
            return False
    while p < len(pattern) and pattern[p] == "*":
        p += 1
    return p == len(pattern)


@dataclass(frozen=True, slots=True)
class AliasPattern:
    """One pattern alias, with the literal ends that rule most names out."""

    pattern: str
    target: str
    # The text before the first wildcard: a name without it cannot match.
    prefix: str = ""
    # The text after the last wildcard: a name without it cannot match.
    suffix: str = ""
    # ``prefix*`` and nothing else: the prefix test is the whole match.
    is_prefix: bool = False

    @classmethod
    def of(cls, pattern: str, target: str) -> AliasPattern:
        """The pattern, with its literal prefix and suffix worked out once."""
        cut = min(i for i in (pattern.find("*"), pattern.find("?")) if i >= 0)
        prefix = pattern[:cut]
        last = max(pattern.rfind("*"), pattern.rfind("?"))
        suffix = pattern[last + 1 :]
        return cls(pattern, target, prefix, suffix, pattern == prefix + "*")


class AliasPatterns:
    """The pattern aliases of one snapshot, longest first, with a name cache."""

    __slots__ = ("_cache", "patterns", "targets")

    def __init__(self, patterns: Mapping[str, str] | None = None) -> None:
        ordered = sorted((patterns or {}).items(), key=lambda i: (-len(i[0]), i[0]))
        self.patterns: tuple[AliasPattern, ...] = tuple(
            AliasPattern.of(pattern, target) for pattern, target in ordered
        )
        # Pattern -> target, longest pattern first.
        self.targets: dict[str, str] = {p.pattern: p.target for p in self.patterns}
        self._cache: dict[str, tuple[str, str]] = {}

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __iter__(self) -> Iterator[AliasPattern]:
        return iter(self.patterns)

    def as_dict(self) -> dict[str, str]:
        """Pattern -> target, longest pattern first."""
        return dict(self.targets)

    def match(self, name: str) -> tuple[str, str] | None:
        """The (pattern, target) covering `name`, or None."""
        found = self._cache.get(name)
        if found is None:
            found = _NO_MATCH
            for alias in self.patterns:
                if not (name.startswith(alias.prefix) and name.endswith(alias.suffix)):
                    continue
                if alias.is_prefix or matches_alias_pattern(alias.pattern, name):
                    found = (alias.pattern, alias.target)
                    break
            if len(self._cache) < CACHE_SIZE:
                self._cache[name] = found
        return None if found is _NO_MATCH or not found[0] else found
