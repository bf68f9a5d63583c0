"""The batch runner: every line of a batch through the gateway, once.

A Celery worker on the ``batches`` queue runs ``run_batch``. It takes the
batch's lease (one runner per batch; at most NEXUS_BATCH_RUNNING batches in
all and NEXUS_BATCH_KEY_BATCHES per key run at once), reads back what the
result files already hold (``results.read_progress``: a killed runner's
half-written last line is cut) and sends the other lines, at most
NEXUS_BATCH_CONCURRENCY at once, to a serving process (NEXUS_BATCH_GATEWAY_URL)
over HTTP: through the whole pipeline (routing, aliases, fallbacks, the owner
key's allow-list, limits and budget) as the owner key, in the admission
controller's batch lane, with the signed credential of
``usage.batch_credential``. Each answer is appended to the output or error
file as it arrives.

Why over HTTP rather than in the worker: a line then waits in the same
admission queue as the interactive requests it must yield to (that queue
lives in the serving processes), and it is billed, limited and recorded by
the one code path every request takes.

A line the gateway turns away for now (admission's queue or TTL, a rate or
concurrency limit, a process shutting down, the gateway unreachable) is sent
again after a pause: yielding is not failing. A backend failure (5xx) is
tried NEXUS_BATCH_MAX_ATTEMPTS times, then it is an error line; any other
HTTP error is an error line at once. A spent budget stops the batch: the
lines not run get ``budget_exceeded``.

Meanwhile the worker's own thread renews the lease, saves the counts, and
watches for a cancel (no new line starts; those running finish and stay)
and for the completion window's end (the rest is expired). A runner that
loses its lease stops writing at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from usage import batch_credential
from usage.batches import jobs, storage
from usage.batches.results import (
    BUDGET_EXCEEDED,
    CANCELLED,
    EXPIRED,
    Progress,
    read_progress,
)
from usage.batches.validation import ANTHROPIC_ENDPOINT, split_lines
from usage.models import Batch, BatchStatus, File, FilePurpose, new_object_id

logger = logging.getLogger(__name__)

SUPERVISE_SECONDS = 0.5
ERROR_CODE_HEADER = "x-nexus-error-code"
# Refusals that mean "not now": the line is sent again after a pause.
YIELD_CODES = frozenset(
    {
        "queue_full",
        "flow_queue_full",
        "queue_ttl_expired",
        "preempted",
        "rate_limit_exceeded",
        "concurrency_limit_exceeded",
        "stream_limit_exceeded",
        "limits_unavailable",
        "shutting_down",
        "configuration_unavailable",
    }
)
MAX_PAUSE = 10.0
LOST = "lost"
_FINAL = {
    None: BatchStatus.COMPLETED,
    BUDGET_EXCEEDED: BatchStatus.COMPLETED,
    CANCELLED: BatchStatus.CANCELLED,
    EXPIRED: BatchStatus.EXPIRED,
}
_NOT_RUN_MESSAGES = {
    CANCELLED: "The batch was cancelled before this request ran.",
    EXPIRED: "The batch's completion window ended before this request ran.",
    BUDGET_EXCEEDED: "The key's budget was used up before this request ran.",
}


@dataclass(frozen=True, slots=True)
class Line:
    """One request of the batch's input file."""

    number: int
    custom_id: str
    body: bytes


def run_batch(batch_id: str) -> str:
    """Run (or resume, or finish) a batch if no other runner holds it.

    Returns what happened: "not claimed", "lost", or the final status.
    """
    me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    batch = _claim(batch_id, me)
    if batch is None:
        return "not claimed"
    try:
        if batch.status == BatchStatus.VALIDATING:
            Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
                status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now()
            )
            batch.refresh_from_db()
        if not storage.absolute(storage.input_path(batch.input_file_key)).is_file():
            return _fail(batch, me, "input_file_missing", "The input file is gone.")
        progress = read_progress(batch.id)
        reason = _stop_reason(batch)
        if reason is None:
            reason = _LineRun(batch, progress, me).run()
        if reason == LOST:
            return LOST
        return _finish(batch, progress, reason, me)
    finally:
        Batch.objects.filter(pk=batch_id, lease_owner=me).update(
            lease_owner="", lease_until=None
        )
        _start_waiting(batch_id)


def _claim(batch_id: str, me: str) -> Batch | None:
    now = timezone.now()
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None or not batch.is_active:
        return None
    running = Batch.objects.active().filter(lease_until__gte=now).exclude(pk=batch_id)
    if running.count() >= settings.NEXUS_BATCH_RUNNING:
        return None
    if (
        running.filter(owner_prefix=batch.owner_prefix).count()
        >= settings.NEXUS_BATCH_KEY_BATCHES
    ):
        return None
    lease = timedelta(seconds=settings.NEXUS_BATCH_LEASE_SECONDS)
    claimed = (
        Batch.objects.claimable(now)
        .filter(pk=batch_id)
        .update(lease_owner=me, lease_until=now + lease)
    )
    if not claimed:
        return None
    batch.refresh_from_db()
    return batch


def _start_waiting(done: str) -> None:
    """Queue the batches that waited for a runner (this one's place is free).

    Not `done` itself: a batch whose runner failed is resumed by the beat,
    not at once in a loop."""
    waiting = (
        Batch.objects.claimable(timezone.now())
        .exclude(pk=done)
        .values_list("id", flat=True)
    )
    for batch_id in waiting[: settings.NEXUS_BATCH_RUNNING]:
        jobs.start(batch_id)


def _fail(batch: Batch, me: str, code: str, message: str) -> str:
    """End a batch that cannot run at all (OpenAI's ``failed``)."""
    Batch.objects.filter(pk=batch.pk, lease_owner=me).update(
        status=BatchStatus.FAILED,
        failed_at=timezone.now(),
        errors=[{"code": code, "message": message, "line": None, "param": None}],
    )
    logger.warning("Batch %s failed: %s", batch.id, message)
    return str(BatchStatus.FAILED)


def _stop_reason(batch: Batch) -> str | None:
    if batch.status == BatchStatus.CANCELLING:
        return CANCELLED
    if batch.expires_at <= timezone.now():
        return EXPIRED
    return None


class _LineRun:
    """Sends a batch's pending lines (an event loop in its own thread) while
    the calling thread supervises (lease, counts, cancel, expiry)."""

    def __init__(self, batch: Batch, progress: Progress, me: str) -> None:
        self.batch = batch
        self.progress = progress
        self.me = me
        self.stop = threading.Event()
        self.reason: str | None = None
        # Valid until the batch expires, and a line sent just before then.
        expires = batch.expires_at.timestamp() + settings.NEXUS_BATCH_LINE_TIMEOUT
        self.credential = batch_credential.sign(
            batch_credential.derive_secret(settings.SECRET_KEY),
            batch.owner_prefix,
            batch.id,
            int(expires),
        )
        self.writer = _ResultWriter(batch.id)

    def run(self) -> str | None:
        thread = threading.Thread(
            target=self._send_all, name=f"batch-{self.batch.id}", daemon=True
        )
        thread.start()
        try:
            while thread.is_alive():
                thread.join(SUPERVISE_SECONDS)
                self._supervise()
        finally:
            self.halt(self.reason)  # the thread ends on any exception here too
            thread.join()
            self.writer.close()
        return self.reason

    def halt(self, reason: str | None) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()

    def _supervise(self) -> None:
        if self.reason == LOST:
            return
        now = timezone.now()
        progress = self.progress
        kept = Batch.objects.filter(pk=self.batch.pk, lease_owner=self.me).update(
            lease_until=now + timedelta(seconds=settings.NEXUS_BATCH_LEASE_SECONDS),
            completed=progress.succeeded,
            failed=progress.errored,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=progress.completion_tokens,
        )
        if not kept:
            logger.warning("Batch %s: another runner took it over", self.batch.id)
            self.writer.lost = True
            self.halt(LOST)
            return
        status, expires_at = (
            Batch.objects.filter(pk=self.batch.pk)
            .values_list("status", "expires_at")
            .get()
        )
        if status == BatchStatus.CANCELLING:
            self.halt(CANCELLED)
        elif expires_at <= now:
            self.halt(EXPIRED)

    def _send_all(self) -> None:
        try:
            asyncio.run(self._send_lines())
        except Exception:
            logger.exception("Batch %s: the runner failed", self.batch.id)
            self.halt(LOST)  # resumed by another runner once the lease runs out

    async def _send_lines(self) -> None:
        lines = pending_lines(self.batch, self.progress.done)
        timeout = httpx.Timeout(settings.NEXUS_BATCH_LINE_TIMEOUT, connect=10.0)
        limits = httpx.Limits(max_connections=settings.NEXUS_BATCH_CONCURRENCY)
        async with httpx.AsyncClient(
            base_url=settings.NEXUS_BATCH_GATEWAY_URL, timeout=timeout, limits=limits
        ) as client:
            await asyncio.gather(
                *(
                    self._send_some(client, lines)
                    for _ in range(settings.NEXUS_BATCH_CONCURRENCY)
                )
            )

    async def _send_some(
        self, client: httpx.AsyncClient, lines: Iterator[Line]
    ) -> None:
        while not self.stop.is_set():
            line = next(lines, None)
            if line is None:
                return
            result = await self._send(client, line)
            if result is None:
                return  # stopped: the line stays pending
            entry, succeeded = result
            if not self.writer.write(entry, succeeded):
                return
            self.progress.count(entry, succeeded)
            if not succeeded and _error_code(entry) == BUDGET_EXCEEDED:
                self.halt(BUDGET_EXCEEDED)

    async def _send(
        self, client: httpx.AsyncClient, line: Line
    ) -> tuple[dict[str, Any], bool] | None:
        """The line's result entry and whether it succeeded; None if stopped."""
        headers = {
            batch_credential.HEADER: self.credential,
            "content-type": "application/json",
            "x-request-id": f"{self.batch.id}-{line.number}",
        }
        if self.batch.endpoint == ANTHROPIC_ENDPOINT:
            headers["anthropic-version"] = "2023-06-01"
        failures = 0
        pause = 0.25
        while not self.stop.is_set():
            try:
                response = await client.post(
                    self.batch.endpoint, content=line.body, headers=headers
                )
            except httpx.HTTPError as error:
                # The gateway itself is unreachable (restarting?): not the
                # line's fault; try again while the batch lives.
                logger.info("Batch %s: gateway unreachable (%s)", self.batch.id, error)
                await self._pause(pause)
                pause = min(MAX_PAUSE, pause * 2)
                continue
            status = response.status_code
            if status < 400:
                return _entry(line, response), True
            code = response.headers.get(ERROR_CODE_HEADER, "")
            if code in YIELD_CODES:
                await self._pause(_retry_after(response, pause))
                continue
            failures += 1
            if status >= 500 and failures < settings.NEXUS_BATCH_MAX_ATTEMPTS:
                await self._pause(pause)
                pause = min(MAX_PAUSE, pause * 2)
                continue
            return _entry(line, response, code), False
        return None

    async def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, seconds))


class _ResultWriter:
    """Appends result lines to the batch's output and error files."""

    def __init__(self, batch_id: str) -> None:
        output, errors = storage.result_paths(batch_id)
        storage.absolute(output).parent.mkdir(parents=True, exist_ok=True)
        self._files: dict[bool, IO[bytes]] = {
            True: storage.absolute(output).open("ab"),
            False: storage.absolute(errors).open("ab"),
        }
        self.lost = False

    def write(self, entry: dict[str, Any], succeeded: bool) -> bool:
        """Append one result (a whole line per write); False once the lease is lost."""
        if self.lost:
            return False
        handle = self._files[succeeded]
        handle.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        handle.flush()  # in the OS now: survives the process being killed
        return True

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()


def pending_lines(batch: Batch, done: set[str]) -> Iterator[Line]:
    """The input file's requests without a result yet, in file order."""
    path = storage.input_path(batch.input_file_key)
    for number, raw in enumerate(split_lines(storage.read_chunks(path)), start=1):
        if not raw.strip():
            continue
        request = json.loads(raw)
        custom_id = request["custom_id"]
        if custom_id in done:
            continue
        body = dict(request["body"])
        body.pop("stream", None)  # a batch line is answered whole
        yield Line(number, custom_id, json.dumps(body).encode())


def _entry(line: Line, response: httpx.Response, code: str = "") -> dict[str, Any]:
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    entry: dict[str, Any] = {
        "id": new_object_id("batch_req_"),
        "custom_id": line.custom_id,
        "response": {
            "status_code": response.status_code,
            "request_id": response.headers.get("x-request-id", ""),
            "body": body,
        },
        "error": None,
    }
    if code:
        entry["error"] = {"code": code, "message": _message_of(body)}
    return entry


def _message_of(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""


def _error_code(entry: dict[str, Any]) -> str:
    error = entry.get("error")
    return str(error.get("code", "")) if isinstance(error, dict) else ""


def _retry_after(response: httpx.Response, default: float) -> float:
    try:
        seconds = float(response.headers.get("retry-after", default))
    except ValueError:
        seconds = default
    return min(MAX_PAUSE, max(0.1, seconds))


def _finish(batch: Batch, progress: Progress, reason: str | None, me: str) -> str:
    """Write what never ran (cancelled, expired, budget), then end the batch."""
    now = timezone.now()
    if reason is None:
        Batch.objects.filter(pk=batch.pk, lease_owner=me).update(
            status=BatchStatus.FINALIZING, finalizing_at=now
        )
    elif reason in _NOT_RUN_MESSAGES:
        writer = _ResultWriter(batch.id)
        try:
            for line in pending_lines(batch, progress.done):
                entry = _not_run(line, reason)
                writer.write(entry, False)
                progress.count(entry, False)
        finally:
            writer.close()
    status = _FINAL[reason]
    output, errors = storage.result_paths(batch.id)
    with transaction.atomic():
        output_file = _result_file(batch, output, progress.succeeded, "output")
        error_count = progress.errored + progress.cancelled + progress.expired
        error_file = _result_file(batch, errors, error_count, "errors")
        ended = {
            BatchStatus.COMPLETED: "completed_at",
            BatchStatus.CANCELLED: "cancelled_at",
            BatchStatus.EXPIRED: "expired_at",
        }[status]
        Batch.objects.filter(pk=batch.pk, lease_owner=me).update(
            status=status,
            output_file=output_file,
            error_file=error_file,
            completed=progress.succeeded,
            failed=progress.errored,
            cancelled_lines=progress.cancelled,
            expired_lines=progress.expired,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=progress.completion_tokens,
            **{ended: now},
        )
    logger.info(
        "Batch %s %s: %d succeeded, %d errored, %d cancelled, %d expired",
        batch.id,
        status,
        progress.succeeded,
        progress.errored,
        progress.cancelled,
        progress.expired,
    )
    return str(status)


def _not_run(line: Line, reason: str) -> dict[str, Any]:
    return {
        "id": new_object_id("batch_req_"),
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": reason, "message": _NOT_RUN_MESSAGES[reason]},
    }


def _result_file(batch: Batch, path: str, lines: int, kind: str) -> File | None:
    if not lines:
        return None
    return File.objects.create(
        id=new_object_id("file-"),
        owner_prefix=batch.owner_prefix,
        purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch.id}_{kind}.jsonl",
        bytes=storage.size_of(path),
        line_count=lines,
        path=path,
        expires_at=timezone.now() + timedelta(days=settings.NEXUS_BATCH_FILE_DAYS),
    )
