"""A keyed work queue: each key is processed by one worker at a time, adds are de-duplicated.

Unlike the reference implementation's queue there is no global token bucket: a burst of 10,000
pods is worked off as fast as the provider and the apiserver allow. Only failures slow down, per
key, with exponential back-off that never gives up (dropping a key after N retries, as the
reference does, leaves pods stuck forever).

Workers are started as items arrive, up to `workers` at once, and end after `idle_seconds`
without work: a fleet of a thousand quiet nodes in one process holds no worker tasks, so the
bound on a busy node's concurrency can be high (a burst's status writes are many requests
waiting on a loaded apiserver at once: with 32 in flight, a 10,000-pod burst's pods reached
Running 6 to 9 s after their creation; with 96, half a second).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ..sdk.retry import Backoff

log = logging.getLogger(__name__)
# Failures of an item logged at INFO before they become warnings (~6 s at the default delays).
_QUIET_RETRIES = 7


class WorkQueue:
    def __init__(
        self,
        process: Callable[[str], Awaitable[None]],
        *,
        name: str,
        workers: int = 96,
        idle_seconds: float = 30.0,
        base_delay: float = 0.05,
        max_delay: float = 300.0,
        outage: tuple[type[Exception], ...] = (),
        outage_max_delay: float = 5.0,
        explained: tuple[type[Exception], ...] = (),
    ) -> None:
        """`outage`: failures that say the apiserver is away rather than that the item is bad;
        they back off to `outage_max_delay` at most, so that every item is retried within a few
        seconds of its return instead of up to twice the outage's length later. `explained`:
        failures already told to the user (an Event, a status reason) whose message says it
        all; logged without a stack, which would only point at the queue."""
        self._process = process
        self.name = name
        self._workers = workers
        self._idle_seconds = idle_seconds
        self._group: asyncio.TaskGroup | None = None  # set while `run` runs
        self._running = 0  # worker tasks alive
        self._waiting = 0  # of those, waiting for an item
        # The rule only, per key's count of failures; no jitter: keys fail at different times.
        self._backoff = Backoff(initial=base_delay, cap=max_delay, jitter=0.0)
        self._outage = outage
        self._outage_max_delay = outage_max_delay
        self._explained = explained
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._processing: set[str] = set()
        self._dirty: set[str] = set()  # added again while being processed
        self._failures: dict[str, int] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.processed = 0

    def add(self, key: str) -> None:
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._queue.put_nowait(key)
        self._spawn()

    def _spawn(self) -> None:
        """One more worker, if every live one is busy and the bound allows."""
        if self._group is None or self._running >= self._workers:
            return
        if self._waiting >= self._queue.qsize():
            return  # a waiting worker takes it
        self._running += 1
        self._group.create_task(self._worker())

    def add_after(self, key: str, delay: float) -> None:
        """Add `key` after `delay` seconds; an earlier pending timer for the key wins."""
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        existing = self._timers.get(key)
        if existing is not None and existing.when() <= loop.time() + delay:
            return
        if existing is not None:
            existing.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: str) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: str) -> None:
        """Drop retry state for a key that no longer exists."""
        self._failures.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def __len__(self) -> int:
        return len(self._queued) + len(self._processing)

    @property
    def retrying(self) -> int:
        """Keys whose last attempt failed (waiting for, or in, a retry)."""
        return len(self._failures)

    @property
    def workers_running(self) -> int:
        return self._running

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            for _ in range(min(self._queue.qsize(), self._workers)):  # added before the run
                self._spawn()
            try:
                await asyncio.Event().wait()  # until cancelled; the workers come and go
            finally:
                # Before the group cancels the workers: a cancelled worker re-adds its key if it
                # was added again meanwhile, and a new worker in a group that is shutting down
                # would turn the agent's clean stop into an error.
                self._group = None

    async def _worker(self) -> None:
        try:
            await self._work()
        finally:
            self._running -= 1
        if self._queue.qsize() > self._waiting:
            self._spawn()  # idle no more: an item arrived as this worker was leaving

    async def _work(self) -> None:
        while True:
            self._waiting += 1
            try:
                async with asyncio.timeout(self._idle_seconds):
                    key = await self._queue.get()
            except TimeoutError:
                return
            finally:
                self._waiting -= 1
            self._queued.discard(key)
            self._processing.add(key)
            try:
                await self._process(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                cap = self._outage_max_delay if isinstance(e, self._outage) else None
                delay = self._backoff.delay(failures, cap=cap)
                # The first few seconds of failures are often races that retrying settles (the
                # Node authorizer learns of a new pod's objects a moment after the pod appears):
                # a warning only once an item has kept failing.
                level = logging.WARNING if failures > _QUIET_RETRIES else logging.INFO
                log.log(
                    level,
                    "%s: %s failed (%s); retry %d in %.2fs",
                    self.name,
                    key,
                    e,
                    failures,
                    delay,
                    exc_info=failures == _QUIET_RETRIES + 1 and not isinstance(e, self._explained),
                )
                self.add_after(key, delay)
            else:
                self._failures.pop(key, None)
            finally:
                self.processed += 1
                self._processing.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
