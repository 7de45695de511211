"""The CRDs shipped in the package: what `kubectl` users rely on (short names, printer columns,
the scale subresource) and what refuses bad input (the schema's limits and enums)."""

from __future__ import annotations

from typing import Any

import yaml
from typer.testing import CliRunner

from vkubelet.cli import app
from vkubelet.vmcontroller import crd_yaml
from vkubelet.vmcontroller._crds import crd_documents


def _crds() -> dict[str, dict[str, Any]]:
    return {doc["spec"]["names"]["kind"]: doc for doc in crd_documents()}


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return dict(version)


def test_the_three_kinds_have_their_short_names_in_vkubelet_io() -> None:
    crds = _crds()
    assert {k: c["spec"]["names"]["shortNames"] for k, c in crds.items()} == {
        "VirtualMachine": ["vm"],
        "VirtualMachineBackup": ["vmbackup"],
        "VirtualMachineMigration": ["vmmigration"],
    }
    assert {c["spec"]["group"] for c in crds.values()} == {"vkubelet.io"}
    assert all(_version(c)["name"] == "v1alpha1" for c in crds.values())


def test_a_virtual_machine_scales_between_zero_and_one_and_shows_phase_node_ip() -> None:
    version = _version(_crds()["VirtualMachine"])
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Node", "IP", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    replicas = spec["replicas"]
    assert (replicas["minimum"], replicas["maximum"], replicas["default"]) == (0, 1, 1)
    assert spec["powerOffMode"]["enum"] == ["Shutdown", "Hibernate"]
    assert spec["restoreFrom"]["required"] == ["backup"]
    imported = spec["importDomain"]
    assert imported["required"] == ["name"]
    assert imported["properties"]["deletionPolicy"]["enum"] == ["Retain", "Delete"]
    assert imported["properties"]["deletionPolicy"]["default"] == "Retain"


def test_a_backup_needs_a_vm_and_exactly_one_absolute_directory_or_claim() -> None:
    version = _version(_crds()["VirtualMachineBackup"])
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["vmName", "target"]
    target = spec["properties"]["target"]
    assert (target["minProperties"], target["maxProperties"]) == (1, 1)
    assert target["properties"]["directory"]["pattern"] == "^/"
    assert spec["properties"]["mode"]["enum"] == ["Auto", "Full", "Incremental"]


def test_install_crds_print_shows_the_yaml_without_a_cluster() -> None:
    result = CliRunner().invoke(app, ["vm", "install-crds", "--print"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.output) if d]
    assert [d["metadata"]["name"] for d in docs] == [
        "virtualmachines.vkubelet.io",
        "virtualmachinebackups.vkubelet.io",
        "virtualmachinemigrations.vkubelet.io",
    ]
    assert result.output == crd_yaml()
