"""Single sign-on: OpenID Connect login for the admin, the dashboard and the API docs.

``discovery`` reads the provider's endpoints from its discovery document
(fetched with httpx when first needed, then kept for an hour); ``backends``
has the OIDC authentication backend (mozilla-django-oidc's, with the
endpoints discovered, users keyed by the provider's ``sub`` and roles taken
from the group claim) and the break-glass backend; ``claims`` maps group
claims to roles; ``views`` the login views. Off unless
NEXUS_OIDC_DISCOVERY_URL is set (docs/sso.md).
"""
