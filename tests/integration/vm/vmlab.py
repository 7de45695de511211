"""What the vm integration modules share: the toleration of the provider's taint, the check
that this machine can run VMs, an agent's start with the vm provider, the clean-up of what a
failed test leaves behind (QEMU processes and their networks outlive the agent), the CRDs'
installation. `twonodes.py` builds its pair of vm nodes on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import AgentProcess, Kubectl, start_agent

# The vm provider's own taint (its value is the provider's name), not every virtual-kubelet
# taint: a worker's session-wide mock node (`api_node`) tolerated by `Exists` took a VM's pod.
TOLERATION = {
    "key": "virtual-kubelet.io/provider",
    "operator": "Equal",
    "value": "vm",
    "effect": "NoSchedule",
}


def require_vm_host() -> None:
    """Skip unless this machine can run the vm provider."""
    if os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None:
        pytest.skip("the VM provider needs root and qemu-system-x86_64")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_vm_agent(
    cluster: Cluster,
    workdir: Path,
    *,
    name: str,
    address: str,
    cidr: str,
    image: Path,
    **extra: Any,
) -> AgentProcess:
    """`vkubelet run --provider vm` with TCG, `workdir/state`, the test guest as `tiny` and
    1 GiB reserved; `extra` adds (or overrides) keys of the provider config."""
    config = workdir / "vm.yaml"
    settings: dict[str, Any] = {
        "stateDir": "state",
        "accel": "tcg",
        "podCIDR": cidr,
        "reserved": {"memory": "1Gi"},
        "translations": [{"name": "tiny", "url": image.resolve().as_uri()}],
        **extra,
    }
    config.write_text(json.dumps(settings))
    return start_agent(cluster, workdir, provider="vm", config=config, name=name, address=address)


def kill_qemus(state: Path) -> None:
    """SIGKILL every QEMU a node's state directory names (its machines' pid files)."""
    for pid_file in [*state.glob("vms/*/m/pid"), *state.glob("vms/*/m/*.pid")]:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().split()[0])
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def clean_up(state: Path, cidr: str) -> None:
    """What a failed test left on a node: its QEMU processes, then their pod networks."""
    from vkubelet.providers.vm._net import PodNetwork

    kill_qemus(state)
    network = PodNetwork(cidr)
    keys = [run_dir.name for run_dir in state.glob("vms/*")]

    async def detach_all() -> None:
        for key in keys:
            await network.detach(key)

    asyncio.run(detach_all())


def install_crds(cluster: Cluster) -> str:
    """The project's CRDs, installed the way the docs say; its output."""
    install = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "vkubelet"), "vm", "install-crds",
         "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    return install.stdout


@dataclass
class PodsOf:
    """The pods of one test namespace, read and written with kubectl (the migration labs)."""

    namespace: str
    kubectl: Kubectl

    def pod(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", name))

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for condition in self.pod(name)["status"].get("conditions") or []:
            if condition["type"] == kind:
                return dict(condition)
        return {}

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("-n", self.namespace, "apply", "-f", "-", input=json.dumps(manifest))
