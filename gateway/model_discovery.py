"""Discovery for one backend, run from the serving process (a worker thread).

Ollama model management (gateway/proxy/model_management.py) changes what a
backend holds; the proxy then lists that backend's models at once rather
than waiting for the periodic discovery (a relay worker lists its own and
reports them before its answer ends: ``read_version`` then says which
configuration has them). The proxy may not load the ORM, so
this module imports it only inside the function, in the worker thread, as
gateway/breaker.py does for its task.
"""

from __future__ import annotations


def discover_backend(backend_id: int) -> int:
    """Run discovery for one backend; return the config version after it.

    Call it in a worker thread (it runs its own event loop and the ORM); the
    thread's database connections are closed before it goes back to the pool.
    """
    from django.db import connections

    from backends.discovery import discover_models
    from routing.versioning import read_config_version

    try:
        discover_models([backend_id], include_disabled=True)
        return read_config_version()
    finally:
        connections.close_all()


def read_version() -> int:
    """Return the configuration version now (in a worker thread, as above)."""
    from django.db import connections

    from routing.versioning import read_config_version

    try:
        return read_config_version()
    finally:
        connections.close_all()
