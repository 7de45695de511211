"""An ssh pod's status is the SDK builder's, from the device's container states."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.ssh import _remote
from vkubelet.providers.ssh._provider import _PodEntry, pod_status

T0 = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


def entry(*containers: _remote.ContainerStatus, policy: str = "Always") -> _PodEntry:
    pod = msgspec.convert(
        {
            "metadata": {"namespace": "default", "name": "web", "uid": "u1"},
            "spec": {"restartPolicy": policy, "containers": [{"name": "main", "image": "host"}]},
        },
        Pod,
    )
    found = _PodEntry(pod, "u1")
    found.remote = _remote.RemotePod("u1", True, False, b"{}", [], list(containers))
    return found


def test_a_container_in_back_off_shows_the_kubelet_s_message_and_last_state() -> None:
    last = _remote.ContainerStatus("main", "terminated", "Error", None, T0, T0, 3, 2)
    waiting = _remote.ContainerStatus(
        "main", "waiting", "CrashLoopBackOff", None, None, None, None, 2, last, 40
    )
    status = pod_status(entry(waiting), "10.0.0.9")
    assert status.phase == "Running"
    [main] = status.containerStatuses or []
    assert main.state and main.state.waiting
    assert main.state.waiting.message == (
        "back-off 40s restarting failed container=main pod=web_default(u1)"
    )
    assert main.lastState and main.lastState.terminated
    assert (main.lastState.terminated.exitCode, main.restartCount) == (3, 2)


def test_a_finished_pod_with_restart_policy_never_fails_on_a_non_zero_exit() -> None:
    done = _remote.ContainerStatus("main", "terminated", "Error", None, T0, T0, 1, 0)
    status = pod_status(entry(done, policy="Never"), "10.0.0.9")
    assert status.phase == "Failed" and status.podIP == "10.0.0.9"
