"""The admission core's batch lane on a simulated clock.

Batch lines go only when no interactive request waits and the pool's stock is
below the batch limit (the dispatch limit less the headroom); every
interactive request, whatever its criticality, goes first.
"""

from __future__ import annotations

import pytest

from routing.admission import AdmissionController, AdmissionSettings, Outcome, Ticket
from routing.admission.batch_lane import batch_limit

pytestmark = pytest.mark.mode_independent

GO = (Outcome.BYPASSED, Outcome.DISPATCHED)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(watermark: float = 4.0, **knobs: object) -> AdmissionController:
    settings = AdmissionSettings(
        watermark_per_backend=watermark,
        lower_bound_per_backend=watermark,
        upper_bound_per_backend=watermark,
        **knobs,  # type: ignore[arg-type]
    )
    return AdmissionController(settings, clock=Clock())


def submit(
    control: AdmissionController, flow: str, started: list[Ticket], batch: bool
) -> Ticket:
    ticket = Ticket(
        flow=flow,
        batch=batch,
        on_done=lambda t: started.append(t) if t.outcome in GO else None,
    )
    control.admit(ticket, "pool", 1)
    if ticket.outcome in GO:
        started.append(ticket)
    return ticket


@pytest.mark.parametrize(
    ("limit", "headroom", "expected"),
    [(8, 0.125, 7), (4, 0.125, 3), (1, 0.125, 1), (2, 0.5, 1), (10, 0.0, 10)],
)
def test_the_batch_limit_keeps_a_headroom_but_never_reaches_zero(
    limit: int, headroom: float, expected: int
) -> None:
    assert batch_limit(limit, headroom) == expected


def test_batch_lines_stop_below_the_band_and_leave_room_for_interactive() -> None:
    control = controller()  # band: 4 requests, batch limit 3
    started: list[Ticket] = []
    lines = [submit(control, "batch", started, batch=True) for _ in range(10)]
    assert [t.outcome for t in lines[:3]] == [Outcome.BYPASSED] * 3
    assert all(t.outcome is None for t in lines[3:])
    interactive = submit(control, "user", started, batch=False)
    assert interactive.outcome is Outcome.BYPASSED  # the headroom was free
    assert control.batch_waiting == 7 and control.batch_running == 3


def test_every_waiting_interactive_request_goes_before_any_batch_line() -> None:
    control = controller()
    started: list[Ticket] = []
    first = [submit(control, "batch", started, batch=True) for _ in range(3)]
    waiting_lines = [submit(control, "batch", started, batch=True) for _ in range(3)]
    users = [submit(control, f"user{i}", started, batch=False) for i in range(4)]
    # One interactive request took the headroom; three wait.
    assert sum(t.outcome is None for t in users) == 3
    started.clear()
    for ticket in first:
        control.release(ticket)
    # The three slots freed go to the interactive requests, none to batch.
    assert [t.flow for t in started] == ["user1", "user2", "user3"]
    assert all(t.outcome is None for t in waiting_lines)
    for ticket in users:
        control.release(ticket)
    # Back to idle: batch lines up to the batch limit, in arrival order.
    assert started[3:] == waiting_lines


def test_a_waiting_batch_line_expires_after_the_ttl_and_can_be_cancelled() -> None:
    control = controller(watermark=1.0, queue_ttl=10.0)
    started: list[Ticket] = []
    submit(control, "batch", started, batch=True)  # batch limit 1: it goes
    expiring = submit(control, "batch", started, batch=True)
    leaving = submit(control, "batch", started, batch=True)
    control.release(leaving)
    assert leaving.outcome is Outcome.CANCELLED and control.batch_waiting == 1
    assert control.expire() == 10.0
    control.clock.now = 10.0  # type: ignore[attr-defined]
    control.expire()
    assert expiring.outcome is Outcome.EXPIRED and control.batch_waiting == 0


def test_batch_lines_let_through_leave_the_stock_at_zero() -> None:
    control = controller()
    started: list[Ticket] = []
    tickets = [submit(control, "batch", started, batch=True) for _ in range(6)]
    while started:
        control.release(started.pop(0))
    assert all(t.outcome in GO for t in tickets)
    assert control.stock == 0 and control.batch_running == 0 and not control.waiting


def test_the_headroom_is_checked() -> None:
    assert "batch_headroom" in AdmissionSettings.check(batch_headroom=1.0)
    assert not AdmissionSettings.check(batch_headroom=0.5)
