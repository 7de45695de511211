"""A lower cluster for the provider's tests: its lower.yaml, a scripted lower API behind a real
provider, the provider's context, and lower nodes and pods as a snapshot holds them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import yaml
from lightkube.resources.core_v1 import Pod

from vkubelet.kube import KubeClient
from vkubelet.providers.cluster import ClusterProvider, LowerCluster, load_lower_config, open_lower
from vkubelet.sdk import EventSink, ProviderContext, ResolvedPod

from .pods import upper_pod

JSON = dict[str, Any]

KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "lower", "cluster": {"server": "https://lower.example:6443"}}],
    "users": [{"name": "lower-agent", "user": {"token": "t"}}],
    "contexts": [{"name": "lower", "context": {"cluster": "lower", "user": "lower-agent"}}],
    "current-context": "lower",
}


def lower_yaml(tmp_path: Path, kubeconfig: Any = KUBECONFIG, **extra: Any) -> Path:
    if kubeconfig is not None:
        (tmp_path / "lower.kubeconfig").write_text(
            kubeconfig if isinstance(kubeconfig, str) else yaml.safe_dump(kubeconfig)
        )
    path = tmp_path / "lower.yaml"
    path.write_text(yaml.safe_dump({"kubeconfig": "lower.kubeconfig", **extra}))
    return path


def context(tmp_path: Path | None, events: EventSink | None = None) -> ProviderContext:
    path = None if tmp_path is None else tmp_path / "lower.yaml"
    made = ProviderContext(
        node_name="vk-lower", config_path=path, internal_ip="10.0.0.9", kubelet_port=0
    )
    return made if events is None else dataclasses.replace(made, events=events)


def scripted(
    tmp_path: Path,
    lower_pod: dict[str, Any] | None,
    writes: list[Any],
    events: EventSink | None = None,
) -> ClusterProvider:
    config = load_lower_config(lower_yaml(tmp_path))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET" and "/pods/" in request.url.path:
            if lower_pod is None:
                return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
            return httpx.Response(200, json=lower_pod)
        if request.method == "GET" and "/namespaces/" in request.url.path:
            return httpx.Response(200, json={"metadata": {"name": "shop"}})
        writes.append((request.method, request.url.path, json.loads(request.content or b"null")))
        if request.url.path.endswith("/pods"):
            return httpx.Response(
                403,
                json={"reason": "Forbidden", "message": 'pods is forbidden: namespace "shop"'},
            )
        return httpx.Response(201, json=json.loads(request.content))

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    return ClusterProvider(config, context(tmp_path, events), lower, background=False)


def resolved() -> ResolvedPod:
    pod = upper_pod(
        volumes=[], imagePullSecrets=[], serviceAccountName="default", initContainers=[]
    )
    pod["spec"]["containers"][0]["env"] = []
    pod["spec"]["containers"][0]["envFrom"] = []
    pod["spec"]["containers"][0]["volumeMounts"] = []
    return ResolvedPod(msgspec.convert(pod, Pod))


def node(name: str, cpu: str, *, labels: dict[str, str] | None = None, **spec: Any) -> JSON:
    return {
        "metadata": {"name": name, "uid": name, "labels": labels or {}},
        "spec": spec,
        "status": {
            "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "10"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod(cpu: str, node_name: str | None = None, **spec: Any) -> JSON:
    return {
        "metadata": {"name": "p", "uid": f"p-{node_name}-{cpu}"},
        "spec": {
            **({"nodeName": node_name} if node_name else {}),
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
            **spec,
        },
        "status": {"phase": "Running"},
    }
