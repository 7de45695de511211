"""Background tasks that are never lost: every one is logged when it fails, and either restarted
with back-off or allowed to fail its owner loudly.

A bare `asyncio.create_task` whose result nobody awaits swallows its exception (Python prints
"Task exception was never retrieved" at garbage collection, if ever) and, without a reference
kept, may even be collected while it runs. Every long-lived or fire-and-forget task of the agent
and of the providers goes through here instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx2 as httpx

from .retry import Backoff

log = logging.getLogger(__name__)

# A supervised task that ran this long without failing starts its next back-off from the bottom.
_STEADY_SECONDS = 60.0


async def run_supervised(
    work: Callable[[], Awaitable[None]],
    *,
    name: str,
    initial_backoff: float = 1.0,
    max_backoff: float = 60.0,
    logger: logging.Logger = log,
) -> None:
    """Run `work()` until it returns; when it raises, log the error and run it again after a
    back-off that doubles up to `max_backoff` (reset after a steady run). Cancellation stops it.
    """
    backoff = Backoff(initial=initial_backoff, cap=max_backoff, jitter=0.0)
    while True:
        started = time.monotonic()
        try:
            await work()
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if time.monotonic() - started > _STEADY_SECONDS:
                backoff.reset()
            delay = backoff.next_delay()
            if _unreachable(error):
                # A peer that is down (a lower cluster, a device) fails every retry the same
                # way: one line each, not a traceback each, so the log stays readable.
                logger.warning("%s failed: %s; restarting in %.1fs", name, error, delay)
            else:
                logger.exception("%s failed; restarting in %.1fs", name, delay)
        await asyncio.sleep(delay)


def _unreachable(error: BaseException) -> bool:
    """Whether `error` says a peer cannot be reached (as opposed to a bug worth a traceback)."""
    return isinstance(error, OSError | httpx.TransportError | asyncio.TimeoutError)


def supervise(
    work: Callable[[], Awaitable[None]],
    *,
    name: str,
    initial_backoff: float = 1.0,
    max_backoff: float = 60.0,
) -> asyncio.Task[None]:
    """A task running `run_supervised(work)`: restarted on failure, never silently gone."""
    return asyncio.create_task(
        run_supervised(work, name=name, initial_backoff=initial_backoff, max_backoff=max_backoff),
        name=name,
    )


class TaskSet:
    """Fire-and-forget tasks with an owner: kept referenced while they run, forgotten once done
    (so a long-lived process does not accumulate one finished task per pod), their failures
    logged, and all of them cancelled by `aclose()`.
    """

    def __init__(self, name: str, *, logger: logging.Logger = log) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._log = logger

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.name}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._log.error("%s failed", task.get_name(), exc_info=error)

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()


__all__ = ["TaskSet", "run_supervised", "supervise"]
