"""The chart with the ssh provider, run as its pod (tests/integration/helmchart.py) against real
sshd devices (the lab of test_ssh_devices.py: network namespaces, users of their own): the
inventory in the ConfigMap in the shape of the chart's ci values (`defaults` with
`knownHosts`, the keys as files of the chart's Secret, relative paths), and only the chart's
ssh RBAC. Its nodes go Ready, a pod runs on a device with `kubectl logs` and `kubectl exec`,
and a device taken out of the inventory is drained and its node deleted (the fleet's own
grants: pods/eviction, nodes delete), with nothing refused."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster, ensure_helm
from vkubelet.testing import Kubectl, wait_for
from vkubelet.testing.sshlab import TestDevice, ssh_lab, ssh_lab_unavailable

from .helmchart import Installed, PodAgent, agent_as_pod, can_i, installed_chart, refusals

pytestmark = pytest.mark.integration

TOLERATE = [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}]


def inventory(devices: list[TestDevice]) -> dict[str, Any]:
    """As deploy/helm/vkubelet/ci/ssh-values.yaml has it: `defaults`, and paths relative to the
    config naming files of the chart's Secret (here one key per device)."""
    return {
        "defaults": {"knownHosts": "known_hosts"},
        "devices": [
            {
                "name": d.name,
                "address": d.address,
                "port": d.port,
                "user": d.user,
                "identityFile": f"{d.name}.key",
            }
            for d in devices
        ],
    }


@dataclass
class Lab:
    devices: list[TestDevice]
    installed: Installed
    agent: PodAgent
    config: Path  # provider.yaml where the pod's projected volume has it

    def write_inventory(self, devices: list[TestDevice]) -> None:
        """What the kubelet does to a mounted ConfigMap that changed: a new file in its place."""
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(inventory(devices)))
        tmp.replace(self.config)


@pytest.fixture(scope="module")
def lab(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    reason = ssh_lab_unavailable()
    if reason:
        pytest.skip(reason)
    helm = ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))
    workdir = tmp_path_factory.mktemp("helm-ssh")
    with ssh_lab(2, workdir / "lab") as devices:
        secret_files = {f"{d.name}.key": d.key_path.read_text() for d in devices}
        secret_files["known_hosts"] = "".join(d.known_hosts.read_text() for d in devices)
        values = {
            "provider": "ssh",
            "identity": "serviceAccount",  # a fleet: one node identity would not do
            "providerConfig": inventory(devices),
            "logLevel": "debug",
        }
        values["secretFiles"] = secret_files
        names = [d.name for d in devices]
        with (
            installed_chart(helm, kubectl, "", values, devices=names) as installed,
            agent_as_pod(installed, kube_cluster, kubectl, workdir / "pod") as agent,
        ):
            config = workdir / "pod" / "etc" / "provider.yaml"
            yield Lab(devices, installed, agent, config)


def run_pod(kubectl: Kubectl, lab: Lab, device: TestDevice, script: str) -> str:
    name = f"p-{uuid.uuid4().hex[:6]}"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": lab.installed.namespace},
            "spec": {
                "nodeName": device.name,
                "tolerations": TOLERATE,
                "terminationGracePeriodSeconds": 5,
                "containers": [{"name": "main", "image": "host", "command": ["sh", "-c", script]}],
            },
        }
    )

    def phase() -> str | None:
        pod = kubectl.json("-n", lab.installed.namespace, "get", "pod", name)
        return pod["status"].get("phase")  # type: ignore[no-any-return]

    wait_for(lambda: phase() == "Running", what=f"pod {name} Running")
    return name


def test_the_charts_config_and_secret_files_are_what_the_agent_reads(lab: Lab) -> None:
    assert set(lab.installed.files) == {
        "provider.yaml",
        "known_hosts",
        *(f"{d.name}.key" for d in lab.devices),
    }
    args = lab.installed.container["args"]
    assert "--provider-config=/etc/vkubelet/provider.yaml" in args
    assert not any(a.startswith("--nodename") for a in args)  # the devices name the nodes


def test_a_pod_runs_on_a_device_with_logs_and_exec_under_the_charts_rbac(
    lab: Lab, kubectl: Kubectl
) -> None:
    device = lab.devices[0]
    tag = uuid.uuid4().hex[:8]
    name = run_pod(kubectl, lab, device, f"echo hello from {tag}; sleep 3600")
    where = ("-n", lab.installed.namespace)
    try:
        assert device.pids(tag), "the pod's process runs on the device"
        wait_for(
            lambda: f"hello from {tag}" in kubectl(*where, "logs", name, check=False).stdout,
            what="kubectl logs",
        )
        out = kubectl(*where, "exec", name, "--", "sh", "-c", "id -un; echo $HOME").stdout
        assert out.split() == [device.user, str(device.home)]
        assert kubectl(*where, "exec", "-i", name, "--", "cat", input="abc\n").stdout == "abc\n"
    finally:
        kubectl(*where, "delete", "pod", name, "--wait=true", timeout=90)
    assert not device.pids(tag)
    assert not refusals(lab.agent.log())


def test_a_device_left_out_of_the_inventory_is_drained_and_its_node_deleted(
    lab: Lab, kubectl: Kubectl
) -> None:
    keep, gone = lab.devices[0], lab.devices[1]
    tag = uuid.uuid4().hex[:8]
    name = run_pod(kubectl, lab, gone, f"sleep 3600; : {tag}")
    lab.write_inventory([keep])
    where = ("-n", lab.installed.namespace)
    wait_for(
        lambda: kubectl(*where, "get", "pod", name, "--ignore-not-found").stdout == "",
        timeout=60,
        what="the pod evicted",
    )
    wait_for(
        lambda: kubectl("get", "node", gone.name, "--ignore-not-found").stdout == "",
        timeout=60,
        what="the node deleted",
    )
    assert not gone.pids(tag)
    log = lab.agent.log()
    assert f"node {gone.name} drained and deleted" in log, log
    # Its cordon, the eviction and the node's deletion all went through.
    assert not refusals(log)


@pytest.mark.parametrize(
    ("verb", "resource", "answer"),
    [
        ("delete", "nodes", "yes"),  # a device that leaves
        ("create", "pods/eviction", "yes"),  # ...is drained first
        ("create", "pods", "no"),
        ("create", "pods/exec", "no"),
        ("list", "nodes", "no"),
        ("get", "namespaces:kube-system", "no"),  # the cluster provider's only
    ],
)
def test_the_ssh_providers_grants_are_exactly_its_own(
    lab: Lab, kubectl: Kubectl, verb: str, resource: str, answer: str
) -> None:
    namespace = "default" if resource.startswith("pods") else ""
    assert can_i(kubectl, lab.installed, verb, resource, namespace) == answer
