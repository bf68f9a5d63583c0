"""Set the test provider up: `setup` (database, users), `register URI` (client)."""

from __future__ import annotations

import sys

import django


def main() -> None:
    django.setup()
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from oauth2_provider.models import Application

    from tests.oidc_provider.accounts import CLIENT_ID, CLIENT_SECRET, USERS

    if sys.argv[1] == "setup":
        call_command("migrate", verbosity=0)
        for name, (password, groups) in USERS.items():
            user = User.objects.create_user(
                name, email=f"{name}@example.test", password=password
            )
            user.groups.set([Group.objects.get_or_create(name=g)[0] for g in groups])
        return
    Application.objects.update_or_create(
        client_id=CLIENT_ID,
        defaults={
            "name": "Nexus",
            "client_secret": CLIENT_SECRET,
            "client_type": Application.CLIENT_CONFIDENTIAL,
            "authorization_grant_type": Application.GRANT_AUTHORIZATION_CODE,
            "redirect_uris": sys.argv[2],
            "algorithm": Application.RS256_ALGORITHM,
            "skip_authorization": True,
        },
    )


if __name__ == "__main__":
    main()
