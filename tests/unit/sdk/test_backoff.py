"""Restart back-off as the kubelet does it: first restart at once, then 10 s doubling to 5 min,
from the bottom again after a run of 10 minutes."""

from __future__ import annotations

import pytest

from vkubelet.sdk.backoff import (
    SHELL_ENV,
    RestartBackoff,
    crash_loop_message,
    go_duration,
    restarts,
)


def crash_loop(backoff: RestartBackoff, runs: int, run_seconds: float = 1.0) -> list[float]:
    """Delays before each restart of a container that crashes after `run_seconds` each time."""
    delays: list[float] = []
    clock = backoff._last_restart or 0.0
    for _ in range(runs):
        clock += run_seconds  # it ran, then exited
        delay = backoff.delay(clock)
        delays.append(delay)
        clock += delay
        backoff.restarted(clock - delay, clock)
    return delays


def test_the_first_restart_is_immediate_then_the_back_off_doubles_up_to_five_minutes() -> None:
    assert crash_loop(RestartBackoff(), 9) == [0, 10, 20, 40, 80, 160, 300, 300, 300]


def test_a_run_longer_than_ten_minutes_resets_the_back_off() -> None:
    backoff = RestartBackoff()
    crash_loop(backoff, 4)  # back-off now 40 s
    assert crash_loop(backoff, 2, run_seconds=601) == [0, 0]
    assert crash_loop(backoff, 2) == [10, 20]


def test_the_remaining_wait_counts_from_the_exit() -> None:
    backoff = RestartBackoff()
    backoff.restarted(0, 0)
    assert backoff.remaining(finished_at=5, now=5) == 10
    assert backoff.remaining(finished_at=5, now=12) == 3
    assert backoff.remaining(finished_at=5, now=20) == 0


@pytest.mark.parametrize(
    ("policy", "code", "init", "expected"),
    [
        ("Always", 0, False, True),
        ("Always", 1, False, True),
        (None, 0, False, True),
        ("OnFailure", 0, False, False),
        ("OnFailure", 2, False, True),
        ("Never", 2, False, False),
        ("Always", 0, True, False),  # an init container that succeeded is done
        ("Always", 1, True, True),
        ("Never", 1, True, False),
    ],
)
def test_the_restart_policy_decides_which_exits_restart(
    policy: str | None, code: int, init: bool, expected: bool
) -> None:
    assert restarts(policy, code, init=init) is expected


def test_the_crash_loop_message_is_the_kubelet_s() -> None:
    message = crash_loop_message(20, "app", "web", "default", "u-1")
    assert message == "back-off 20s restarting failed container=app pod=web_default(u-1)"
    assert [go_duration(s) for s in (10, 80, 300, 3700)] == ["10s", "1m20s", "5m0s", "1h1m40s"]


def test_the_device_supervisor_gets_the_same_numbers() -> None:
    assert SHELL_ENV == {
        "VKUBELET_BACKOFF_BASE": "10",
        "VKUBELET_BACKOFF_MAX": "300",
        "VKUBELET_BACKOFF_RESET": "600",
    }
