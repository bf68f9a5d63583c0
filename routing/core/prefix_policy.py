"""``[routing.prefix]``: prefix-aware (KV-cache) routing and session affinity.

Off by default. When on, a request whose prompt starts like one a backend
computed recently goes back to that backend, and a request naming a session
(``x-session-id``, OpenAI ``user``, Anthropic ``metadata.user_id``: the
``session_keys``) to the backend its session used within
``session_ttl_seconds``, unless that backend's load exceeds the least-loaded
candidate's by more than the load guard: ``max_imbalance`` requests or
``max_imbalance_ratio`` of the least load, whichever is larger.

The prompt is cut into ``block_chars``-character blocks; each backend is
thought to hold ``cache_blocks`` of them (a backend's own
``prefix_cache_tokens`` wins, at 4 characters a token).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_CHARS_RANGE = (16, 65_536)
IMBALANCE_LIMIT = 10_000
RATIO_LIMIT = 100.0
CACHE_BLOCKS_RANGE = (1, 1_000_000)
SESSION_TTL_LIMIT = 7 * 86_400.0
SESSION_KEYS_LIMIT = 200
# What a session key may name: a request header, or a body field (dotted).
DEFAULT_SESSION_KEYS = "x-session-id,user,metadata.user_id"


@dataclass(frozen=True, slots=True)
class PrefixPolicy:
    """Whether prefix routing runs, how it cuts prompts, and its load guard."""

    enabled: bool = False
    block_chars: int = 256
    max_imbalance: int = 4
    max_imbalance_ratio: float = 0.5
    cache_blocks: int = 4096
    session_keys: str = DEFAULT_SESSION_KEYS
    session_ttl_seconds: float = 600.0

    def __post_init__(self) -> None:
        problem = prefix_problem(
            self.block_chars,
            self.max_imbalance,
            self.max_imbalance_ratio,
            self.cache_blocks,
            self.session_keys,
            self.session_ttl_seconds,
        )
        if problem is not None:
            raise ValueError(problem)

    @property
    def session_key_list(self) -> tuple[str, ...]:
        """The session keys in the order they are looked for."""
        return parse_session_keys(self.session_keys)

    def allowance(self, least: int) -> float:
        """Load a candidate may carry above the least-loaded one's `least`."""
        return max(self.max_imbalance, self.max_imbalance_ratio * least)


def parse_session_keys(value: str) -> tuple[str, ...]:
    """The comma-separated keys, stripped, empty ones dropped, lower-cased
    when they name a header (``x-...``)."""
    keys = (key.strip() for key in value.split(","))
    return tuple(
        key.lower() if key.lower().startswith("x-") else key for key in keys if key
    )


def prefix_problem(
    block_chars: int,
    max_imbalance: int,
    max_imbalance_ratio: float,
    cache_blocks: int,
    session_keys: str,
    session_ttl_seconds: float,
) -> str | None:
    """Return what is wrong with these prefix settings, or None."""
    low, high = BLOCK_CHARS_RANGE
    if not low <= block_chars <= high:
        return f"block_chars must be within {low}..{high}, got {block_chars}"
    if not 0 <= max_imbalance <= IMBALANCE_LIMIT:
        return (
            f"max_imbalance must be within 0..{IMBALANCE_LIMIT} requests, "
            f"got {max_imbalance}"
        )
    if not 0 <= max_imbalance_ratio <= RATIO_LIMIT:  # NaN fails too
        return (
            f"max_imbalance_ratio must be within 0..{RATIO_LIMIT:g}, "
            f"got {max_imbalance_ratio}"
        )
    low, high = CACHE_BLOCKS_RANGE
    if not low <= cache_blocks <= high:
        return f"cache_blocks must be within {low}..{high}, got {cache_blocks}"
    if len(session_keys) > SESSION_KEYS_LIMIT:
        return f"session_keys must be at most {SESSION_KEYS_LIMIT} characters"
    if any(not _is_key(key) for key in parse_session_keys(session_keys)):
        return (
            "session_keys must be comma-separated header names (x-...) or body "
            f"fields (user, metadata.user_id), got {session_keys!r}"
        )
    if not 0 < session_ttl_seconds <= SESSION_TTL_LIMIT:
        return (
            f"session_ttl_seconds must be within 0..{SESSION_TTL_LIMIT:g} "
            f"(more than 0), got {session_ttl_seconds}"
        )
    return None


def _is_key(key: str) -> bool:
    return all(
        part and part.replace("-", "_").isidentifier() for part in key.split(".")
    )
