"""The libvirt runtime's domain XML (`_domainxml`): built from the QEMU runtime's LaunchSpec,
checked without a daemon (tests/integration/vm/test_libvirt.py boots one on libvirt)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._backend import LaunchSpec
from vkubelet.providers.vm._domainxml import (
    METADATA_URI,
    Owner,
    domain_name,
    domain_xml,
    owner_of,
    retarget,
)

OWNER = Owner("0f1e-uid", "team-a", "db-0", "hv-1")
SPEC = LaunchSpec(
    name="team-a/db-0",
    run_dir=Path("/state/vms/0f1e-uid/m"),
    vcpus=2,
    memory_mib=512,
    disks=((Path("/state/root.qcow2"), "virtio"), (Path("/state/scratch0.qcow2"), "virtio")),
    seed=Path("/state/seed.iso"),
    network_key="0f1e-uid",
    accel="tcg",
    max_vcpus=4,
    max_memory_mib=2048,
    memory_slots=4,
)


def parse(spec: LaunchSpec = SPEC, *, kvm: bool = False) -> ET.Element:
    return ET.fromstring(domain_xml(spec, OWNER, kvm=kvm))  # noqa: S314 - our own output


def test_the_domain_is_named_after_the_pod_so_names_never_clash() -> None:
    assert domain_name("team-a", "db-0") == "team-a_db-0"
    # `_` is in neither a namespace nor a pod name: a-b/c and a/b-c stay apart
    assert domain_name("a-b", "c") != domain_name("a", "b-c")
    assert parse().findtext("name") == "team-a_db-0"


def test_the_metadata_names_the_pod_uid_and_the_owning_node() -> None:
    element = parse().find(f"metadata/{{{METADATA_URI}}}pod")
    assert element is not None
    assert owner_of(ET.tostring(element, encoding="unicode")) == OWNER
    # as libvirt returns it: its own prefix, the same namespace
    returned = (
        f'<pod xmlns="{METADATA_URI}" uid="0f1e-uid" namespace="team-a" name="db-0" node="hv-1"/>'
    )
    assert owner_of(returned) == OWNER


@pytest.mark.parametrize(
    "metadata",
    [None, "", "<pod uid='x'/>", "<other uid='x' namespace='a' name='b' node='c'/>", "<pod"],
)
def test_a_domain_without_vkubelet_s_metadata_has_no_owner(metadata: str | None) -> None:
    assert owner_of(metadata) is None


def test_tcg_unless_kvm_was_chosen() -> None:
    assert parse().get("type") == "qemu"
    assert parse(kvm=True).get("type") == "kvm"


def test_disks_in_order_with_the_root_booting_and_the_seed_read_only_last() -> None:
    disks = parse().findall("devices/disk")
    sources = [d.find("source").get("file") for d in disks]  # type: ignore[union-attr]
    assert sources == ["/state/root.qcow2", "/state/scratch0.qcow2", "/state/seed.iso"]
    assert [d.find("target").get("dev") for d in disks] == ["vda", "vdb", "vdc"]  # type: ignore[union-attr]
    assert [d.find("driver").get("type") for d in disks] == ["qcow2", "qcow2", "raw"]  # type: ignore[union-attr]
    assert disks[0].find("boot") is not None and disks[1].find("boot") is None
    assert disks[2].find("readonly") is not None and disks[0].find("readonly") is None


def test_scsi_disks_get_a_virtio_scsi_controller() -> None:
    root = parse(replace(SPEC, disks=((Path("/r.qcow2"), "scsi"),), seed=None))
    assert root.find("devices/disk/target").attrib == {"dev": "sda", "bus": "scsi"}  # type: ignore[union-attr]
    assert root.find("devices/controller").attrib == {"type": "scsi", "model": "virtio-scsi"}  # type: ignore[union-attr]


def test_console_and_guest_agent_channel_are_there_for_logs_attach_and_exec() -> None:
    devices = parse().find("devices")
    assert devices is not None
    assert devices.find("serial").get("type") == "pty"  # type: ignore[union-attr]
    assert devices.find("console/target").get("type") == "serial"  # type: ignore[union-attr]
    channel = devices.find("channel/target")
    assert channel is not None and channel.get("name") == "org.qemu.guest_agent.0"
    assert devices.find("graphics") is None  # libvirt 9 refuses <graphics type='none'/>
    assert devices.find("panic").get("model") == "isa"  # type: ignore[union-attr]


def test_cpu_and_memory_leave_the_hotplug_room_the_spec_asks_for() -> None:
    root = parse()
    assert root.find("vcpu").text == "4" and root.find("vcpu").get("current") == "2"  # type: ignore[union-attr]
    assert root.find("maxMemory").attrib == {"slots": "4", "unit": "MiB"}  # type: ignore[union-attr]
    assert root.findtext("maxMemory") == "2048" and root.findtext("memory") == "512"
    cell = root.find("cpu/numa/cell")
    assert cell is not None and cell.get("cpus") == "0-3" and cell.get("memory") == "512"
    fixed = parse(replace(SPEC, max_vcpus=None, max_memory_mib=None, memory_slots=0))
    assert fixed.find("vcpu").text == "2" and fixed.find("vcpu").get("current") is None  # type: ignore[union-attr]
    assert fixed.find("maxMemory") is None and fixed.find("cpu") is None


def test_a_relaunch_of_a_resized_machine_starts_with_what_live_resize_plugged() -> None:
    plugged: dict[str, list[dict[str, Any]]] = {
        "cpus": [{"id": "vcpu1"}],
        "dimms": [{"id": "dimm1", "mib": 512}],
    }
    root = parse(replace(SPEC, hotplug=plugged))
    assert root.find("vcpu").text == "4" and root.find("vcpu").get("current") == "3"  # type: ignore[union-attr]
    assert root.findtext("memory") == "1024" and root.findtext("currentMemory") == "1024"
    assert root.find("cpu/numa/cell").get("memory") == "512"  # type: ignore[union-attr]
    (dimm,) = root.findall("devices/memory")
    assert dimm.get("model") == "dimm" and dimm.find("target/size").attrib == {"unit": "MiB"}  # type: ignore[union-attr]
    assert dimm.findtext("target/size") == "512" and dimm.findtext("target/node") == "0"


def test_a_pod_field_cannot_add_xml() -> None:
    owner = Owner("u", "ns", "x'/><devices/>", "hv")
    root = ET.fromstring(domain_xml(SPEC, owner, kvm=False))  # noqa: S314 - our own output
    assert root.findtext("name") == "ns_x'/><devices/>"
    assert len(root.findall("devices")) == 1


def test_pvc_disks_follow_the_seed_as_virtio_disks_whose_serial_is_the_claim_s_name() -> None:
    """As the QEMU runtime's `-drive`s (`_volumes.drive_args`): the guest finds each claim by
    its serial; a hibernated domain's restore points them at the same files."""
    spec = replace(SPEC, claims=((Path("/state/volumes/pvc-1.qcow2"), "data"),))
    disks = parse(spec).findall("devices/disk")
    assert [d.find("target").get("dev") for d in disks] == ["vda", "vdb", "vdc", "vdd"]  # type: ignore[union-attr]
    claim = disks[-1]
    assert claim.find("source").get("file") == "/state/volumes/pvc-1.qcow2"  # type: ignore[union-attr]
    assert claim.find("driver").get("type") == "qcow2"  # type: ignore[union-attr]
    assert claim.findtext("serial") == "data" and claim.find("readonly") is None
    restored = ET.fromstring(retarget(domain_xml(spec, OWNER, kvm=False), spec, OWNER))  # noqa: S314
    assert restored.findall("devices/disk")[-1].findtext("serial") == "data"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"incoming": True}, "live migration"),
        ({"extra_args": ("-device", "x")}, "QEMU options"),
    ],
)
def test_what_the_libvirt_runtime_does_not_do_yet_is_refused_naming_it(
    change: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=f"libvirt runtime cannot .*{words}"):
        domain_xml(replace(SPEC, **change), OWNER, kvm=False)  # type: ignore[arg-type]


def test_a_saved_domain_is_retargeted_to_the_next_pod_s_files_and_metadata() -> None:
    """A hibernated domain restored by the machine's next pod: that pod's seed (another file)
    and UID; the name and everything else as saved."""
    saved = domain_xml(SPEC, OWNER, kvm=False)
    nxt = replace(SPEC, name="team-a/db-1", seed=Path("/state/vms/new-uid/seed.iso"))
    owner = Owner("new-uid", "team-a", "db-1", "hv-1")
    root = ET.fromstring(retarget(saved, nxt, owner))  # noqa: S314 - our own output
    assert root.findtext("name") == "team-a_db-0"  # libvirt renames no saved domain
    sources = [d.find("source").get("file") for d in root.iter("disk")]  # type: ignore[union-attr]
    assert sources == ["/state/root.qcow2", "/state/scratch0.qcow2", "/state/vms/new-uid/seed.iso"]
    assert root.findtext("title") == "pod team-a/db-1 (vkubelet)"
    (pod,) = root.find("metadata")  # type: ignore[misc]
    assert owner_of(ET.tostring(pod, encoding="unicode")) == owner
    before, after = parse(), root
    for kept in ("vcpu", "memory", "devices/serial", "devices/channel"):
        assert ET.tostring(before.find(kept)) == ET.tostring(after.find(kept))  # type: ignore[arg-type]


def test_a_saved_domain_without_one_of_the_pod_s_disks_is_refused() -> None:
    saved = domain_xml(replace(SPEC, seed=None), OWNER, kvm=False)
    with pytest.raises(ValueError, match="no disk vdc"):
        retarget(saved, SPEC, OWNER)
