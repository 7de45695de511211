"""The agent's side of an admission webhook: HTTPS with the given certificate (verified by the
caBundle it installs), the configuration server-side applied, the routes, and the audit warning
once per pod admitted without the webhook."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import httpx2 as httpx
import pytest

from vkubelet.agent._webhook import audit_once, serve_webhook, webhooks
from vkubelet.providers.cluster._admission import OPT_IN_LABEL, SKIPPED_REASON, ConstraintWebhook
from vkubelet.providers.cluster._constraints import ANNOTATION
from vkubelet.providers.cluster._webhookconfig import WebhookConfig
from vkubelet.testing.harness import eventually

from .pki import TestCA

JSON = dict[str, Any]


class FakeClient:
    """The calls the webhook makes on the agent's client, answered from memory."""

    def __init__(self, namespaces: list[JSON], pods: list[JSON]) -> None:
        self.namespaces, self.pods = namespaces, pods
        self.patches: list[tuple[str, JSON, str]] = []

    async def patch(self, path: str, body: JSON, content_type: str) -> JSON:
        self.patches.append((path, body, content_type))
        return body

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        if path == "/api/v1/namespaces":
            return {"items": self.namespaces}
        selector = (params or {}).get("labelSelector", "")
        if path == "/api/v1/pods":  # the pod-label list: only pods with the label
            return {"items": [p for p in self.pods if _label(p) == "enabled"]}
        namespace = path.split("/")[4]
        assert selector == f"{OPT_IN_LABEL}!=disabled"
        return {
            "items": [
                p
                for p in self.pods
                if p["metadata"]["namespace"] == namespace and _label(p) != "disabled"
            ]
        }


def _label(pod: JSON) -> str | None:
    labels: dict[str, str] = pod["metadata"].get("labels") or {}
    return labels.get(OPT_IN_LABEL)


class FakeEvents:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, str, str, str]] = []

    def emit(self, ref: Any, type: str, reason: str, message: str) -> None:
        self.emitted.append((ref.name, type, reason, message))


class FakeNode:
    def __init__(self, provider: Any = None) -> None:
        self.events = FakeEvents()
        self.provider = provider
        self.settings = type("Settings", (), {"name": "vk-1", "kubelet_port": 10250})()


def pod(name: str, namespace: str, label: str | None = None, seen: bool = False) -> JSON:
    metadata: JSON = {"name": name, "namespace": namespace, "uid": f"uid-{name}"}
    if label:
        metadata["labels"] = {OPT_IN_LABEL: label}
    if seen:
        metadata["annotations"] = {ANNOTATION: '{"v":1}'}
    return {"metadata": metadata, "status": {"phase": "Pending"}}


NAMESPACES = [
    {"metadata": {"name": "shop", "labels": {OPT_IN_LABEL: "enabled"}}},
    {"metadata": {"name": "other", "labels": {}}},
    {"metadata": {"name": "kube-system", "labels": {OPT_IN_LABEL: "enabled"}}},
]
PODS = [
    pod("blind", "shop"),
    pod("seen", "shop", seen=True),
    pod("out", "shop", "disabled"),
    pod("labelled", "other", "enabled"),
    pod("plain", "other"),
    pod("system", "kube-system", "enabled"),
]


async def test_the_audit_warns_once_per_opted_in_pod_the_webhook_never_saw() -> None:
    client, node = FakeClient(NAMESPACES, PODS), FakeNode()
    hook = ConstraintWebhook("vk-1", WebhookConfig(enabled=True), "127.0.0.1")
    warned: set[str] = set()
    assert await audit_once(cast(Any, client), cast(Any, node), hook, warned) == 2
    assert await audit_once(cast(Any, client), cast(Any, node), hook, warned) == 0
    assert sorted(n for n, *_ in node.events.emitted) == ["blind", "labelled"]
    assert {(t, r) for _, t, r, _ in node.events.emitted} == {("Warning", SKIPPED_REASON)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_the_webhook_answers_over_https_verified_by_the_installed_ca_bundle(
    tmp_path: Path,
) -> None:
    ca = TestCA("upper-ca")
    ca.issue(tmp_path / "w.crt", tmp_path / "w.key", name="vk-1", addresses=["127.0.0.1"])
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    config = WebhookConfig(
        enabled=True,
        port=_free_port(),
        cert_file=tmp_path / "w.crt",
        key_file=tmp_path / "w.key",
        ca_file=tmp_path / "ca.crt",
    )
    hook = ConstraintWebhook("vk-1", config, "127.0.0.1")
    provider = type("Provider", (), {"admission_webhook": lambda self: hook})()
    node = FakeNode(provider)
    assert webhooks([cast(Any, node)]) == [(cast(Any, node), hook)]
    client = FakeClient(NAMESPACES, PODS)
    client.config = type("C", (), {"cluster": type("K", (), {})()})()  # type: ignore[attr-defined]
    client.config.cluster.certificate_auth_data = None  # type: ignore[attr-defined]
    client.config.cluster.certificate_auth = None  # type: ignore[attr-defined]
    task = asyncio.create_task(serve_webhook(cast(Any, client), cast(Any, node), hook, None))
    try:
        await eventually(lambda: client.patches, what="the configuration applied")
        path, applied, content_type = client.patches[0]
        assert path.endswith("/vkubelet-constraints-vk-1?fieldManager=vkubelet&force=true")
        assert content_type == "application/apply-patch+yaml"
        url = applied["webhooks"][0]["clientConfig"]["url"]
        assert url == f"https://127.0.0.1:{config.port}/mutate"
        bundle = base64.b64decode(applied["webhooks"][0]["clientConfig"]["caBundle"])
        (tmp_path / "bundle.crt").write_bytes(bundle)

        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "r-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "namespace": "shop",
                "operation": "CREATE",
                "object": {"metadata": {"name": "p"}, "spec": {"nodeSelector": {"disk": "ssd"}}},
            },
        }
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=tmp_path / "bundle.crt")
        ) as http:
            answer = await http.post(url, json=review)
            assert answer.status_code == 200
            response = answer.json()["response"]
            assert response["allowed"] is True and response["patchType"] == "JSONPatch"
            assert (await http.post(url, content=b"{}")).status_code == 400
            assert (await http.get(url)).status_code == 405
            assert (await http.post(url.replace("/mutate", "/x"), json=review)).status_code == 404
        await eventually(lambda: len(node.events.emitted) == 2, what="the first audit")
        assert sorted(n for n, *_ in node.events.emitted) == ["blind", "labelled"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert json.loads(json.dumps(applied))["webhooks"][1]["failurePolicy"] == "Ignore"
