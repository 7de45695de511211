"""In-memory API objects for the resolution tests, built the way the API server returns them."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from vkubelet.node.resolve import SourceReadError

NS = "shop"
ALLOCATABLE: dict[str, Any] = {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "100Gi"}


def b64(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else value
    return base64.b64encode(raw).decode()


def configmap(
    name: str,
    data: dict[str, str] | None = None,
    *,
    binary: dict[str, bytes] | None = None,
    namespace: str = NS,
) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace}}
    if data is not None:
        obj["data"] = data
    if binary is not None:
        obj["binaryData"] = {k: b64(v) for k, v in binary.items()}
    return obj


def secret(name: str, data: dict[str, str | bytes], *, namespace: str = NS) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "data": {k: b64(v) for k, v in data.items()},
    }


def service(
    name: str,
    cluster_ip: str,
    ports: Sequence[dict[str, Any]] = ({"port": 80},),
    *,
    namespace: str = NS,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": cluster_ip, "ports": list(ports)},
    }


KUBERNETES = service(
    "kubernetes",
    "10.96.0.1",
    [{"name": "https", "port": 443, "protocol": "TCP"}],
    namespace="default",
)


@dataclass
class FakeSources:
    """A `Sources` over dicts; objects listed in `unreadable` raise `SourceReadError`."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    secrets: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    unreadable: set[tuple[str, str]] = field(default_factory=set)
    services_unreadable: bool = False
    reads: list[tuple[str, str, str]] = field(default_factory=list)
    service_gets: int = 0
    service_lists: int = 0

    def _find(self, items: list[dict[str, Any]], kind: str, ns: str, name: str) -> Any:
        self.reads.append((kind, ns, name))
        if (kind, name) in self.unreadable:
            raise SourceReadError("connection refused")
        for item in items:
            meta = item["metadata"]
            if meta["namespace"] == ns and meta["name"] == name:
                return item
        return None

    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self._find(self.objects, "ConfigMap", namespace, name)
        return found

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self._find(self.secrets, "Secret", namespace, name)
        return found

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.services_unreadable:
            raise SourceReadError("watch cache not synced")
        self.service_gets += 1
        for item in self.services:
            if item["metadata"]["namespace"] == namespace and item["metadata"]["name"] == name:
                return item
        return None

    def list_services(self, namespace: str) -> list[dict[str, Any]]:
        self.service_lists += 1
        if self.services_unreadable:
            raise SourceReadError("watch cache not synced")
        return [s for s in self.services if s["metadata"]["namespace"] == namespace]


@dataclass
class FakeTokens:
    """A `TokenSource` that records requests and hands out predictable tokens."""

    expiry: datetime = datetime(2030, 1, 1, tzinfo=UTC)
    fail: bool = False
    requests: list[tuple[str, str, str | None, int]] = field(default_factory=list)

    def request_token(
        self,
        namespace: str,
        service_account: str,
        audience: str | None,
        expiration_seconds: int,
        pod: Any,
    ) -> tuple[str, datetime]:
        self.requests.append((namespace, service_account, audience, expiration_seconds))
        if self.fail:
            raise SourceReadError('serviceaccounts "app" is forbidden')
        return f"token-for-{service_account}-{audience or 'default'}", self.expiry


def pod(
    *,
    containers: Sequence[dict[str, Any]] | None = None,
    volumes: Sequence[dict[str, Any]] | None = None,
    namespace: str = NS,
    **spec: Any,
) -> dict[str, Any]:
    """A scheduled pod with one container "app" unless told otherwise."""
    return {
        "metadata": {
            "name": "web-0",
            "namespace": namespace,
            "uid": "6f1c2b9e-0000-4000-8000-000000000001",
            "labels": {"app": "web", "tier": "front"},
            "annotations": {"owner": "team-a"},
        },
        "spec": {
            "nodeName": "virtual-node",
            "serviceAccountName": "app",
            "containers": list(containers if containers is not None else [{"name": "app"}]),
            "volumes": list(volumes or []),
            **spec,
        },
        "status": {
            "podIP": "10.244.1.7",
            "podIPs": [{"ip": "10.244.1.7"}],
            "hostIP": "192.168.0.10",
            "hostIPs": [{"ip": "192.168.0.10"}],
        },
    }
