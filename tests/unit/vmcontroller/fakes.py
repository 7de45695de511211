"""A VirtualMachine and its pods as the apiserver holds them, for the reconciler's pure rules
(the decisions and the power back-off both start from these)."""

from __future__ import annotations

from typing import Any

from vkubelet.vmcontroller._base import MACHINE_ANNOTATION, NAME_LABEL

UID = "9d3c-uid"


def vm(replicas: int = 1, mode: str = "Shutdown", **template: Any) -> dict[str, Any]:
    meta = template.pop("meta", {"labels": {"app": "db"}})
    spec = template.pop(
        "spec",
        {
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "512Mi"}},
                }
            ]
        },
    )
    return {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "db", "namespace": "ns", "uid": UID, "generation": 3},
        "spec": {
            "replicas": replicas,
            "powerOffMode": mode,
            "template": {"metadata": meta, "spec": spec},
        },
    }


def pod(
    name: str = "db-aaaaa",
    *,
    running: bool = True,
    deleting: bool = False,
    phase: str = "Running",
    created: str = "2026-01-01T00:00:00Z",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    resources: dict[str, Any] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "creationTimestamp": created,
        "labels": labels if labels is not None else {"app": "db", NAME_LABEL: "db"},
        "annotations": {MACHINE_ANNOTATION: UID, **(annotations or {})},
        "ownerReferences": [{"uid": UID, "kind": "VirtualMachine", "name": "db"}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    state = {"running": {}} if running else {"waiting": {"reason": "ContainerCreating"}}
    return {
        "metadata": meta,
        "spec": {
            "nodeName": "hv-1",
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": resources or {"limits": {"cpu": "1", "memory": "512Mi"}},
                }
            ],
        },
        "status": {
            "phase": phase,
            "podIP": "10.213.0.5",
            "containerStatuses": [{"name": "vm", "state": state}],
            "conditions": [{"type": "Ready", "status": "True" if running else "False"}],
        },
    }
