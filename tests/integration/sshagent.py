"""An ssh-provider agent over lab devices and the host pods run on them: shared by the tests
of SSH devices (the lab of three users' devices, and a device logged in to as root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vkubelet.devcluster import Cluster
from vkubelet.testing import AgentProcess, Kubectl
from vkubelet.testing import start_agent as start_agent_process

TOLERATE = [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}]


def start_agent(cluster: Cluster, workdir: Path, path: Path, address: str) -> AgentProcess:
    return start_agent_process(
        cluster,
        workdir,
        provider="ssh",
        config=path,
        name="lab",
        address=address,
        extra_args=("--log-level", "debug"),
    )


def pod_manifest(
    name: str, node: str, command: list[str], *, restart: str = "Always", **extra: Any
) -> dict[str, Any]:
    container = {"name": "main", "image": "host", "command": command, **extra.pop("container", {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": restart,
            "tolerations": TOLERATE,
            "terminationGracePeriodSeconds": 5,
            "containers": [container],
            **extra,
        },
    }


def status(kubectl: Kubectl, name: str) -> dict[str, Any]:
    found: dict[str, Any] = kubectl.json("get", "pod", name).get("status") or {}
    return found
