"""W3C Trace Context and sampling: what a request's trace continues or starts.

``traceparent`` is read strictly (a bounded header, lower-case hex, no
all-zero ids, version ``ff`` refused) and a bad one is ignored: the request
starts a trace of its own. Sampling follows the specification's six
samplers (``OTEL_TRACES_SAMPLER``): always on or off, a ratio of trace ids,
each of them deferring to a remote parent's choice when parent-based.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A traceparent's fields; what a traceparent and a tracestate may be long.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACEPARENT = 512
MAX_TRACESTATE = 512
SAMPLED = 0x01
_ID_LIMIT = 1 << 64
_TRUE = ("1", "true", "yes", "on")


def is_configured(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, not disabled)."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return (
        bool(endpoint)
        and environ.get("OTEL_SDK_DISABLED", "").strip().lower() not in _TRUE
        and environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none"
    )


@dataclass(frozen=True, slots=True)
class Sampling:
    """Which traces to keep: a share of trace ids, or the parent's choice."""

    parent_based: bool = True
    # Trace ids whose low 64 bits are below this are kept (2**64: all).
    bound: int = _ID_LIMIT

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Sampling:
        """``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``) and its
        ``OTEL_TRACES_SAMPLER_ARG`` (the ratio of the ``traceidratio`` ones)."""
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        name = name.strip().lower()
        parent_based = name.startswith("parentbased_")
        base = name.removeprefix("parentbased_")
        if base == "always_on":
            return cls(parent_based, _ID_LIMIT)
        if base == "always_off":
            return cls(parent_based, 0)
        if base == "traceidratio":
            try:
                ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
            except ValueError:
                ratio = -1.0
            if not 0.0 <= ratio <= 1.0:
                logger.warning(
                    "OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1: "
                    "sampling every trace"
                )
                ratio = 1.0
            return cls(parent_based, round(ratio * _ID_LIMIT))
        logger.warning(
            "OTEL_TRACES_SAMPLER=%s is not one of always_on, always_off, "
            "traceidratio and their parentbased_ forms: using "
            "parentbased_always_on",
            name,
        )
        return cls()

    def is_sampled(self, trace_id: int, parent_flags: int | None) -> bool:
        """Keep this trace? (``parent_flags``: a remote parent's, if any)."""
        if self.parent_based and parent_flags is not None:
            return bool(parent_flags & SAMPLED)
        return trace_id % _ID_LIMIT < self.bound


def parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    """A valid W3C traceparent's trace id, parent span id and flags."""
    if len(value) > MAX_TRACEPARENT:
        return None
    text = value.decode("latin-1").strip()
    found = _TRACEPARENT.match(text)
    if found is None:
        return None
    version, trace_id, span_id, flags = found.groups()
    # Version 00 has exactly these fields; a later one may add more after "-".
    rest = text[found.end() :]
    if version == "ff" or (version == "00" and rest) or (rest and rest[0] != "-"):
        return None
    trace, span = int(trace_id, 16), int(span_id, 16)
    if not trace or not span:
        return None
    return trace, span, int(flags, 16)
