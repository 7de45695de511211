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
import yaml

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


def _fleet_values(**vm: Any) -> dict[str, Any]:
    host = {"name": "hv-1", "uri": "qemu+ssh://root@hv-1/system", "noVerify": True}
    values = {"provider": "vm", "identity": "serviceAccount", "providerConfig": {"hosts": [host]}}
    return {**values, "vm": vm} if vm else values


def _documented_controller_rules() -> list[dict[str, Any]]:
    """The ClusterRole docs/vm-resource.md lists for the controller (the leases rule goes into
    a Role of the Lease's namespace)."""
    page = (CHART.parents[2] / "docs" / "vm-resource.md").read_text()
    block = page.split("Permissions it needs", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    rules: list[dict[str, Any]] = yaml.safe_load(block)["rules"]
    return rules


def test_helm_template_of_the_vm_fleet_runs_the_controller_with_the_documented_rbac_and_the_gc(
    helm: Path, tmp_path: Path
) -> None:
    """vm mode renders, by default: the VM controller as a Deployment of its own with its own
    ServiceAccount and exactly the rules docs/vm-resource.md lists (leases in a Role of the
    release's namespace, where its Lease is), the CRDs applied by a hook Job whose account may
    touch only those three CRDs, and the agent's machine GC listing VirtualMachines as the
    agent's ServiceAccount, with nothing more. Each can be turned off."""
    out = helm_run(
        helm, "template", "vk", "--namespace", "vks", "--kube-version", kubernetes_version(),
        values=_fleet_values(), tmp_path=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    name = "vk-vkubelet-vm-controller"
    deployment = docs[("Deployment", name)]["spec"]
    pod = deployment["template"]["spec"]
    assert pod["serviceAccountName"] == name and ("ServiceAccount", name) in docs
    (container,) = pod["containers"]
    assert container["args"][:3] == [
        "vm-controller",
        "--lease-namespace=vks",
        "--identity=$(POD_NAME)",
    ]
    # the agent's selector (and PDB) does not take the controller's pods
    agent = docs[("Deployment", "vk-vkubelet")]["spec"]["selector"]["matchLabels"]
    assert not agent.items() <= deployment["template"]["metadata"]["labels"].items()
    documented = _documented_controller_rules()
    leases = [r for r in documented if r["resources"] == ["leases"]]
    assert docs[("ClusterRole", name)]["rules"] == [r for r in documented if r not in leases]
    assert docs[("Role", name)]["metadata"]["namespace"] == "vks"
    assert docs[("Role", name)]["rules"] == leases
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        subjects = docs[(kind, name)]["subjects"]
        assert subjects == [{"kind": "ServiceAccount", "name": name, "namespace": "vks"}]
    # the CRDs: `vkubelet vm install-crds` in a pre-install/pre-upgrade hook, its grant limited
    crds = "vk-vkubelet-vm-crds"
    job = docs[("Job", crds)]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["vm", "install-crds"]
    (rule,) = docs[("ClusterRole", crds)]["rules"]
    assert rule["resources"] == ["customresourcedefinitions"]
    assert sorted(rule["resourceNames"]) == sorted(
        f"{p}.vkubelet.io"
        for p in ("virtualmachines", "virtualmachinebackups", "virtualmachinemigrations")
    )
    # the machine GC: in the provider config without a kubeconfig (the pod's account), which
    # may list VirtualMachines and nothing more
    config = yaml.safe_load(docs[("ConfigMap", "vk-vkubelet")]["data"]["provider.yaml"])
    assert config["machineGC"] == {"intervalSeconds": 300}
    gc = "vk-vkubelet-vm-machine-gc"
    assert docs[("ClusterRole", gc)]["rules"] == [
        {"apiGroups": ["vkubelet.io"], "resources": ["virtualmachines"], "verbs": ["list"]}
    ]
    assert docs[("ClusterRoleBinding", gc)]["subjects"] == [
        {"kind": "ServiceAccount", "name": "vk-vkubelet", "namespace": "vks"}
    ]
    off = helm_run(
        helm, "template", "vk", "--namespace", "vks", "--kube-version", kubernetes_version(),
        values=_fleet_values(controller={"enabled": False}, installCRDs=False,
                             machineGC={"enabled": False}),
        tmp_path=tmp_path,
    )  # fmt: skip
    assert off.returncode == 0, off.stderr
    rendered = [d for d in yaml.safe_load_all(off.stdout) if d]
    assert not [d for d in rendered if "vm-" in d["metadata"]["name"]]
    config = yaml.safe_load(
        next(d for d in rendered if d["kind"] == "ConfigMap")["data"]["provider.yaml"]
    )
    assert "machineGC" not in config
