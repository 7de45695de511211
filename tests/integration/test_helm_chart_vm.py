"""The chart refuses the vm provider and says where to go instead (docs/host-install.md).

QEMU in the agent's container counts guest memory against the container's limit, dies with
every restart of the agent, is never reaped by the agent as PID 1, and a standby replica on
another host would boot every VM afresh without its disks: VMs run beside one agent per
hypervisor host, installed as a service of that host. So `provider: vm`, or a vm node in
`agentConfig`, fails the rendering (`helm template`) and the installation (`helm install`),
which leaves nothing in the cluster. No VM boots here: the module costs a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster, ensure_helm, kubernetes_version
from vkubelet.testing import Kubectl

from .helmchart import CHART

pytestmark = pytest.mark.integration

HOST_INSTALL = "docs/host-install.md"


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))


def helm_run(
    helm: Path,
    *args: str,
    values: dict[str, Any],
    tmp_path: Path,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))
    return subprocess.run(
        [str(helm), *args, str(CHART), "--values", str(values_file)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "values",
    [
        {"provider": "vm", "nodeName": "hv-1", "providerConfig": {"stateDir": "/var/lib/vm"}},
        {
            "agentConfig": {
                "nodes": [{"name": "a", "provider": "mock"}, {"name": "hv-1", "provider": "vm"}]
            }
        },
    ],
    ids=["provider", "agentConfig"],
)
def test_helm_template_refuses_vm_mode_pointing_at_the_host_install(
    helm: Path, values: dict[str, Any], tmp_path: Path
) -> None:
    out = helm_run(
        helm,
        "template",
        "vk",
        "--kube-version",
        kubernetes_version(),
        values=values,
        tmp_path=tmp_path,
    )
    assert out.returncode != 0
    assert "provider vm: the chart does not run VMs" in out.stderr, out.stderr
    assert HOST_INSTALL in out.stderr
    assert (CHART.parents[2] / HOST_INSTALL).is_file()  # the page it points at exists


def test_helm_install_of_vm_mode_fails_and_leaves_nothing(
    helm: Path, kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    namespace = f"vk-helm-vm-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "KUBECONFIG": str(kube_cluster.kubeconfig)}
    values = {"provider": "vm", "nodeName": "hv-1", "replicas": 1}
    try:
        out = helm_run(
            helm, "install", "vk", "--namespace", namespace, "--create-namespace",
            values=values, tmp_path=tmp_path, env=env,
        )  # fmt: skip
        assert out.returncode != 0
        assert "provider vm: the chart does not run VMs" in out.stderr, out.stderr
        assert HOST_INSTALL in out.stderr
        # Refused before anything was sent: no release, no Deployment, no cluster-wide grant.
        listed = subprocess.run(
            [str(helm), "list", "--all", "--namespace", namespace, "-q"],
            capture_output=True, text=True, env=env, check=False, timeout=60,
        )  # fmt: skip
        assert listed.stdout.strip() == ""
        selector = ("-l", "app.kubernetes.io/instance=vk,vkubelet.io/provider=vm", "-o", "name")
        assert kubectl("get", "deployments", "-A", *selector).stdout == ""
        assert kubectl("get", "clusterroles,clusterrolebindings", *selector).stdout == ""
    finally:
        kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


@pytest.mark.parametrize("uri", ["qemu:///system", "hv-2", "qemu+libssh:///system"])
def test_helm_template_refuses_a_migration_uri_that_names_no_host(
    helm: Path, uri: str, tmp_path: Path
) -> None:
    """The other hosts' daemons reach a host's with its migrationURI: a local one is refused,
    naming the field, before anything is rendered."""
    host = {"name": "hv-2", "uri": "qemu+ssh://root@hv-2/system", "noVerify": True}
    hosts = [{**host, "migrationURI": uri}]
    values = {"provider": "vm", "identity": "serviceAccount", "providerConfig": {"hosts": hosts}}
    out = helm_run(
        helm, "template", "vk", "--kube-version", kubernetes_version(),
        values=values, tmp_path=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0
    assert f'providerConfig.hosts[0].migrationURI: "{uri}"' in out.stderr, out.stderr
