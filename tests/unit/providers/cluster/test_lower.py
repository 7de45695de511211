"""The lower cluster client: a bad kubeconfig or missing RBAC is named plainly at start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from vkubelet.kube import KubeClient
from vkubelet.node import ConfigError
from vkubelet.providers.cluster import (
    REQUIRED_PERMISSIONS,
    LowerCluster,
    MissingPermissions,
    is_ours,
    load_lower_config,
    open_lower,
)

from .fakes import lower_yaml
from .pods import OWNER


def test_a_missing_kubeconfig_names_lower_yaml_the_field_and_the_file(tmp_path: Path) -> None:
    config = load_lower_config(lower_yaml(tmp_path, kubeconfig=None))
    with pytest.raises(ConfigError) as raised:
        open_lower(config)
    assert str(raised.value) == (
        f"{tmp_path / 'lower.yaml'}: kubeconfig: {tmp_path / 'lower.kubeconfig'}: no such file"
    )


def test_a_broken_kubeconfig_or_unknown_context_is_named(tmp_path: Path) -> None:
    config = load_lower_config(lower_yaml(tmp_path, kubeconfig="clusters: ["))
    with pytest.raises(ConfigError, match=r"kubeconfig: .*lower.kubeconfig: not a usable"):
        open_lower(config)
    config = load_lower_config(lower_yaml(tmp_path, context="nope"))
    with pytest.raises(ConfigError, match=r"lower.yaml: context: 'nope' is not in"):
        open_lower(config)


def fake_lower(tmp_path: Path, handler: Any) -> LowerCluster:
    config = load_lower_config(lower_yaml(tmp_path))
    real = open_lower(config)
    client = KubeClient(real.client.config, transport=httpx.MockTransport(handler))
    return LowerCluster(client, config)


def test_missing_permissions_are_listed_by_verb_and_resource(tmp_path: Path) -> None:
    denied = {("create", "pods", "exec"), ("list", "nodes", ""), ("watch", "endpointslices", "")}
    asked: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        attributes = json.loads(request.content)["spec"]["resourceAttributes"]
        asked.append(attributes)
        key = (attributes["verb"], attributes["resource"], attributes.get("subresource", ""))
        return httpx.Response(200, json={"status": {"allowed": key not in denied}})

    lower = fake_lower(tmp_path, handler)
    with pytest.raises(MissingPermissions) as raised:
        asyncio.run(lower.check_permissions())
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'lower.yaml'}: lower cluster https://lower.example")
    assert "user lower-agent" in message and str(tmp_path / "lower.kubeconfig") in message
    assert "denies create pods/exec, list nodes, watch endpointslices.discovery.k8s.io" in message
    assert len(asked) == len(REQUIRED_PERMISSIONS)
    assert {"verb": "get", "group": "", "resource": "pods", "subresource": "log"} in asked


def test_all_permissions_granted_passes(tmp_path: Path) -> None:
    lower = fake_lower(tmp_path, lambda r: httpx.Response(200, json={"status": {"allowed": True}}))
    asyncio.run(lower.check_permissions())


def test_deletes_carry_the_grace_period_and_a_gone_object_is_no_error(tmp_path: Path) -> None:
    seen: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, json.loads(request.content or b"null")))
        if request.url.path.endswith("/gone"):
            return httpx.Response(404, json={"reason": "NotFound", "message": "gone"})
        return httpx.Response(200, json={})

    lower = fake_lower(tmp_path, handler)
    assert asyncio.run(lower.delete("Pod", "shop", "web", grace_period=30))
    assert not asyncio.run(lower.delete("Pod", "shop", "gone"))
    assert seen[0][:2] == ("DELETE", "/api/v1/namespaces/shop/pods/web")
    assert seen[0][2]["gracePeriodSeconds"] == 30
    assert seen[1][2] is None


def test_a_missing_namespace_is_created_with_our_stamps(tmp_path: Path) -> None:
    created: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        created.append(json.loads(request.content))
        return httpx.Response(409, json={"reason": "AlreadyExists", "message": "raced"})

    lower = fake_lower(tmp_path, handler)
    asyncio.run(lower.ensure_namespace("up-shop", OWNER))  # a lost race is fine
    [namespace] = created
    assert namespace["metadata"]["name"] == "up-shop"
    assert is_ours(namespace, OWNER)


def test_a_delete_is_conditional_on_the_uid_we_saw(tmp_path: Path) -> None:
    bodies: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        # What the apiserver answers when the object at that name has another UID.
        return httpx.Response(409, json={"reason": "Conflict", "message": "Precondition failed"})

    lower = fake_lower(tmp_path, handler)
    assert not asyncio.run(lower.delete("ConfigMap", "shop", "cfg", uid="u-1"))
    assert bodies == [
        {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": "u-1"}}
    ]
