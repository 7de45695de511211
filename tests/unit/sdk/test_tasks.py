from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time

import pytest

from vkubelet.sdk import TaskSet, run_supervised
from vkubelet.sdk.tasks import SharedWatch


async def test_a_failing_supervised_task_is_logged_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0

    async def work() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"boom {runs}")

    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(
            run_supervised(work, name="flaky", initial_backoff=0.01, max_backoff=0.02), 5
        )
    assert runs == 3
    assert [r.message for r in caplog.records].count("flaky failed; restarting in 0.0s") == 2
    assert "boom 1" in caplog.text


async def test_an_unreachable_peer_is_one_warning_line_per_retry_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0

    async def work() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ConnectionRefusedError(111, "Connection refused")

    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(
            run_supervised(work, name="lower watch", initial_backoff=0.01, max_backoff=0.02), 5
        )
    assert runs == 3
    failures = [r for r in caplog.records if r.message.startswith("lower watch failed")]
    assert [(r.levelno, r.exc_info) for r in failures] == [(logging.WARNING, None)] * 2
    assert "Connection refused" in failures[0].message


async def test_finished_tasks_are_forgotten_and_their_failures_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet("pods")

    async def fail() -> None:
        raise ValueError("lost before")

    with caplog.at_level(logging.ERROR):
        done = [tasks.spawn(asyncio.sleep(0), name=f"ok {i}") for i in range(100)]
        failed = tasks.spawn(fail(), name="bad")
        await asyncio.gather(*done, failed, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop iteration
    assert len(tasks) == 0
    assert "pods: bad failed" in caplog.text
    assert "lost before" in caplog.text


async def test_closing_a_task_set_cancels_what_still_runs() -> None:
    tasks = TaskSet("x")
    task = tasks.spawn(asyncio.sleep(3600), name="forever")
    await tasks.aclose()
    assert task.cancelled()
    assert len(tasks) == 0


def test_the_sdk_imports_without_the_agent_internals() -> None:
    code = (
        "import sys, vkubelet; "
        "bad = [m for m in sys.modules if m.startswith(('vkubelet.node', 'vkubelet.kubelet', "
        "'vkubelet.agent', 'vkubelet.cli'))]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_closing_a_task_set_under_a_timeout_gives_up_when_the_time_is_over() -> None:
    """A task whose clean-up never ends must not swallow its closer's own cancellation: the
    caller's bound (the agent's stop) holds."""
    tasks = TaskSet("x")

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(3600)

    task = tasks.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await tasks.aclose()
    assert time.monotonic() - started < 2
    task.cancel()


_PROCESS = """
import asyncio, logging, sys
from vkubelet.sdk.tasks import run_until_signalled
logging.basicConfig(level=logging.INFO, stream=sys.stderr)

async def stubborn() -> None:
    while True:  # swallows every cancellation, as a buggy clean-up would
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

async def main() -> None:
    if sys.argv[1] == "stubborn":
        asyncio.get_running_loop().create_task(stubborn(), name="the stubborn one")
    try:
        print("ready", flush=True)
        await asyncio.sleep(3600)
    finally:
        print("main stopped in order", flush=True)

clean = run_until_signalled(main, grace=1.0, on_signal=lambda s: print(s.name, flush=True))
print("clean" if clean else "cut short", flush=True)
"""


@pytest.mark.parametrize("leftover", ["none", "stubborn"])
def test_a_signalled_process_stops_within_its_grace_whatever_its_tasks_do(leftover: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _PROCESS, leftover],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=10)
    assert time.monotonic() - started < 3, (out, err)
    assert process.returncode == 0, err
    assert "SIGTERM\nmain stopped in order\n" in out
    if leftover == "none":
        assert out.endswith("clean\n") and "abandoned" not in err
    else:
        assert out.endswith("cut short\n")
        assert "the stubborn one still running 1.0 s after the stop began; abandoned" in err
        assert "in stubborn" in err  # where it waits


async def test_waiters_share_one_watcher_which_ends_with_the_last_of_them() -> None:
    started = 0
    release = asyncio.Event()
    cancelled = asyncio.Event()
    watching = asyncio.Event()

    async def watch() -> str:
        nonlocal started
        started += 1
        watching.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "off"

    shared = SharedWatch(watch, name="watch")
    first = asyncio.ensure_future(shared.wait())
    second = asyncio.ensure_future(shared.wait())
    await watching.wait()  # (the watcher runs after both waiters joined it)
    first.cancel()
    await asyncio.wait({first})
    assert not cancelled.is_set()  # the second still waits: the watcher lives on
    second.cancel()
    await asyncio.wait({second})
    assert cancelled.is_set()  # the last waiter gone: so is the watcher, awaited
    # The next waiter starts it again; a finished watcher keeps its result for later waiters.
    release.set()
    assert await shared.wait() == "off"
    assert await shared.wait() == "off"
    assert started == 2
