"""A pytest plugin: each pytest-xdist worker gets Redis databases of its own.

`make test` runs each mode on several workers at once (``-n``) and loads this
plugin with ``-p tests.worker_isolation``. Everything else a worker touches is
already its own: pytest-django gives each worker its own test database
(``test_<name>_gw0``...), the SQLite file is named after the worker's process,
servers listen on free ports and the tests that start Nexus whole give it a
state directory under ``tmp_path``. Redis is the exception: ``REDIS_URL``
carries the channel layer, the Celery broker and the usage stream, which the
tests empty and read, so two workers on one database would see each other's
broadcasts, tasks and usage events.

Worker ``gwN`` of a run on ``REDIS_URL=redis://host:port/B`` uses database
``B + 2N`` as its own and ``B + 2N + 1`` as its spare (for a server that must
hear no broadcast from the tests, or a Nexus of its own): three workers on the
default ``/1`` use databases 1 to 6, four 1 to 8. A run without xdist uses B and B + 1.
Both are emptied when the worker starts: point TEST_REDIS_URL at databases
that hold nothing of yours.

This has to happen before Django reads its settings, which pytest-django does
while loading the initial conftests: hence a plugin, not a conftest fixture.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from urllib.parse import urlsplit, urlunsplit

import pytest

# Redis' default `databases 16`: numbers 0 to 15.
REDIS_DATABASES = 16
SPARE_REDIS_URL = "NEXUS_TEST_SPARE_REDIS_URL"


def worker_index() -> int:
    """This process's xdist worker number (gw2 is 2); 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw"))


def redis_urls_for_worker(base_url: str, index: int) -> tuple[str, str]:
    """The worker's own Redis URL and its spare one, counted up from base_url's."""
    parts = urlsplit(base_url)
    base = int(parts.path.strip("/") or 0)
    own = base + 2 * index
    if own + 1 >= REDIS_DATABASES:
        raise pytest.UsageError(
            f"xdist worker gw{index} would need Redis databases {own} and "
            f"{own + 1} counting from {base_url}: Redis has 0 to "
            f"{REDIS_DATABASES - 1}. Use fewer workers or a lower database."
        )
    return (
        urlunsplit(parts._replace(path=f"/{own}")),
        urlunsplit(parts._replace(path=f"/{own + 1}")),
    )


def isolate_redis() -> None:
    """Point REDIS_URL at this worker's own database and name its spare one.

    Changes ``os.environ``, which Django's settings and every server the tests
    start read.
    """
    base_url = os.environ.get("REDIS_URL")
    if not base_url:
        return  # the embedded default: no Redis
    own, spare = redis_urls_for_worker(base_url, worker_index())
    os.environ["REDIS_URL"] = own
    os.environ[SPARE_REDIS_URL] = spare
    _empty(own, spare)


def _empty(*urls: str) -> None:
    """Start from empty databases: they are this worker's alone, and whatever
    an earlier run (or anything else) left in them, such as usage events in
    the stream, would be read by the tests as theirs (a benchmark's 30,000
    events once made a test drain past its timeout)."""
    import redis

    for url in urls:
        client = redis.Redis.from_url(url, socket_timeout=10)
        try:
            client.flushdb()
        except redis.ConnectionError:
            pass  # Redis is down: the tests that need it say so themselves
        finally:
            client.close()


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests() -> Generator[None, None, None]:
    # A wrapper runs before pytest-django's hook, which imports the settings.
    isolate_redis()
    return (yield)
