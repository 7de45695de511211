"""Restarting containers as the kubelet does: which exits restart, and how long to wait first.

The kubelet (pkg/kubelet/kuberuntime `doBackOff`, client-go `flowcontrol.Backoff`) restarts a
container that exited for the first time at once, and each later one after a back-off that
starts at 10 s and doubles up to 5 minutes; a container that stayed up for 10 minutes (twice the
maximum) since its last restart starts again from the bottom. While it waits, the container's
state is `waiting` with reason `CrashLoopBackOff` and the message
"back-off 20s restarting failed container=NAME pod=NAME_NAMESPACE(UID)".

`RestartBackoff` keeps that per container; it takes times as arguments, so it is tested without
waiting. `supervise_container` is the whole loop for a provider that runs a container's process
itself: run, report, decide, back off, run again. The ssh provider's device-side supervisor
implements the same numbers in shell (`SHELL_ENV` hands them over).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from .status import ContainerReport, Running, Terminated, Waiting

__all__ = [
    "CRASH_LOOP_BACK_OFF",
    "INITIAL_SECONDS",
    "MAX_SECONDS",
    "RESET_SECONDS",
    "SHELL_ENV",
    "RestartBackoff",
    "crash_loop_message",
    "go_duration",
    "restarts",
    "supervise_container",
]

INITIAL_SECONDS = 10.0
MAX_SECONDS = 300.0
RESET_SECONDS = 2 * MAX_SECONDS  # "stable if it's ok for twice the maxDuration"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"

# The ssh supervisor's environment variables for the same numbers, in whole seconds.
SHELL_ENV = {
    "VKUBELET_BACKOFF_BASE": str(int(INITIAL_SECONDS)),
    "VKUBELET_BACKOFF_MAX": str(int(MAX_SECONDS)),
    "VKUBELET_BACKOFF_RESET": str(int(RESET_SECONDS)),
}


def restarts(restart_policy: str | None, exit_code: int, *, init: bool = False) -> bool:
    """Whether a container that exited with `exit_code` is started again.

    `Always` restarts every exit, `OnFailure` the non-zero ones, `Never` none. An init container
    must succeed before the pod goes on, so it restarts on failure unless the policy is `Never`.
    """
    policy = restart_policy or "Always"
    if init:
        policy = "Never" if policy == "Never" else "OnFailure"
    if policy == "Always":
        return True
    if policy == "OnFailure":
        return exit_code != 0
    return False


@dataclass
class RestartBackoff:
    """The back-off of one container. Times are seconds on any one clock (monotonic is best).

    For each exit that restarts: `delay(finished_at)` is how long the back-off in force asks to
    wait from the exit (0: restart now); once waited, `restarted(now)` records the restart and
    lengthens the next back-off.
    """

    initial: float = INITIAL_SECONDS
    maximum: float = MAX_SECONDS
    _current: float = 0.0
    _last_restart: float | None = None

    def _expired(self, finished_at: float) -> bool:
        return self._last_restart is None or finished_at - self._last_restart > 2 * self.maximum

    def delay(self, finished_at: float) -> float:
        """The back-off in force for a run that ended at `finished_at` (0 for the first exit,
        and after a run that outlasted twice the maximum)."""
        return 0.0 if self._expired(finished_at) else self._current

    def remaining(self, finished_at: float, now: float) -> float:
        """Seconds still to wait at `now` before restarting after an exit at `finished_at`."""
        return max(0.0, finished_at + self.delay(finished_at) - now)

    def restarted(self, finished_at: float, now: float) -> None:
        """The container is started again at `now` after the exit at `finished_at`."""
        if self._expired(finished_at):
            self._current = self.initial
        else:
            self._current = min(self._current * 2, self.maximum)
        self._last_restart = now


def go_duration(seconds: float) -> str:
    """A duration as Go's `time.Duration.String` prints whole seconds: 10s, 1m20s, 5m0s."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def crash_loop_message(delay: float, container: str, pod: str, namespace: str, uid: str) -> str:
    """The kubelet's message for a container waiting out its back-off."""
    return (
        f"back-off {go_duration(delay)} restarting failed container={container} "
        f"pod={pod}_{namespace}({uid})"
    )


async def supervise_container(
    run: Callable[[int], Awaitable[int | Terminated]],
    report: Callable[[ContainerReport], None],
    *,
    restart_policy: str | None,
    stop: asyncio.Event,
    names: tuple[str, str, str, str],
    init: bool = False,
    backoff: RestartBackoff | None = None,
    first_run: int = 0,
) -> bool:
    """Run a container as its pod's restart policy says, with the kubelet's back-off, until it
    is done or `stop` is set; True if its last run succeeded.

    `run(n)` runs the container's run `n` (its restart count) to the end and returns the exit
    code (-N for a signal N; or a `Terminated` with the provider's reason); `report` gets each
    state change: running, terminated, waiting in `CrashLoopBackOff` with the kubelet's message.
    `names` is (container, pod, namespace, uid), for that message. `first_run` is the restart
    count to start from (a container adopted after an agent restart keeps its count).
    """
    backoff = backoff or RestartBackoff()
    last: Terminated | None = None
    count = first_run
    while not stop.is_set():
        started = datetime.now(UTC)
        report(ContainerReport(Running(started), count, last))
        code = await run(count)
        finished = time.monotonic()
        if isinstance(code, Terminated):  # the provider's own reason
            last = replace(code, started_at=started, finished_at=datetime.now(UTC))
        else:
            last = Terminated(code if code >= 0 else 128 - code, started, datetime.now(UTC))
        report(ContainerReport(last, count))
        if stop.is_set() or not restarts(restart_policy, last.exit_code, init=init):
            return last.succeeded
        if delay := backoff.delay(finished):
            message = crash_loop_message(delay, *names)
            report(ContainerReport(Waiting(CRASH_LOOP_BACK_OFF, message), count, last))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff.remaining(finished, time.monotonic()))
            if stop.is_set():
                return False
        backoff.restarted(finished, time.monotonic())
        count += 1
    return False
