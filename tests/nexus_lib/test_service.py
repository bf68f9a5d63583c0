"""Services: periodic work, long-lived tasks, ordered start and bounded stop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from nexus_lib.service import (
    Service,
    TaskService,
    periodic,
    start_in_order,
    stop_in_reverse,
)

pytestmark = pytest.mark.mode_independent

# Far beyond any test's patience: nothing may wait for it to pass.
FOREVER = 3600.0
# Waits on events that the code under test sets; only a hang reaches it.
PATIENCE = 30.0


async def _let_the_loop_run() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_periodic_work_that_raises_is_logged_and_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    ran_again = asyncio.Event()

    def work() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("the database went away")
        ran_again.set()

    service = periodic("flaky", 0.001, work, error="Could not do the work")
    with caplog.at_level(logging.WARNING, logger="nexus_lib.service"):
        service.start()
        try:
            async with asyncio.timeout(PATIENCE):
                await ran_again.wait()
        finally:
            await service.stop()

    assert len(runs) >= 2
    (record,) = [r for r in caplog.records if r.getMessage() == "Could not do the work"]
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


async def test_periodic_logs_with_the_callers_logger_and_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mine = logging.getLogger("tests.periodic")
    raised = asyncio.Event()

    def work() -> None:
        raised.set()
        raise ValueError("bad")

    service = periodic("mine", FOREVER, work, immediately=True, log=mine.error)
    with caplog.at_level(logging.ERROR, logger="tests.periodic"):
        service.start()
        try:
            async with asyncio.timeout(PATIENCE):
                await raised.wait()
            await _let_the_loop_run()
        finally:
            await service.stop()

    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("tests.periodic", logging.ERROR)
    ]


async def test_periodic_runs_coroutine_functions() -> None:
    done = asyncio.Event()

    async def work() -> None:
        await asyncio.sleep(0)
        done.set()

    service = periodic("async", 0.001, work)
    service.start()
    try:
        async with asyncio.timeout(PATIENCE):
            await done.wait()
    finally:
        await service.stop()


async def test_periodic_waits_one_interval_before_the_first_run() -> None:
    runs: list[str] = []
    service = periodic("later", FOREVER, lambda: runs.append("ran"))
    service.start()
    await _let_the_loop_run()
    await service.stop()

    assert runs == []


async def test_periodic_can_run_at_once_then_wait() -> None:
    runs: list[str] = []
    first = asyncio.Event()

    def work() -> None:
        runs.append("ran")
        first.set()

    service = periodic("now", FOREVER, work, immediately=True)
    service.start()
    try:
        async with asyncio.timeout(PATIENCE):
            await first.wait()
        await _let_the_loop_run()
    finally:
        await service.stop()

    assert runs == ["ran"]


async def test_periodic_reads_a_callable_interval_before_each_wait() -> None:
    intervals = iter([0.0, 0.0, 0.0, FOREVER])
    asked: list[float] = []
    third = asyncio.Event()

    def interval() -> float:
        asked.append(next(intervals))
        return asked[-1]

    def work() -> None:
        if len(asked) == 3:
            third.set()

    service = periodic("changing", interval, work)
    service.start()
    try:
        async with asyncio.timeout(PATIENCE):
            await third.wait()
    finally:
        await service.stop()

    assert asked[:3] == [0.0, 0.0, 0.0]


async def test_stopping_a_periodic_cancels_its_wait_and_its_work() -> None:
    waiting = periodic("idle", FOREVER, lambda: None)
    working_started = asyncio.Event()

    async def work() -> None:
        working_started.set()
        await asyncio.Event().wait()  # never set: only a cancel ends it

    working = periodic("busy", FOREVER, work, immediately=True)
    waiting.start()
    working.start()
    async with asyncio.timeout(PATIENCE):
        await working_started.wait()
        await waiting.stop()
        await working.stop()

    assert not waiting.running and not working.running


async def test_a_task_service_runs_until_stopped_and_starts_again() -> None:
    started = asyncio.Event()
    ended: list[str] = []

    async def listen() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("ended")

    service = TaskService("listener", listen)
    for _ in range(2):
        started.clear()
        service.start()
        async with asyncio.timeout(PATIENCE):
            await started.wait()
        assert service.running
        await service.stop()
        assert not service.running

    assert ended == ["ended", "ended"]


async def test_a_task_service_that_dies_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def listen() -> None:
        raise RuntimeError("lost the channel layer")

    service = TaskService("listener", listen)
    with caplog.at_level(logging.ERROR, logger="nexus_lib.service"):
        service.start()
        await _let_the_loop_run()
        await service.stop()

    assert [r.getMessage() for r in caplog.records] == ["listener stopped on an error"]


class Recorded:
    """A service that notes its starts and stops in a shared journal."""

    def __init__(self, name: str, journal: list[str]) -> None:
        self.name = name
        self.journal = journal

    def start(self) -> None:
        self.journal.append(f"start {self.name}")

    async def stop(self) -> None:
        await asyncio.sleep(0)
        self.journal.append(f"stop {self.name}")


class Stuck(Recorded):
    """A stop that ignores its cancellation until `release` is set."""

    def __init__(self, name: str, journal: list[str]) -> None:
        super().__init__(name, journal)
        self.release = asyncio.Event()
        self.ended = asyncio.Event()

    async def stop(self) -> None:
        self.journal.append(f"stopping {self.name}")
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        self.ended.set()


class Failing(Recorded):
    def start(self) -> None:
        raise RuntimeError("cannot start")

    async def stop(self) -> None:
        raise RuntimeError("cannot stop")


async def test_services_start_in_order_and_stop_in_reverse() -> None:
    journal: list[str] = []
    services: list[Service] = [Recorded(name, journal) for name in "abc"]
    started: list[Service] = []

    start_in_order(services, started)
    overran = await stop_in_reverse(started, within=PATIENCE)

    assert journal == [
        "start a",
        "start b",
        "start c",
        "stop c",
        "stop b",
        "stop a",
    ]
    assert overran == []


async def test_a_start_that_fails_leaves_the_started_ones_to_stop() -> None:
    journal: list[str] = []
    services: list[Service] = [
        Recorded("a", journal),
        Failing("b", journal),
        Recorded("c", journal),
    ]
    started: list[Service] = []

    with pytest.raises(RuntimeError, match="cannot start"):
        start_in_order(services, started)

    assert [service.name for service in started] == ["a"]


async def test_a_stop_that_fails_is_logged_and_the_others_still_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal: list[str] = []
    services: list[Service] = [
        Recorded("a", journal),
        Failing("b", journal),
        Recorded("c", journal),
    ]

    with caplog.at_level(logging.ERROR, logger="nexus_lib.service"):
        overran = await stop_in_reverse(services, within=PATIENCE)

    assert journal == ["stop c", "stop a"]
    assert overran == []
    assert [r.getMessage() for r in caplog.records] == ["Stopping b failed"]


async def test_a_stuck_stop_is_left_behind_within_the_time_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal: list[str] = []
    stuck = Stuck("stuck", journal)
    services: list[Service] = [Recorded("a", journal), stuck, Recorded("c", journal)]
    loop = asyncio.get_running_loop()
    within = 0.5

    began = loop.time()
    with caplog.at_level(logging.WARNING, logger="nexus_lib.service"):
        overran = await stop_in_reverse(services, within=within)
    took = loop.time() - began
    stuck.release.set()
    async with asyncio.timeout(PATIENCE):
        await stuck.ended.wait()

    assert overran == ["stuck"]
    assert journal == ["stop c", "stopping stuck", "stop a"]
    # Bounded by the limit (a loaded machine may run the loop a little late).
    assert took < within + 5.0
    assert "stuck did not stop within" in caplog.text


async def test_a_stuck_stop_leaves_the_others_their_reserve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal: list[str] = []
    stuck = Stuck("stuck", journal)
    services: list[Service] = [Recorded("a", journal), Recorded("b", journal), stuck]

    with caplog.at_level(logging.WARNING, logger="nexus_lib.service"):
        overran = await stop_in_reverse(services, within=0.6)
    stuck.release.set()
    async with asyncio.timeout(PATIENCE):
        await stuck.ended.wait()

    # The first stop may take the limit less a sixth of it for each of the
    # two after it: a third stays for them, however long it is stuck.
    assert overran == ["stuck"]
    assert journal == ["stopping stuck", "stop b", "stop a"]
    assert "stuck did not stop within 0.4 s" in caplog.text
