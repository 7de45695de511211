"""A device logged in to as root: sshd ignores SSH signal requests for root sessions, so pods
must be stopped with a plain `kill` on the device. Proven with a real root sshd."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, local_test_address, node_ready, wait_for
from vkubelet.testing.sshlab import ssh_inventory, ssh_lab

from .sshagent import pod_manifest, start_agent, status


def test_a_pod_on_a_root_device_gets_sigterm_then_stops(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("ssh-root")
    marker = Path(f"/tmp/vk-term-{uuid.uuid4().hex[:8]}")
    with local_test_address() as address, ssh_lab(1, workdir, root=True) as [device]:
        path = workdir / "inventory.yaml"
        path.write_text(yaml.safe_dump(ssh_inventory([device])))
        agent = start_agent(kube_cluster, workdir, path, address)
        try:
            wait_for(lambda: node_ready(kubectl, device.name), timeout=60, what="node Ready")
            name = f"root-{uuid.uuid4().hex[:6]}"
            script = f"trap 'echo term > {marker}; exit 0' TERM; id -u; while :; do sleep 0.2; done"
            kubectl.apply(pod_manifest(name, device.name, ["sh", "-c", script]))
            wait_for(lambda: status(kubectl, name).get("phase") == "Running", what="Running")
            wait_for(lambda: kubectl("logs", name).stdout == "0\n", what="running as root")
            kubectl("delete", "pod", name, "--wait=true", timeout=60)
            assert marker.read_text() == "term\n"  # SIGTERM, delivered: not a KILL at the end
        finally:
            agent.stop()
            marker.unlink(missing_ok=True)
            kubectl("delete", "node", device.name, "--ignore-not-found", "--wait=false")
