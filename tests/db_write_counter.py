"""Count the database writes of a serving process a test starts (imported first).

Every connection Django opens gets an execute wrapper that counts INSERT,
UPDATE and DELETE statements; a thread writes the count to the file named by
NEXUS_TEST_WRITE_COUNT_FILE whenever it changed (five times a second at most),
where the test reads it. Test tooling only: the product never imports it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db.backends.signals import connection_created

_WRITES = ("INSERT", "UPDATE", "DELETE")
_lock = threading.Lock()
_count = 0


def _counting(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
) -> Any:
    global _count
    if sql.lstrip()[:6].upper() in _WRITES:
        with _lock:
            _count += 1
    return execute(sql, params, many, context)


def _wrap(sender: object, connection: Any, **kwargs: object) -> None:
    # Sent at every (re)connection of the same connection object.
    if _counting not in connection.execute_wrappers:
        connection.execute_wrappers.append(_counting)


def _report(path: str) -> None:
    written = -1
    while True:
        if _count != written:
            written = _count
            with open(path + ".tmp", "w") as file:
                file.write(str(written))
            os.replace(path + ".tmp", path)
        time.sleep(0.2)


connection_created.connect(_wrap, weak=False)
_path = os.environ.get("NEXUS_TEST_WRITE_COUNT_FILE")
if _path:
    threading.Thread(target=_report, args=(_path,), daemon=True).start()
