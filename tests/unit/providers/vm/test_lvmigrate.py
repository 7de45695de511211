"""Live migration between libvirt hosts (`_lvmigrate`): what the target publishes and what
the source's daemon is given, checked without a daemon
(tests/integration/vm/test_vm_libvirt_migration.py moves a domain between two lab hosts)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._backend import LaunchSpec
from vkubelet.providers.vm._config import ConfigError, load_config
from vkubelet.providers.vm._domainxml import Owner, disk_files, domain_xml, owner_of
from vkubelet.providers.vm._lvmigrate import copied_disks, destination_xml, failure, target_uri
from vkubelet.providers.vm._lvnet import attached_in, with_network
from vkubelet.providers.vm._machine import MachineExit
from vkubelet.providers.vm._migrate import DomainNetwork, DomainTarget, Endpoint, MigrationError
from vkubelet.providers.vm._net import GuestNetwork

SOURCE = Owner("src-uid", "team-a", "db-0", "hv-1")
SPEC = LaunchSpec(
    name="team-a/db-0",
    run_dir=Path("/a/vms/src-uid/m"),
    vcpus=1,
    memory_mib=256,
    disks=((Path("/a/root.qcow2"), "virtio"), (Path("/a/scratch0.qcow2"), "virtio")),
    seed=Path("/a/seed.iso"),
    network_key="src-uid",
    accel="tcg",
)
TARGET_SPEC = replace(
    SPEC,
    name="team-a/db-1",
    disks=((Path("/b/root.qcow2"), "virtio"), (Path("/b/scratch0.qcow2"), "virtio")),
    seed=Path("/b/seed.iso"),
)
TARGET = DomainTarget(
    uri="qemu+ssh://root@10.0.0.3/system?keyfile=/etc/vkubelet/migration.key",
    domain="team-a_db-1",
    files=tuple(sorted(disk_files(TARGET_SPEC).items())),
    owner=("dst-uid", "team-a", "db-1", "hv-2"),
)


def test_a_libvirt_endpoint_round_trips_through_its_json() -> None:
    endpoint = Endpoint("10.0.0.3", 0, 0, 0, ("vda", "vdb", "vdc"), pod="db-1", libvirt=TARGET)
    assert Endpoint.from_json(endpoint.to_json()) == endpoint
    # the controller matches the source's report to it by host:port, as for QEMU
    assert endpoint.target == "10.0.0.3:0"


def test_a_libvirt_endpoint_with_ports_of_the_agent_s_is_refused() -> None:
    text = Endpoint("10.0.0.3", 0, 0, 0, (), libvirt=TARGET).to_json()
    with pytest.raises(MigrationError, match="no ports"):
        Endpoint.from_json(text.replace('"migrationPort":0', '"migrationPort":4000'))


def test_the_destination_xml_has_the_target_pod_s_files_and_metadata_and_the_source_s_name() -> (
    None
):
    """libvirt refuses a DEST_XML of another name (it renames by DEST_NAME)."""
    root = ET.fromstring(destination_xml(domain_xml(SPEC, SOURCE, kvm=False), TARGET))  # noqa: S314
    assert root.findtext("name") == "team-a_db-0"
    sources = [d.find("source").get("file") for d in root.iter("disk")]  # type: ignore[union-attr]
    assert sources == ["/b/root.qcow2", "/b/scratch0.qcow2", "/b/seed.iso"]
    (pod,) = root.find("metadata")  # type: ignore[misc]
    assert owner_of(ET.tostring(pod, encoding="unicode")) == Owner(*TARGET.owner)


def test_the_destination_interface_is_the_target_pod_s_network_with_the_guest_s_mac() -> None:
    source_net = GuestNetwork("10.213.1.5", 24, "10.213.1.1", "52:54:00:aa:bb:cc")
    xml = with_network(
        domain_xml(SPEC, SOURCE, kvm=False), "src-uid", "vkvmsrc", source_net, bridge=None
    )
    network = DomainNetwork("dst-uid", "vkvmdst", "10.213.2.7", 24, "10.213.2.1")
    root = ET.fromstring(destination_xml(xml, replace(TARGET, network=network)))  # noqa: S314
    (interface,) = root.iterfind("devices/interface")
    assert interface.find("mac").get("address") == "52:54:00:aa:bb:cc"  # type: ignore[union-attr]
    assert interface.find("target").get("dev") == "vkvmdst"  # type: ignore[union-attr]
    ip = interface.find("source/ip")
    assert ip is not None and (ip.get("address"), ip.get("peer")) == ("10.213.2.1", "10.213.2.7")
    attached = attached_in(ET.tostring(root, encoding="unicode"))
    assert attached is not None and (attached.key, attached.link) == ("dst-uid", "vkvmdst")
    assert attached.network.address == "10.213.2.7"
    endpoint = Endpoint("10.0.0.3", 0, 0, 0, ("vda",), libvirt=replace(TARGET, network=network))
    assert Endpoint.from_json(endpoint.to_json()) == endpoint


def test_a_target_whose_disks_are_not_the_vm_s_is_refused() -> None:
    fewer = domain_xml(replace(SPEC, disks=SPEC.disks[:1]), SOURCE, kvm=False)
    with pytest.raises(ValueError, match="no disk vdc"):
        destination_xml(fewer, TARGET)


def test_the_writable_disks_are_copied_and_the_read_only_seed_is_not() -> None:
    assert copied_disks(domain_xml(SPEC, SOURCE, kvm=False)) == ["vda", "vdb"]


def test_the_target_uri_is_the_migration_uri_or_the_node_s_own_remote_one() -> None:
    remote = "qemu+ssh://root@hv-2/system"
    assert target_uri(remote, None) == remote
    assert target_uri("qemu:///system", remote) == remote
    with pytest.raises(MigrationError, match=r"libvirt\.migrationURI"):
        target_uri("qemu:///system", None)


def test_migration_uri_is_a_libvirt_setting_checked_as_a_uri(tmp_path: Path) -> None:
    config = tmp_path / "vm.yaml"
    config.write_text(
        "runtime: libvirt\nlibvirt: {uri: 'qemu:///system', migrationURI: 'qemu+ssh://hv/system'}\n"
    )
    assert load_config(config).libvirt_migration_uri == "qemu+ssh://hv/system"
    config.write_text("runtime: libvirt\nlibvirt: {migrationURI: hv-2}\n")
    with pytest.raises(ConfigError, match=r"libvirt\.migrationURI"):
        load_config(config)


def test_a_failure_whose_reason_ssh_lost_says_where_it_is() -> None:
    eof = "End of file while reading data: : Input/output error"
    said = failure(eof, "qemu+ssh://root@hv-2/system")
    assert said.startswith(f"libvirt: {eof}") and "qemu+libssh" in said
    refused = "Operation not supported: pre-creation of storage targets ..."
    assert failure(refused, "qemu+libssh://root@hv-2/system") == f"libvirt: {refused}"
    closed = "libssh transport error: Remote command terminated with non-zero code: -1"
    said = failure(closed, "qemu+libssh://root@hv-2/system")
    assert said.startswith(f"libvirt: {closed}") and "libvirtd log" in said


# -- what the source decides from libvirt's answers (the binding, no daemon) --------------------
class _Domain:
    def __init__(self, *states: tuple[int, int] | BaseException) -> None:
        self.states = list(states)
        self.undefined = False

    def state(self) -> tuple[int, int]:
        found = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(found, BaseException):
            raise found
        return found

    def undefine(self) -> None:
        self.undefined = True


class _Connection:
    uri = "qemu+ssh://root@hv-1/system"
    current = None

    def __init__(self, *domains: object) -> None:
        self.domains = list(domains)

    async def run(self, call: Any, *args: Any) -> Any:
        return call(*args)

    async def domain(self, uuid: str) -> object:
        return self.domains.pop(0) if len(self.domains) > 1 else self.domains[0]


def _error(libvirt: Any, code: int) -> BaseException:
    class Error(libvirt.libvirtError):  # type: ignore[misc]
        def get_error_code(self) -> int:
            return code

        def get_error_message(self) -> str:
            return "gone"

    return Error("gone")


async def test_a_failed_call_counts_as_moved_only_when_the_domain_left_this_host() -> None:
    """libvirt may fail after the target took the VM (its confirmation): then the VM runs
    there, and reporting Failed would start it here again."""
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")
    from vkubelet.providers.vm._lvmigrate import _stays

    migrated = (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED)
    running = (libvirt.VIR_DOMAIN_RUNNING, 1)
    assert not await _stays(_Connection(), _Domain(migrated))
    assert not await _stays(_Connection(), _Domain(_error(libvirt, libvirt.VIR_ERR_NO_DOMAIN)))
    assert await _stays(_Connection(), _Domain(running))
    assert await _stays(_Connection(), _Domain(_error(libvirt, libvirt.VIR_ERR_RPC)))


async def test_a_domain_that_migrated_away_ends_its_run_without_being_touched(
    tmp_path: Path,
) -> None:
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")
    from vkubelet.providers.vm._libvirt import LibvirtMachine

    away = _Domain((libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED))
    machine = LibvirtMachine(_Connection(away), tmp_path, "u-1", 3, 0.0)  # type: ignore[arg-type]
    assert await machine.wait() == MachineExit(0, "Migrated", "the domain migrated to another host")
    assert not away.undefined  # libvirt undefines it (UNDEFINE_SOURCE)

    # gone between the lookup and the state: asked again, never an error that restarts the pod
    vanishing = _Domain(_error(libvirt, libvirt.VIR_ERR_NO_DOMAIN))
    machine = LibvirtMachine(_Connection(vanishing, None), tmp_path, "u-2", 4, 0.0)  # type: ignore[arg-type]
    assert (await machine.wait()).code == 137


def test_a_fleet_s_hosts_each_say_how_the_others_reach_them(tmp_path: Path) -> None:
    """The other hosts' daemons log in with their own key: the agent's keyfile= in a host's
    uri is a path of the agent's, so each host names its migrationURI."""
    from vkubelet.providers.vm._fleet import load_fleet

    config = tmp_path / "vm.yaml"
    config.write_text(
        "hosts:\n"
        "  - {name: hv-1, uri: 'qemu+ssh://root@hv-1/system',"
        " migrationURI: 'qemu+libssh://root@hv-1/system?keyfile=/etc/m.key'}\n"
        "  - {name: hv-2, uri: 'qemu+ssh://root@hv-2/system', podCIDR: 10.213.2.0/24}\n"
    )
    hosts = load_fleet(config)
    assert hosts is not None
    one, two = (host.config.libvirt_migration_uri for host in hosts)
    assert one == "qemu+libssh://root@hv-1/system?keyfile=/etc/m.key" and two is None
    config.write_text(
        "libvirt: {migrationURI: 'qemu+ssh://x/system'}\n"
        "hosts: [{name: hv-1, uri: 'qemu+ssh://hv-1/system'}]\n"
    )
    with pytest.raises(ConfigError, match=r"libvirt\.migrationURI: .*hosts\[\]\.migrationURI"):
        load_fleet(config)
    config.write_text("hosts: [{name: a, uri: 'qemu+ssh://a/system', migrationURI: a}]\n")
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.migrationURI"):
        load_fleet(config)
