"""Which model names a relay worker may serve (pure: no Django).

A worker's credential carries an allow-list of names and glob patterns
(``llama3:*``) and a flag, ``may_shadow_direct_backends``. A name the worker
announces is refused when the allow-list is not empty and does not admit it,
or when a direct (non-relay) backend serves it and the flag is off: a worker
must not take the traffic of a backend the operator trusts (the red team's
hostile worker got every prompt for such a model once the direct backend's
breaker was open). An empty allow-list admits any name no direct backend
serves, as before allow-lists existed.

``backends/workers.py`` sorts the names at registration and on each
``models_update``; ``routing/snapshot.py`` applies the same rules when it
builds the route table, so a direct backend that starts serving a name later,
or an allow-list edited while the worker is connected, takes effect with the
next snapshot.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from nexus_lib.model_patterns import is_glob

NOT_ALLOWED = "not in the worker's allow-list"
SERVED_DIRECTLY = "served by a direct backend"
UNSTORABLE = "control characters or lone surrogates"
# What a worker's refused list keeps (names beyond it are counted, not kept).
MAX_REFUSED_KEPT = 100

# What no model name holds: it could not be stored, logged or shown as it is.
_UNSTORABLE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A name a worker announced and does not serve, and why."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class ModelRules:
    """A worker's allow-list and whether it may serve direct backends' names."""

    allowed: tuple[str, ...] = ()
    may_shadow_direct_backends: bool = False
    _exact: frozenset[str] = field(init=False, repr=False, compare=False)
    _glob: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact = frozenset(p for p in self.allowed if not is_glob(p))
        globs = [fnmatch.translate(p) for p in self.allowed if is_glob(p)]
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(
            self, "_glob", re.compile("|".join(globs)) if globs else None
        )

    def allows(self, name: str) -> bool:
        """Whether the allow-list admits `name` (an empty list admits any)."""
        if not self.allowed or name in self._exact:
            return True
        return self._glob is not None and self._glob.fullmatch(name) is not None

    def refusal(self, name: str, direct: Container[str]) -> str:
        """Why the worker may not serve `name` ("" : it may).

        `direct` holds the names direct (non-relay) backends serve.
        """
        if _UNSTORABLE.search(name):
            return UNSTORABLE
        if not self.allows(name):
            return NOT_ALLOWED
        if not self.may_shadow_direct_backends and name in direct:
            return SERVED_DIRECTLY
        return ""

    def sort(
        self, names: Iterable[str], direct: Container[str]
    ) -> tuple[tuple[str, ...], tuple[Refusal, ...]]:
        """Split announced names into those served and those refused (in order,
        duplicates dropped)."""
        served: list[str] = []
        refused: list[Refusal] = []
        for name in dict.fromkeys(names):
            reason = self.refusal(name, direct)
            if reason == UNSTORABLE:
                refused.append(Refusal(ascii(name)[1:-1], reason))
            elif reason:
                refused.append(Refusal(name, reason))
            else:
                served.append(name)
        return tuple(served), tuple(refused)


def describe_refusals(refused: Iterable[Refusal], limit: int = 20) -> str:
    """One bounded line naming refused models by reason (for logs and the worker)."""
    by_reason: dict[str, list[str]] = {}
    total = 0
    for refusal in refused:
        total += 1
        names = by_reason.setdefault(refusal.reason, [])
        if len(names) < limit:
            names.append(refusal.name[:100])
    parts = [f"{reason}: {', '.join(names)}" for reason, names in by_reason.items()]
    shown = sum(len(names) for names in by_reason.values())
    if total > shown:
        parts.append(f"and {total - shown} more")
    return "; ".join(parts)
