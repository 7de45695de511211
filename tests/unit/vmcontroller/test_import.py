"""`vkubelet vm import`: the VirtualMachine it writes for a domain and a node, and what it does
with the node's verdict (a refusal deletes the VirtualMachine it created). The node's side is
tests/unit/providers/vm/test_import.py; a real import, tests/integration/vm/test_vm_libvirt.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from vkubelet.cli import app
from vkubelet.kube import ApiError
from vkubelet.vmcontroller import import_manifest, import_vm, vm_name_for
from vkubelet.vmcontroller._vm import decide


class FakeClient:
    """The VirtualMachine as the apiserver keeps it, its status as `statuses` say in turn."""

    def __init__(self, *statuses: dict[str, Any], exists: bool = False) -> None:
        self.statuses, self.exists = list(statuses), exists
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        if self.exists:
            raise ApiError(409, "AlreadyExists", "virtualmachines.vkubelet.io exists")
        self.created.append(body)
        return dict(body)

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        if path.startswith("/api/v1/nodes/"):
            if path != "/api/v1/nodes/hv-1":
                raise ApiError(404, "NotFound", f"nodes {path.rsplit('/', 1)[1]!r} not found")
            return {"metadata": {"name": "hv-1"}}
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return {**self.created[-1], "status": status}

    async def delete(self, path: str, body: Any = None) -> dict[str, Any]:
        self.deleted.append(path)
        return {}


def test_the_vm_name_comes_from_the_domain_s_unless_none_can() -> None:
    assert vm_name_for("Legacy_DB.prod") == "legacy-db-prod"
    with pytest.raises(ValueError, match="--name"):
        vm_name_for("___")


def test_the_manifest_imports_the_domain_on_the_node_and_its_pods_say_so() -> None:
    manifest = import_manifest(
        "Legacy_DB", "hv-1", name="db", namespace="prod", deletion_policy="Delete", cpu="2"
    )
    spec = manifest["spec"]
    assert spec["importDomain"] == {"name": "Legacy_DB", "deletionPolicy": "Delete"}
    template = spec["template"]["spec"]
    assert template["nodeSelector"] == {"kubernetes.io/hostname": "hv-1"}
    assert template["containers"][0]["resources"] == {"limits": {"cpu": "2"}}
    made = {**manifest, "metadata": {**manifest["metadata"], "uid": "vm-uid"}}
    created = decide(made, []).create
    assert created is not None
    assert created["metadata"]["annotations"]["vm.vkubelet.io/domain"] == "Legacy_DB"


def test_print_writes_the_virtual_machine_and_creates_nothing() -> None:
    result = CliRunner().invoke(app, ["vm", "import", "legacy", "--node", "hv-1", "--print"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    assert printed["metadata"] == {"name": "legacy", "namespace": "default"}
    assert printed["spec"]["importDomain"]["deletionPolicy"] == "Retain"


async def test_a_refused_import_deletes_the_virtual_machine_it_created() -> None:
    refused = {
        "phase": "Starting",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "DomainNotFound", "message": "nope"}
        ],
    }
    client = FakeClient({"phase": "Starting"}, refused)
    manifest = import_manifest("d", "hv-1", name="d", namespace="ns")
    result = await import_vm(client, manifest, wait_seconds=30)  # type: ignore[arg-type]
    assert (result.running, result.reason, result.message) == (False, "DomainNotFound", "nope")
    assert client.deleted == ["/apis/vkubelet.io/v1alpha1/namespaces/ns/virtualmachines/d"]


async def test_a_running_import_is_kept_and_a_name_taken_or_an_unknown_node_is_an_error() -> None:
    running = {"phase": "Running", "podName": "d-x", "nodeName": "hv-1"}
    client = FakeClient(running)
    manifest = import_manifest("d", "hv-1", name="d", namespace="ns")
    result = await import_vm(client, manifest, wait_seconds=30)  # type: ignore[arg-type]
    assert result.running and "d-x" in result.message and client.deleted == []
    with pytest.raises(ValueError, match="exists already"):
        await import_vm(FakeClient(running, exists=True), manifest, wait_seconds=30)  # type: ignore[arg-type]
    elsewhere = import_manifest("d", "hv-9", name="d", namespace="ns")
    absent = FakeClient(running)
    with pytest.raises(ValueError, match="no node 'hv-9'"):
        await import_vm(absent, elsewhere, wait_seconds=30)  # type: ignore[arg-type]
    assert absent.created == []
