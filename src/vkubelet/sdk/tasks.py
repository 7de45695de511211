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
import io
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import httpx2 as httpx

from .retry import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

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
        """Cancel every task and wait until all have ended (their failures are logged by
        `_done`). A cancellation of the caller (a stop's bound) ends the wait: it is never
        mistaken for one of the tasks' own and swallowed."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._tasks.clear()


class SharedWatch(Generic[T]):
    """One watcher task for any number of waiters, living as long as one of them waits.

    A machine's end is watched once however many callers wait for it (the pod's run, a stop,
    a kill). When the last waiter is cancelled (its pod's run ends because the agent stops), the
    watcher is cancelled and awaited too, so what it watches runs on for the next agent. A
    watcher nobody awaits would be cancelled only by asyncio's final sweep, and its clean-up
    could then wait for ever on a reply whose reader was cancelled with it. A watcher that was
    cancelled is started again by the next waiter; one that finished keeps its result.
    """

    def __init__(self, watch: Callable[[], Coroutine[Any, Any, T]], *, name: str) -> None:
        self._watch = watch
        self._name = name
        self._task: asyncio.Task[T] | None = None
        self._waiting = 0

    async def wait(self) -> T:
        if self._task is None or self._task.cancelled():
            self._task = asyncio.create_task(self._watch(), name=self._name)
        task = self._task
        self._waiting += 1
        try:
            return await asyncio.shield(task)
        finally:
            self._waiting -= 1
            if not self._waiting and not task.done():
                task.cancel()
                await asyncio.wait({task})


# Of a process's stop bound, the share kept for the tasks that outlived its main one.
_LEFTOVER_SHARE = 0.2


def run_until_signalled(
    main: Callable[[], Coroutine[Any, Any, None]],
    *,
    grace: float,
    on_signal: Callable[[signal.Signals], None] = lambda _: None,
) -> bool:
    """Run `main()` in a new event loop until it returns, or until SIGTERM or SIGINT cancels it;
    either way the process is done within `grace` seconds of that moment.

    `asyncio.run` ends by cancelling every task left and waiting for all of them without a
    limit: one task that swallows its cancellation, or whose clean-up waits on something that
    never comes (a socket, a process), hangs the process forever after its work is done. Here
    the main task gets most of `grace` for its orderly stop; then every task left is cancelled
    (again, if need be) and waited for until `grace` is over; what still runs is logged by name
    with where it waits, and abandoned. A worker thread that never returns cannot be abandoned
    (the interpreter joins them at exit): the process then ends with `os._exit(1)`.

    Returns whether the stop was clean (nothing abandoned). An exception of `main()` other than
    the cancellation is raised after the clean-up.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        clean = loop.run_until_complete(_until_signalled(main, grace, on_signal))
        with contextlib.suppress(TimeoutError):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 1.0))
        try:
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), 1.0))
        except TimeoutError:
            log.error("stopping: a worker thread is still running; exiting anyway")
            logging.shutdown()
            os._exit(1)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    return clean


async def _until_signalled(
    main: Callable[[], Coroutine[Any, Any, None]],
    grace: float,
    on_signal: Callable[[signal.Signals], None],
) -> bool:
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(main(), name="main")
    signalled = asyncio.Event()

    def stop(sig: signal.Signals) -> None:
        if not signalled.is_set():
            signalled.set()
            on_signal(sig)
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    waiting = asyncio.create_task(signalled.wait(), name="signals")
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    deadline = loop.time() + grace
    waiting.cancel()
    if not task.done():
        await asyncio.wait({task}, timeout=grace * (1 - _LEFTOVER_SHARE))
    stuck = await _cancel_all(deadline)
    for leftover in stuck:
        log.error(
            "stopping: %s still running %.1f s after the stop began; abandoned at\n%s",
            leftover.get_name(),
            grace,
            _where(leftover),
        )
    if signalled.is_set() and not stuck:
        log.info("stopped in %.2f s", loop.time() - deadline + grace)
    if task.done() and not task.cancelled() and (error := task.exception()) is not None:
        raise error
    return not stuck


async def _cancel_all(deadline: float) -> list[asyncio.Task[Any]]:
    """Cancel every other task of the loop, and those their clean-up starts, until none is
    left or `deadline` (loop time) passes; the tasks still running then."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    cancelled: set[asyncio.Task[Any]] = set()
    while True:
        pending = {t for t in asyncio.all_tasks() if t is not me and not t.done()}
        for leftover in pending - cancelled:
            leftover.cancel()
        cancelled |= pending
        left = deadline - loop.time()
        if not pending or left <= 0:
            return sorted(pending, key=lambda t: t.get_name())
        await asyncio.wait(pending, timeout=left)


def _where(task: asyncio.Task[Any]) -> str:
    """Where a pending task waits (its coroutine's stack), for the log."""
    out = io.StringIO()
    task.print_stack(file=out)
    return out.getvalue().rstrip()


__all__ = ["TaskSet", "run_supervised", "run_until_signalled", "supervise"]
