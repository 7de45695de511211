"""The keyed work queue: one worker per key at a time, de-duplicated adds, back-off per key on
failure and no global rate limit."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from vkubelet.kube import WorkQueue

from ..node.helpers import always, eventually


@pytest.fixture
async def running() -> AsyncIterator[Callable[[WorkQueue], None]]:
    tasks: list[asyncio.Task[None]] = []

    def start(queue: WorkQueue) -> None:
        tasks.append(asyncio.create_task(queue.run()))

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def recorder() -> tuple[list[str], Callable[[str], Awaitable[None]]]:
    seen: list[str] = []

    async def process(key: str) -> None:
        seen.append(key)

    return seen, process


async def test_a_key_is_never_processed_by_two_workers_at_once(
    running: Callable[[WorkQueue], None],
) -> None:
    active: Counter[str] = Counter()
    overlaps: list[str] = []
    done: Counter[str] = Counter()

    async def process(key: str) -> None:
        active[key] += 1
        if active[key] > 1:
            overlaps.append(key)
        await asyncio.sleep(0.01)
        active[key] -= 1
        done[key] += 1

    queue = WorkQueue(process, name="test", workers=8)
    running(queue)
    for _ in range(20):
        queue.add("a")
        queue.add("b")
        await asyncio.sleep(0.003)
    await eventually(lambda: len(queue) == 0 and done["a"] >= 2, what="the queue to drain")
    assert overlaps == []


async def test_adds_of_a_queued_key_are_merged(running: Callable[[WorkQueue], None]) -> None:
    seen, process = recorder()
    queue = WorkQueue(process, name="test", workers=2)
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    queue.add("a")
    running(queue)
    await eventually(lambda: len(queue) == 0 and len(seen) >= 2)
    await asyncio.sleep(0.05)
    assert sorted(seen) == ["a", "b"]


async def test_a_key_added_while_processing_is_processed_again(
    running: Callable[[WorkQueue], None],
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    runs = 0

    async def process(key: str) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            started.set()
            await release.wait()

    queue = WorkQueue(process, name="test", workers=4)
    running(queue)
    queue.add("a")
    await asyncio.wait_for(started.wait(), 2)
    queue.add("a")  # the change arrived after the worker read the state: it must run again
    queue.add("a")
    release.set()
    await eventually(lambda: runs == 2 and len(queue) == 0)
    await asyncio.sleep(0.05)
    assert runs == 2


async def test_a_failing_key_is_retried_with_growing_delays_until_it_succeeds(
    running: Callable[[WorkQueue], None],
) -> None:
    stamps: list[float] = []

    async def process(key: str) -> None:
        stamps.append(time.monotonic())
        if len(stamps) <= 3:
            raise RuntimeError("transient")

    queue = WorkQueue(process, name="test", workers=2, base_delay=0.02)
    running(queue)
    queue.add("a")
    await eventually(lambda: len(stamps) == 4, what="three retries")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert gaps[0] >= 0.015
    assert gaps[1] >= 0.035
    assert gaps[2] >= 0.075
    await asyncio.sleep(0.2)
    assert len(stamps) == 4, "a key that succeeded must not be retried"


async def test_failures_during_an_outage_back_off_to_a_short_cap(
    running: Callable[[WorkQueue], None],
) -> None:
    """An item that failed all through an apiserver outage is retried soon after its return
    (found by the resilience benchmark: up to ~50 s later after a 50 s outage)."""
    stamps: dict[str, list[float]] = {"outage": [], "bad": []}

    async def process(key: str) -> None:
        stamps[key].append(time.monotonic())
        raise ConnectionError("away") if key == "outage" else RuntimeError("bad item")

    queue = WorkQueue(
        process, name="test", base_delay=0.02, outage=(ConnectionError,), outage_max_delay=0.1
    )
    running(queue)
    queue.add("outage")
    queue.add("bad")
    await asyncio.sleep(1.0)
    outage_gaps = [b - a for a, b in itertools.pairwise(stamps["outage"])]
    assert max(outage_gaps) < 0.2
    assert len(stamps["outage"]) >= 8
    assert len(stamps["bad"]) <= 6  # 0.02, 0.04, ... 0.32: growing past the cap


async def test_back_off_is_per_key(running: Callable[[WorkQueue], None]) -> None:
    seen: list[str] = []

    async def process(key: str) -> None:
        seen.append(key)
        if key == "bad":
            raise RuntimeError("always")

    queue = WorkQueue(process, name="test", workers=2, base_delay=0.5)
    running(queue)
    queue.add("bad")
    await eventually(lambda: "bad" in seen)
    for i in range(10):
        queue.add(f"good-{i}")
    await eventually(lambda: sum(k.startswith("good") for k in seen) == 10, within=0.4)


async def test_add_after_runs_the_key_after_the_delay_and_earliest_timer_wins(
    running: Callable[[WorkQueue], None],
) -> None:
    stamps: dict[str, float] = {}

    async def process(key: str) -> None:
        stamps[key] = time.monotonic()

    queue = WorkQueue(process, name="test", workers=2)
    running(queue)
    start = time.monotonic()
    queue.add_after("late", 0.15)
    queue.add_after("late", 5.0)  # a later timer does not postpone the earlier one
    queue.add_after("soon", 5.0)
    queue.add_after("soon", 0.05)  # an earlier timer replaces the later one
    await eventually(lambda: "late" in stamps and "soon" in stamps, within=2)
    assert stamps["soon"] - start >= 0.045
    assert stamps["late"] - start >= 0.145
    assert stamps["soon"] < stamps["late"]


async def test_forget_cancels_a_pending_retry(running: Callable[[WorkQueue], None]) -> None:
    seen, process = recorder()
    queue = WorkQueue(process, name="test", workers=1)
    running(queue)
    queue.add_after("gone", 0.05)
    queue.forget("gone")
    await always(lambda: seen == [], duration=0.15)


async def test_no_global_rate_limit_a_thousand_keys_are_processed_quickly(
    running: Callable[[WorkQueue], None],
) -> None:
    seen, process = recorder()
    queue = WorkQueue(process, name="test", workers=32)
    running(queue)
    start = time.monotonic()
    for i in range(1000):
        queue.add(f"ns/pod-{i}")
    await eventually(lambda: len(seen) == 1000, within=5)
    # The reference's 10/s token bucket (burst 100) would need 90 s for this.
    assert time.monotonic() - start < 2.0
    assert queue.processed == 1000


async def test_workers_start_with_work_up_to_the_bound_and_end_when_idle(
    running: Callable[[WorkQueue], None],
) -> None:
    release = asyncio.Event()
    busy = 0
    most = 0

    async def process(key: str) -> None:
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        await release.wait()
        busy -= 1

    queue = WorkQueue(process, name="t", workers=8, idle_seconds=0.2)
    queue.add("early")  # before the run: started with it
    running(queue)
    await eventually(lambda: busy == 1)
    assert queue.workers_running == 1  # a quiet queue holds no more tasks than its work
    for i in range(20):
        queue.add(f"k{i}")
    await eventually(lambda: busy == 8)
    await always(lambda: most == 8, duration=0.1)  # never more than the bound
    release.set()
    await eventually(lambda: queue.processed == 21)
    await eventually(lambda: queue.workers_running == 0, what="idle workers ending")
    queue.add("late")  # and work after that starts a worker again
    await eventually(lambda: queue.processed == 22)


async def test_stopping_while_a_key_is_re_added_mid_processing_is_a_clean_cancel() -> None:
    """A SIGTERM during a burst: the cancelled worker re-adds its dirty key as it unwinds, and
    the queue must stop with a plain cancellation, not an error from a worker started in a
    group that is shutting down."""
    started = asyncio.Event()

    async def process(key: str) -> None:
        started.set()
        await asyncio.Event().wait()  # busy until cancelled

    queue = WorkQueue(process, name="test", workers=4)
    task = asyncio.create_task(queue.run())
    queue.add("a")
    await started.wait()
    queue.add("a")  # added again while being processed: dirty
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.workers_running == 0


class _Told(Exception):
    """A failure already reported to the user."""


@pytest.mark.parametrize(("failure", "stack"), [(ValueError, True), (_Told, False)])
async def test_a_long_failing_item_is_logged_with_its_stack_unless_its_failure_is_explained(
    running: Callable[[WorkQueue], None],
    caplog: pytest.LogCaptureFixture,
    failure: type[Exception],
    stack: bool,
) -> None:
    async def process(key: str) -> None:
        raise failure(f"{key} is bad")

    queue = WorkQueue(process, name="q", base_delay=0.001, max_delay=0.001, explained=(_Told,))
    running(queue)
    queue.add("a")
    await eventually(lambda: any(r.levelname == "WARNING" for r in caplog.records))
    warning = next(r for r in caplog.records if r.levelname == "WARNING")
    assert "a is bad" in warning.getMessage()
    assert bool(warning.exc_info) is stack
