"""`kubectl debug` (ephemeral containers) on a mock pod, with the real kubectl and control plane:
`debug -it` reaches the mock's shell in a terminal and a command's output comes back, the
ephemeral container's status goes running → terminated with its exit code, and a debug
container without stdin runs its command at once, its output its log."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from vkubelet.testing import (
    Kubectl,
    MockNode,
    ephemeral_state,
    interactive_debug,
    running_pod,
    wait_for,
)


@pytest.fixture(scope="module")
def pod(api_node: MockNode, kubectl: Kubectl) -> Iterator[str]:
    name = running_pod(kubectl, api_node.name)
    yield name
    kubectl("delete", "pod", name, "--wait=false")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by .ci/run")
def test_debug_it_on_a_mock_pod_reaches_a_shell_and_reports_its_status(
    pod: str, kubectl: Kubectl
) -> None:
    name = f"dbg-{uuid.uuid4().hex[:4]}"
    with interactive_debug(kubectl, "default", pod, name) as terminal:
        terminal.type('echo "$HOSTNAME"-says-hi')
        wait_for(lambda: f"{pod}-says-hi" in terminal.screen(), timeout=30, what="the output")
        assert "running" in ephemeral_state(kubectl, "default", pod, name)
        terminal.type("exit 3")
        ended = wait_for(
            lambda: ephemeral_state(kubectl, "default", pod, name).get("terminated"),
            timeout=30,
            what="the ephemeral container terminated",
        )
    assert ended["exitCode"] == 3


def test_debug_without_stdin_runs_its_command_and_keeps_its_output(
    pod: str, kubectl: Kubectl
) -> None:
    name = f"once-{uuid.uuid4().hex[:4]}"
    kubectl("debug", pod, "--image=busybox", "-c", name, "--", "sh", "-c", "echo one two; exit 0")
    ended: dict[str, Any] = wait_for(
        lambda: ephemeral_state(kubectl, "default", pod, name).get("terminated"),
        timeout=30,
        what="the ephemeral container terminated",
    )
    assert ended["exitCode"] == 0
    assert kubectl("logs", pod, "-c", name).stdout == "one two\n"
