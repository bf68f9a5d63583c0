"""The provider's claims: the user's Django groups as the ``groups`` claim."""

from __future__ import annotations

from typing import Any

from oauth2_provider.oauth2_validators import OAuth2Validator


class GroupsValidator(OAuth2Validator):
    # Every claim whatever the scopes (the test provider is not picky).
    oidc_claim_scope = None

    def get_additional_claims(self, request: Any) -> dict[str, Any]:
        user = request.user
        return {
            "email": user.email,
            "preferred_username": user.username,
            "groups": [group.name for group in user.groups.all()],
        }
