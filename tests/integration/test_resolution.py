"""What providers are handed, against the real control plane: command lines with `$(VAR)`
expanded (proven on a real sshd device, where an unexpanded `$(POD_NAME)` would be a shell
command substitution), and for a pass-through provider the pod as written plus exactly the
objects it references, read under the Node authorizer and followed when they change."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import yaml
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.devcluster import Cluster
from vkubelet.kube import KubeClient
from vkubelet.node import ResolvedPod
from vkubelet.node._agent import NodeAgent
from vkubelet.node._nodecontroller import NodeSettings
from vkubelet.node._resolution import ServiceCache
from vkubelet.testing import (
    Kubectl,
    local_test_address,
    node_kubeconfig,
    node_ready,
    start_agent,
    wait_for,
)
from vkubelet.testing.harness import eventually
from vkubelet.testing.sshlab import SshDeviceFactory, ssh_inventory

TOLERATE = [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}]


# -- $(VAR) expansion, on a real SSH device ---------------------------------------------------
def test_an_ssh_pod_runs_its_command_with_var_references_expanded_not_substituted(
    kube_cluster: Cluster, kubectl: Kubectl, ssh_devices: SshDeviceFactory, tmp_path: Path
) -> None:
    [device] = ssh_devices()
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(ssh_inventory([device])))
    name = f"expand-{uuid.uuid4().hex[:6]}"
    with local_test_address() as address:
        agent = start_agent(
            kube_cluster, tmp_path, provider="ssh", config=inventory, name="lab", address=address
        )
        try:
            wait_for(lambda: node_ready(kubectl, device.name), timeout=60, what="node Ready")
            kubectl.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name},
                    "spec": {
                        "nodeName": device.name,
                        "restartPolicy": "Never",
                        "tolerations": TOLERATE,
                        "containers": [
                            {
                                "name": "main",
                                "image": "host",
                                "command": ["sh", "-c", 'echo "name=$(POD_NAME)"'],
                                "args": [],
                                "env": [
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    }
                                ],
                            }
                        ],
                    },
                }
            )

            def phase() -> str:
                status = kubectl.json("get", "pod", name).get("status") or {}
                return str(status.get("phase", ""))

            wait_for(lambda: phase() in ("Succeeded", "Failed"), timeout=60, what="pod done")
            logs = kubectl("logs", name).stdout
            # Unexpanded, sh would run a command named POD_NAME: "POD_NAME: not found", "name=".
            assert logs == f"name={name}\n"
            assert phase() == "Succeeded"
        finally:
            kubectl("delete", "pod", name, "--ignore-not-found", "--wait=false")
            agent.stop()
            kubectl("delete", "node", device.name, "--ignore-not-found", "--wait=false")


# -- pass-through pods, in-process agent under the Node authorizer ----------------------------
class RecordingPassThrough:
    """A provider that forwards pods elsewhere: records what it is given, reports Running."""

    pass_through = True

    def __init__(self) -> None:
        self.created: list[ResolvedPod] = []
        self.updated: list[ResolvedPod] = []
        self.pods: dict[str, Pod] = {}

    async def create_pod(self, pod: ResolvedPod) -> None:
        self.created.append(pod)
        self.pods[f"{pod.namespace}/{pod.name}"] = pod.pod

    async def update_pod(self, pod: ResolvedPod) -> None:
        self.updated.append(pod)
        self.pods[f"{pod.namespace}/{pod.name}"] = pod.pod

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        meta = pod.metadata
        assert meta is not None
        self.pods.pop(f"{meta.namespace}/{meta.name}", None)

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        return self.pods.get(f"{namespace}/{name}")

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        if f"{namespace}/{name}" not in self.pods:
            return None
        return PodStatus(phase="Running")

    async def list_pods(self) -> list[Pod]:
        return list(self.pods.values())

    @property
    def latest(self) -> ResolvedPod:
        return (self.updated or self.created)[-1]


async def run_kubectl(kubectl: Kubectl, *args: str, input: str | None = None) -> str:
    """kubectl off the event loop, so the in-process agent keeps running meanwhile."""
    result = await asyncio.to_thread(kubectl, *args, input=input)
    return result.stdout


@contextlib.asynccontextmanager
async def pass_through_node(
    cluster: Cluster, kubectl: Kubectl, tmp_path: Path, provider: RecordingPassThrough
) -> AsyncIterator[str]:
    node = f"vk-pass-{uuid.uuid4().hex[:6]}"
    kubeconfig = await asyncio.to_thread(
        node_kubeconfig, cluster, kubectl, node, tmp_path / "node.kubeconfig"
    )
    client = KubeClient.from_kubeconfig(kubeconfig)
    services = ServiceCache(client)
    settings = NodeSettings(name=node, provider="pass-through", node_restricted=True)
    agent = NodeAgent(client, settings, provider, services=services, workers=4)
    task = asyncio.create_task(agent.run(), name="pass-through node")
    try:
        yield node
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if services._task is not None:
            services._task.cancel()
            with contextlib.suppress(BaseException):
                await services._task
        await agent.pods.objects.aclose()
        await client.aclose()
        await run_kubectl(kubectl, "delete", "node", node, "--ignore-not-found", "--wait=false")


def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


async def test_a_pass_through_provider_gets_the_pod_unresolved_its_objects_and_their_changes(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    ns = f"pass-{uuid.uuid4().hex[:6]}"
    await run_kubectl(kubectl, "create", "namespace", ns)
    provider = RecordingPassThrough()
    objects: list[dict[str, Any]] = [
        {"kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"MODE": "prod"}},
        {"kind": "ConfigMap", "metadata": {"name": "files"}, "data": {"a.conf": "x=1"}},
        {"kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"pw": "s3cret"}},
        {"kind": "ServiceAccount", "metadata": {"name": "robot"}},
        {
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    for item in objects:
        item = {"apiVersion": "v1", **item}
        item["metadata"] = {**item["metadata"], "namespace": ns}
        await run_kubectl(kubectl, "apply", "-f", "-", input=msgspec.json.encode(item).decode())
    try:
        async with pass_through_node(kube_cluster, kubectl, tmp_path, provider) as node:
            await eventually(
                lambda: node_ready(kubectl, node), what="node Ready", within=30, interval=0.1
            )
            container = {
                "name": "main",
                "image": "registry.example/app:1",
                "command": ["run", "$(PW)"],
                "env": [
                    {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "pw"}}}
                ],
                "envFrom": [{"configMapRef": {"name": "settings"}}],
            }
            manifest = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "web", "namespace": ns},
                "spec": {
                    "nodeName": node,
                    "tolerations": TOLERATE,
                    "serviceAccountName": "robot",
                    "automountServiceAccountToken": False,
                    "imagePullSecrets": [{"name": "registry"}],
                    "containers": [container],
                    "volumes": [
                        {"name": "files", "configMap": {"name": "files"}},
                        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                    ],
                },
            }
            await run_kubectl(
                kubectl, "apply", "-f", "-", input=msgspec.json.encode(manifest).decode()
            )
            await eventually(lambda: provider.created, what="create_pod", within=30)
            given = provider.created[0]
            spec: dict[str, Any] = msgspec.to_builtins(given.pod.spec)
            [main] = spec["containers"]
            assert main["env"] == container["env"], "the Secret reference, not its value"
            assert main["envFrom"] == container["envFrom"]
            assert main["command"] == ["run", "$(PW)"]
            assert spec["imagePullSecrets"] == [{"name": "registry"}]
            assert {v["name"] for v in spec["volumes"]} == {"files", "data"}
            assert given.volumes == {}
            assert "s3cret" not in msgspec.json.encode(given.pod).decode()
            refs = given.references
            assert set(refs) == {
                ("ConfigMap", ns, "settings"),
                ("ConfigMap", ns, "files"),
                ("Secret", ns, "creds"),
                ("Secret", ns, "registry"),
                ("ServiceAccount", ns, "robot"),
                ("PersistentVolumeClaim", ns, "data"),
            }
            creds = refs[("Secret", ns, "creds")]
            assert creds is not None and creds["data"] == {"pw": b64("s3cret")}
            assert refs[("Secret", ns, "registry")] is None, "missing: the provider decides"
            robot = refs[("ServiceAccount", ns, "robot")]
            assert robot is not None and robot["metadata"]["name"] == "robot"
            claim = refs[("PersistentVolumeClaim", ns, "data")]
            assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
            await eventually(
                lambda: (
                    kubectl.json("get", "pod", "web", "-n", ns)["status"].get("phase") == "Running"
                ),
                what="Running",
                within=30,
                interval=0.1,
            )

            patch = '{"stringData": {"pw": "n3w"}}'
            await run_kubectl(kubectl, "patch", "secret", "creds", "-n", ns, "-p", patch)

            def secret_data() -> Any:
                creds = provider.latest.references[("Secret", ns, "creds")]
                return creds and creds["data"]

            await eventually(
                lambda: secret_data() == {"pw": b64("n3w")},
                what="Secret update",
                within=30,
            )
            assert provider.updated, "told through update_pod"

            patch = '{"data": {"MODE": "dev"}}'
            await run_kubectl(kubectl, "patch", "configmap", "settings", "-n", ns, "-p", patch)

            def settings() -> Any:
                found = provider.latest.references[("ConfigMap", ns, "settings")]
                return found and found["data"]

            await eventually(
                lambda: settings() == {"MODE": "dev"},
                what="ConfigMap update",
                within=30,
            )
            assert len(provider.created) == 1
    finally:
        await run_kubectl(kubectl, "delete", "namespace", ns, "--wait=false")
