"""The test provider's users and its one client (Nexus)."""

from __future__ import annotations

# username -> (password, groups) of the provider's users.
USERS = {
    "ada": ("ada-pw-123", ["nexus-admins"]),
    "olga": ("olga-pw-123", ["ml-ops", "staff-everyone"]),
    "tess": ("tess-pw-123", ["team-research"]),
    "nora": ("nora-pw-123", ["marketing"]),
}
CLIENT_ID = "nexus-tests"
CLIENT_SECRET = "nexus-tests-secret-0123456789"
