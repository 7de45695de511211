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


def test_a_start_error_is_reported_with_128_and_the_runtimes_words_in_last_state() -> None:
    words = 'runc create failed: exec: "nope": executable file not found in $PATH'
    last = _remote.ContainerStatus("main", "terminated", "StartError", None, T0, T0, 128, 1)
    last.message = words
    waiting = _remote.ContainerStatus(
        "main", "waiting", "CrashLoopBackOff", None, None, None, None, 1, last, 20
    )
    [main] = pod_status(entry(waiting), "10.0.0.9").containerStatuses or []
    assert main.lastState and main.lastState.terminated
    ended = main.lastState.terminated
    assert (ended.exitCode, ended.reason, ended.message) == (128, "StartError", words)


def test_image_pull_back_off_names_the_image_and_carries_the_last_error() -> None:
    waiting = _remote.ContainerStatus(
        "main", "waiting", "ImagePullBackOff", None, None, None, None, 0
    )
    waiting.message = "Error: connection refused"
    found = entry(waiting)
    assert found.pod.spec is not None
    found.pod.spec.containers[0].image = "localhost:1/x:1"
    [main] = pod_status(found, "10.0.0.9").containerStatuses or []
    assert main.state and main.state.waiting
    assert main.state.waiting.message == (
        'Back-off pulling image "localhost:1/x:1": ErrImagePull: Error: connection refused'
    )
