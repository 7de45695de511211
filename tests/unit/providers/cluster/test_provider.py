"""The provider class over a scripted lower API: what it refuses to touch and how it says so."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ConfigError, KubeClient
from vkubelet.providers.cluster import (
    ClusterProvider,
    LowerCluster,
    create,
    load_lower_config,
    open_lower,
    stamp,
)
from vkubelet.sdk import ProviderContext, ProviderError, ResolvedPod

from .pods import OTHER, upper_pod
from .test_lower import lower_yaml


def context(tmp_path: Path | None) -> ProviderContext:
    path = None if tmp_path is None else tmp_path / "lower.yaml"
    return ProviderContext(
        node_name="vk-lower", config_path=path, internal_ip="10.0.0.9", kubelet_port=0
    )


def test_the_factory_needs_lower_yaml_and_does_not_contact_the_lower_cluster(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="needs --provider-config"):
        create(context(None))
    lower_yaml(tmp_path)
    provider = create(context(tmp_path))
    assert isinstance(provider, ClusterProvider) and provider.pass_through
    asyncio.run(provider.lower.aclose())


def scripted(
    tmp_path: Path, lower_pod: dict[str, Any] | None, writes: list[Any]
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
    return ClusterProvider(config, context(tmp_path), lower, background=False)


def resolved() -> ResolvedPod:
    pod = upper_pod(
        volumes=[], imagePullSecrets=[], serviceAccountName="default", initContainers=[]
    )
    pod["spec"]["containers"][0]["env"] = []
    pod["spec"]["containers"][0]["envFrom"] = []
    pod["spec"]["containers"][0]["volumeMounts"] = []
    return ResolvedPod(msgspec.convert(pod, Pod))


async def attempt(provider: ClusterProvider) -> ProviderError:
    try:
        with pytest.raises(ProviderError) as raised:
            await provider.create_pod(resolved())
        return raised.value
    finally:
        await provider.aclose()


def test_a_lower_pod_of_another_owner_is_a_conflict_and_is_left_alone(tmp_path: Path) -> None:
    writes: list[Any] = []
    theirs = stamp(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-7d9f-abcde", "uid": "x"}},
        OTHER,
        namespace="shop",
        name="web-7d9f-abcde",
        uid="someone-else",
    )
    error = asyncio.run(attempt(scripted(tmp_path, theirs, writes)))
    assert error.reason == "LowerNameConflict" and error.permanent
    assert "owned by virtual node 'vk-lower' of upper cluster 'upper-b'" in error.message
    assert [w for w in writes if w[0] != "POST" or not w[1].endswith("/namespaces")] == []


def test_the_users_own_lower_pod_of_that_name_is_left_alone(tmp_path: Path) -> None:
    writes: list[Any] = []
    users = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-7d9f-abcde"}}
    error = asyncio.run(attempt(scripted(tmp_path, users, writes)))
    assert error.reason == "LowerNameConflict"
    assert "the lower cluster's own object" in error.message
    assert not any(w[0] in ("DELETE", "PUT", "PATCH") for w in writes)


def test_a_namespace_forbidden_below_fails_the_pod_with_the_lower_apis_message(
    tmp_path: Path,
) -> None:
    error = asyncio.run(attempt(scripted(tmp_path, None, [])))
    assert (error.reason, error.permanent) == ("LowerForbidden", True)
    assert (
        error.message == 'lower cluster: create the lower pod: pods is forbidden: namespace "shop"'
    )


def test_a_pod_with_an_older_copy_of_a_configmap_does_not_roll_the_lower_copy_back(
    tmp_path: Path,
) -> None:
    config = load_lower_config(lower_yaml(tmp_path))
    written: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        body = json.loads(request.content)
        if body["kind"] == "ConfigMap":
            written.append(body["metadata"]["annotations"]["vkubelet.io/upper-resource-version"])
        return httpx.Response(201, json=body)

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    provider = ClusterProvider(config, context(tmp_path), lower, background=False)

    def pod(name: str, version: str) -> ResolvedPod:
        spec = upper_pod(
            volumes=[], imagePullSecrets=[], serviceAccountName="default", initContainers=[]
        )
        spec["metadata"]["name"] = name
        spec["metadata"]["uid"] = "uid-" + name
        spec["spec"]["containers"][0].update(
            env=[], volumeMounts=[], envFrom=[{"configMapRef": {"name": "web-config"}}]
        )
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": version},
            "data": {"v": version},
        }
        return ResolvedPod(
            msgspec.convert(spec, Pod), references={("ConfigMap", "shop", "web-config"): config_map}
        )

    async def scenario() -> None:
        await provider.create_pod(pod("fresh", "7"))
        await provider.create_pod(pod("stale", "5"))
        await provider.aclose()

    asyncio.run(scenario())
    assert written and set(written) == {"7"}


def test_a_dependency_name_taken_by_the_user_blocks_the_pod_and_is_left_alone(
    tmp_path: Path,
) -> None:
    config = load_lower_config(lower_yaml(tmp_path, dependencyNames="same"))
    writes: list[tuple[str, str]] = []
    users = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config"}}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET" and path.endswith("/configmaps/web-config"):
            return httpx.Response(200, json=users)
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        writes.append((request.method, path))
        if path.endswith("/configmaps"):
            return httpx.Response(409, json={"reason": "AlreadyExists", "message": "exists"})
        return httpx.Response(201, json=json.loads(request.content))

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    provider = ClusterProvider(config, context(tmp_path), lower, background=False)
    pod = resolved()
    spec = msgspec.to_builtins(pod.pod)
    spec["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "web-config"}}]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": "3"},
        "data": {},
    }
    refs = {("ConfigMap", "shop", "web-config"): config_map}

    async def scenario() -> ProviderError:
        try:
            with pytest.raises(ProviderError) as raised:
                await provider.create_pod(ResolvedPod(msgspec.convert(spec, Pod), references=refs))
            return raised.value
        finally:
            await provider.aclose()

    error = asyncio.run(scenario())
    assert (error.reason, error.permanent) == ("LowerDependencyConflict", True)
    assert "lower cluster's own object" in error.message
    assert not any(m in ("PUT", "PATCH", "DELETE") for m, _ in writes)
    assert not any(p.endswith("/pods") for _, p in writes)  # the pod is not created
