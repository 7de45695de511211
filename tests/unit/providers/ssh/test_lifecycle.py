"""The Events a kubelet records as a device's container changes state (`_lifecycle`)."""

from __future__ import annotations

from datetime import UTC, datetime

from vkubelet.providers.ssh._lifecycle import PodNames, Record, events
from vkubelet.providers.ssh._remote import ContainerStatus

T0 = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
T1 = datetime(2024, 5, 1, 10, 0, 5, tzinfo=UTC)
POD = PodNames("web", "default", "u1")
IMAGE = "localhost:1/x:1"


def waiting(reason: str, message: str | None = None, restarts: int = 0) -> ContainerStatus:
    state = ContainerStatus("main", "waiting", reason, None, None, None, None, restarts)
    state.message = message
    return state


def start_error(at: datetime, restarts: int = 0) -> ContainerStatus:
    state = ContainerStatus("main", "terminated", "StartError", None, at, at, 128, restarts)
    state.message = "exec: no-such-command: not found"
    return state


def test_each_failed_pull_is_a_failed_event_and_each_wait_a_back_off_event() -> None:
    creating = waiting("ContainerCreating")
    failed = waiting("ErrImagePull", "Error: connection refused")
    backing_off = waiting("ImagePullBackOff", "Error: connection refused")
    assert events(creating, failed, IMAGE, POD) == [
        Record("Warning", "Failed", f'Failed to pull image "{IMAGE}": Error: connection refused'),
        Record("Warning", "Failed", "Error: ErrImagePull"),
    ]
    assert events(failed, backing_off, IMAGE, POD) == [
        Record("Normal", "BackOff", f'Back-off pulling image "{IMAGE}"'),
        Record("Warning", "Failed", "Error: ImagePullBackOff"),
    ]
    assert events(backing_off, failed, IMAGE, POD)[0].reason == "Failed"  # the next attempt
    assert events(failed, failed, IMAGE, POD) == []  # no news: no Event


def test_a_start_error_is_a_failed_event_once_and_the_crash_loop_a_back_off_event() -> None:
    first = start_error(T0)
    assert events(None, first, IMAGE, POD) == [
        Record("Warning", "Failed", "Error: exec: no-such-command: not found")
    ]
    # the next run begins: its count grows, the termination is the same one
    assert events(first, start_error(T0, restarts=1), IMAGE, POD) == []
    assert events(first, start_error(T1, restarts=1), IMAGE, POD) != []
    loop = waiting("CrashLoopBackOff", restarts=1)
    assert events(start_error(T1, restarts=1), loop, IMAGE, POD) == [
        Record(
            "Warning",
            "BackOff",
            "Back-off restarting failed container main in pod web_default(u1)",
        )
    ]


def test_a_container_that_cannot_be_created_is_a_failed_event_with_the_runtimes_words() -> None:
    full = waiting("CreateContainerError", "no space left on device")
    assert events(waiting("ContainerCreating"), full, IMAGE, POD) == [
        Record("Warning", "Failed", "Error: no space left on device")
    ]
