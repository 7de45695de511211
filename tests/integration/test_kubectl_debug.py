"""`kubectl debug` (ephemeral containers) on a mock pod, with the real kubectl and control plane:
`debug -it` reaches the mock's shell in a terminal and a command's output comes back, the
ephemeral container's status goes running → terminated with its exit code, and a debug
container without stdin runs its command at once, its output its log."""

from __future__ import annotations

import json
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


def add_ephemeral(kubectl: Kubectl, pod: str, container: dict[str, Any]) -> None:
    """Add an ephemeral container as `kubectl debug` does, with the fields it cannot set (env)."""
    patch = {"spec": {"ephemeralContainers": [container]}}
    kubectl("patch", "pod", pod, "--subresource", "ephemeralcontainers", "-p", json.dumps(patch))


def test_env_only_a_debug_container_references_is_resolved_and_a_missing_key_is_its_own_error(
    pod: str, kubectl: Kubectl
) -> None:
    """The ConfigMap and the downward API field only the debug container names are resolved for
    it; a key missing from the ConfigMap leaves that container waiting with the kubelet's
    CreateContainerConfigError naming the key, the pod running, until the key is there."""
    tag = uuid.uuid4().hex[:4]
    config = f"dbg-env-{tag}"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config},
            "data": {"word": "from-the-configmap"},
        }
    )

    def container(name: str, key: str) -> dict[str, Any]:
        return {
            "name": name,
            "image": "busybox",
            "command": ["sh", "-c", "echo $WORD $ME"],
            "env": [
                {"name": "WORD", "valueFrom": {"configMapKeyRef": {"name": config, "key": key}}},
                {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
        }

    def ended(name: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = ephemeral_state(kubectl, "default", pod, name).get(
            "terminated"
        )
        return found

    try:
        add_ephemeral(kubectl, pod, container(f"env-{tag}", "word"))
        wait_for(lambda: ended(f"env-{tag}"), timeout=30, what="the debug container ran")
        assert kubectl("logs", pod, "-c", f"env-{tag}").stdout == f"from-the-configmap {pod}\n"

        add_ephemeral(kubectl, pod, container(f"miss-{tag}", "absent"))
        waiting = wait_for(
            lambda: ephemeral_state(kubectl, "default", pod, f"miss-{tag}").get("waiting"),
            timeout=30,
            what="the missing key's reason",
        )
        assert waiting["reason"] == "CreateContainerConfigError"
        assert "absent" in waiting["message"] and config in waiting["message"]
        assert kubectl.json("get", "pod", pod)["status"]["phase"] == "Running"

        patch = {"data": {"absent": "here-now"}}
        kubectl("patch", "configmap", config, "-p", json.dumps(patch))
        wait_for(lambda: ended(f"miss-{tag}"), timeout=30, what="the debug container ran")
        assert kubectl("logs", pod, "-c", f"miss-{tag}").stdout == f"here-now {pod}\n"
    finally:
        kubectl("delete", "configmap", config, "--wait=false", "--ignore-not-found")
