"""Opens, progress, beats and the reconciliation of a dead process's requests.

A request the pipeline takes is opened (a ``UsageOpen`` in the buffer) and
settled by its usage event under the same id. What a killed process left open
becomes a record marked lost, billed as last reported, exactly once whatever
arrives when.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from tests.factories import UsageEventFactory
from usage.buffer import (
    UsageBeat,
    UsageBuffer,
    UsageOpen,
    decode_events,
    encode_events,
    new_event_id,
    process_id,
)
from usage.flush import flush_usage
from usage.lost import LOST_ERROR, reconcile_lost_usage
from usage.models import OpenRequest, TokenUsage, UsageRecord
from usage.progress import OpenRequests
from usage.rollup import roll_up_usage
from usage.stream import STREAM_KEY, clear_usage_stream

pytestmark = pytest.mark.django_db


def _open(event_id: str, **progress: object) -> UsageOpen:
    return UsageOpen(
        event_id=event_id,
        process=process_id(),
        request_id=f"req-{event_id[-4:]}",
        endpoint="chat",
        api_key_prefix="nx-aaaaaaaa",
        requested_model="llama3:8b",
        streamed=True,
        created_at=timezone.now().timestamp(),
        **progress,  # type: ignore[arg-type]
    )


def _flush(*items: object) -> None:
    buffer = UsageBuffer()
    for item in items:
        buffer.append(item)  # type: ignore[arg-type]
    flush_usage(buffer)


def _silence(seconds: float) -> None:
    """As if no beat had come for `seconds`."""
    OpenRequest.objects.update(seen_at=timezone.now() - timedelta(seconds=seconds))


def test_a_request_opened_and_settled_in_one_batch_leaves_no_open_row() -> None:
    event_id = new_event_id()
    _flush(_open(event_id), UsageEventFactory(event_id=event_id))

    assert OpenRequest.objects.count() == 0
    assert UsageRecord.objects.get().event_id == event_id


def test_a_settle_in_a_later_batch_removes_its_open_row() -> None:
    event_id = new_event_id()
    _flush(_open(event_id))
    assert OpenRequest.objects.get().event_id == event_id

    _flush(UsageEventFactory(event_id=event_id))

    assert OpenRequest.objects.count() == 0
    record = UsageRecord.objects.get()
    assert record.event_id == event_id and not record.reconciled


def test_a_settle_behind_its_last_progress_removes_the_open_row() -> None:
    event_id = new_event_id()
    _flush(_open(event_id))
    _flush(
        _open(event_id, backend="gpu-1", total_tokens=3),
        UsageEventFactory(event_id=event_id),
    )

    assert OpenRequest.objects.count() == 0
    assert UsageRecord.objects.get().event_id == event_id


def test_a_dead_processs_stream_is_recorded_lost_billed_as_last_reported() -> None:
    streaming, queued = new_event_id(), new_event_id()
    _flush(_open(streaming), _open(queued))
    # Its last progress: routed to gpu-1, 30 tokens counted so far.
    progress = _open(
        streaming,
        backend="gpu-1",
        served_model="llama3:8b",
        prompt_tokens=10,
        completion_tokens=20,
        total_tokens=30,
        cost_nanos=700,
        status=200,
    )
    _flush(progress)
    _silence(31)

    assert reconcile_lost_usage(lost_after=30) == 2

    assert OpenRequest.objects.count() == 0
    stream = UsageRecord.objects.get(event_id=streaming)
    assert (stream.backend, stream.status, stream.total_tokens) == ("gpu-1", 200, 30)
    assert stream.cost_nanos == 700 and stream.completion_tokens == 20
    assert stream.reconciled and stream.is_error and stream.error == LOST_ERROR
    waiting = UsageRecord.objects.get(event_id=queued)
    assert (waiting.backend, waiting.status, waiting.total_tokens) == ("", 0, 0)
    assert waiting.reconciled and waiting.is_error


def test_a_live_processs_beats_keep_its_requests_open() -> None:
    event_id = new_event_id()
    _flush(_open(event_id))
    _silence(31)
    _flush(UsageBeat(process_id()))

    assert reconcile_lost_usage(lost_after=30) == 0
    assert OpenRequest.objects.count() == 1
    assert UsageRecord.objects.count() == 0


def test_usage_counts_once_whichever_of_settle_and_reconcile_comes_first() -> None:
    late, early = new_event_id(), new_event_id()
    _flush(_open(late), _open(early))
    _flush(UsageEventFactory(event_id=early, total_tokens=15))
    _silence(31)
    assert reconcile_lost_usage(lost_after=30) == 1
    # The settle of a request already recorded lost comes after all.
    _flush(UsageEventFactory(event_id=late, total_tokens=99))
    # An open replayed late (a spill file) after its settle.
    _flush(_open(early))
    _silence(31)
    reconcile_lost_usage(lost_after=30)
    roll_up_usage()

    assert UsageRecord.objects.count() == 2
    assert UsageRecord.objects.get(event_id=late).reconciled
    assert not UsageRecord.objects.get(event_id=early).reconciled
    rolled = TokenUsage.objects.aggregate(
        requests=Sum("requests"), tokens=Sum("total_tokens")
    )
    assert rolled == {"requests": 2, "tokens": 15}


def test_progress_reports_only_what_changed_and_beats_while_open() -> None:
    buffer = UsageBuffer()
    requests = OpenRequests(buffer, 1.0)
    request = SimpleNamespace(numbers=None)
    requests.progress_of = lambda r: r.numbers
    assert requests.report() == 0
    assert len(buffer) == 0  # nothing open: no beat either

    opened = _open(new_event_id())
    requests.open(opened, request)
    assert buffer.drain() == [opened]
    assert requests.report() == 0  # no backend yet
    assert buffer.drain() == [UsageBeat(process_id())]

    request.numbers = ("gpu-1", "llama3:8b", 10, 4, 14, 0, 200)
    assert requests.report() == 1
    progress, beat = buffer.drain()
    assert isinstance(progress, UsageOpen) and progress.total_tokens == 14
    assert progress.event_id == opened.event_id and isinstance(beat, UsageBeat)
    assert requests.report() == 0  # unchanged

    requests.settle(opened.event_id)
    buffer.drain()
    assert requests.report() == 0 and len(buffer) == 0


def test_opens_and_beats_survive_the_stream_and_spill_encoding() -> None:
    event_id = new_event_id()
    items = [
        _open(event_id),
        UsageEventFactory(event_id=event_id),
        UsageBeat(process_id()),
        _open(new_event_id(), backend="gpu-1", total_tokens=3),
    ]

    decoded = decode_events(encode_events(items))  # type: ignore[arg-type]

    assert decoded == [items[0], items[3], items[2], items[1]]


def test_a_batch_without_opens_is_read_as_before() -> None:
    event = UsageEventFactory()
    assert decode_events(encode_events([event])) == [event]
    assert b"opens" not in encode_events([event])


@pytest.mark.skipif(
    settings.NEXUS_USAGE_TRANSPORT != "redis", reason="the Redis transport only"
)
def test_reconciling_drains_the_stream_first() -> None:
    import redis

    clear_usage_stream()
    event_id = new_event_id()
    _flush(_open(event_id))
    _silence(31)
    # Its settle still waits in the Redis stream.
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        settle = encode_events([UsageEventFactory(event_id=event_id)])
        client.xadd(STREAM_KEY, {"b": settle})
    finally:
        client.close()

    assert reconcile_lost_usage(lost_after=30) == 0
    assert not UsageRecord.objects.get(event_id=event_id).reconciled
    assert OpenRequest.objects.count() == 0


def test_beat_reconciles_lost_usage_in_both_modes() -> None:
    entry = settings.CELERY_BEAT_SCHEDULE["reconcile-lost-usage"]
    assert entry["task"] == "usage.tasks.reconcile_lost_usage"
    assert entry["schedule"] <= settings.NEXUS_USAGE_LOST_AFTER


def test_a_lost_ensemble_step_keeps_its_ensemble_id() -> None:
    step, plain = new_event_id(), new_event_id()
    opened = _open(step, ensemble_id="ens-1234")
    # Through the Redis stream's (and the spill's) encoding as well.
    (decoded,) = decode_events(encode_events([opened]))
    assert decoded == opened
    _flush(decoded, _open(plain))
    _flush(dataclasses.replace(opened, backend="gpu-1", total_tokens=5))
    _silence(31)

    assert reconcile_lost_usage(lost_after=30) == 2

    assert UsageRecord.objects.get(event_id=step).ensemble_id == "ens-1234"
    assert UsageRecord.objects.get(event_id=plain).ensemble_id == ""
