"""A fleet of libvirt hosts (`hosts:` in the vm config): one node per host with the shared
defaults, the host's URI with its key and verification, its own state; errors name the field;
the volume markers of `_pool`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vkubelet.providers.vm import VMFleet, VMProvider, create
from vkubelet.providers.vm._config import LibvirtPool
from vkubelet.providers.vm._fleet import load_fleet
from vkubelet.providers.vm._pool import PooledLibvirtRuntime, volume_marker
from vkubelet.sdk import ConfigError, ProviderContext


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vm.yaml"
    path.write_text(text)
    return path


FLEET = """
stateDir: state
defaults: {cpu: "2", memory: 512Mi}
libvirt: {pool: {name: vms, path: /srv/vms}}
hosts:
  - name: hv-1
    uri: qemu+ssh://root@192.0.2.11/system
    identityFile: keys/hv-1.key
    labels: {example.com/rack: r1}
  - name: hv-2
    uri: qemu+ssh://root@192.0.2.12:2222/system?no_tty=1
    noVerify: true
    podCIDR: 10.213.2.0/24
    taints: ["example.com/hv=2:NoSchedule"]
"""


def test_each_host_is_a_node_with_the_shared_defaults_its_uri_and_its_own_state(
    tmp_path: Path,
) -> None:
    hosts = load_fleet(write(tmp_path, FLEET))
    assert hosts is not None
    one, two = hosts
    assert (one.name, two.name) == ("hv-1", "hv-2")
    key = tmp_path / "keys" / "hv-1.key"
    assert one.config.libvirt_uri == f"qemu+ssh://root@192.0.2.11/system?keyfile={key}&no_tty=1"
    assert two.config.libvirt_uri == ("qemu+ssh://root@192.0.2.12:2222/system?no_tty=1&no_verify=1")
    for host in hosts:
        assert host.config.runtime == "libvirt"
        assert host.config.default_millicpu == 2000  # the shared defaults
        assert host.config.libvirt_pool == LibvirtPool("vms", "/srv/vms")
        assert host.config.state_dir == tmp_path / "state" / host.name
    assert one.config.image_store != two.config.image_store
    assert (one.config.pod_cidr, two.config.pod_cidr) == ("10.213.0.0/24", "10.213.2.0/24")
    assert (one.labels, one.taints) == ({"example.com/rack": "r1"}, None)
    assert two.taints == [{"key": "example.com/hv", "value": "2", "effect": "NoSchedule"}]


@pytest.mark.parametrize("uri", ["hv-2", "qemu:///system", "qemu+ssh:///system"])
def test_a_migration_uri_that_names_no_host_is_refused_naming_the_field(
    tmp_path: Path, uri: str
) -> None:
    """The other hosts' daemons reach this host's with it: one naming no host cannot be."""
    path = write(tmp_path, f"hosts: [{{name: a, uri: 'qemu+ssh://a/s', migrationURI: '{uri}'}}]")
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.migrationURI: .* naming this host"):
        load_fleet(path)


BRIDGED = "{mode: bridged, bridge: br0, subnet: 10.9.0.0/24, gateway: 10.9.0.1, pool: 10.9.0.10-10.9.0.30}"  # noqa: E501


def test_a_host_s_network_is_merged_over_the_shared_one_and_its_addresses_are_its_own(
    tmp_path: Path,
) -> None:
    text = f"""
network: {BRIDGED}
hosts:
  - {{name: hv-1, uri: 'qemu+ssh://hv-1/system'}}
  - {{name: hv-2, uri: 'qemu+ssh://hv-2/system', network: {{pool: 10.9.0.40-10.9.0.50}}}}
  - {{name: hv-3, uri: 'qemu+ssh://hv-3/system', network: {{mode: routed, clusterDNS: [10.96.0.10],
      bridge: null, subnet: null, gateway: null, pool: null}}, podCIDR: 10.213.3.0/24}}
"""
    hosts = load_fleet(write(tmp_path, text))
    assert hosts is not None
    one, two, three = (host.config for host in hosts)
    assert one.bridged is not None and two.bridged is not None
    assert (one.bridged.pool, two.bridged.pool) == (
        ("10.9.0.10", "10.9.0.30"),
        ("10.9.0.40", "10.9.0.50"),
    )
    assert two.bridged.bridge == "br0" and two.bridged.gateway == "10.9.0.1"  # (shared)
    assert (three.bridged, three.network_mode, three.pod_cidr) == (None, "routed", "10.213.3.0/24")
    assert three.cluster_dns == ("10.96.0.10",)


def test_a_fleet_without_a_pool_gets_the_default_pool(tmp_path: Path) -> None:
    hosts = load_fleet(write(tmp_path, "hosts: [{name: hv-1, uri: 'qemu+ssh://hv-1/system'}]"))
    assert hosts is not None
    assert hosts[0].config.libvirt_pool == LibvirtPool()


def test_a_config_without_hosts_is_a_single_node(tmp_path: Path) -> None:
    assert load_fleet(write(tmp_path, "runtime: libvirt\n")) is None
    assert load_fleet(write(tmp_path, "")) is None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("hosts: []", "hosts"),
        ("hosts: [{name: hv-1}]", "hosts[0].uri"),
        ("hosts: [{name: hv-1, uri: x, port: 22}]", "hosts[0].port"),
        ("hosts: [{name: HV_1, uri: 'qemu+ssh://a/system'}]", "hosts[0].name"),
        (
            "hosts: [{name: a, uri: 'qemu+ssh://a/system'}, {name: a, uri: 'qemu+ssh://b/system'}]",
            "hosts[1].name",
        ),
        ("hosts: [{name: a, uri: hv-1}]", "hosts[0].uri"),
        ("hosts: [{name: a, uri: 'qemu+tls://a/system', identityFile: k}]", "hosts[0].uri"),
        (
            "hosts: [{name: a, uri: 'qemu+ssh://a/system?keyfile=/k', identityFile: k}]",
            "hosts[0].uri",
        ),
        ("hosts: [{name: a, uri: 'qemu+ssh://a/system', podCIDR: nope}]", "podCIDR"),
        ("hosts: [{name: a, uri: 'qemu+ssh://a/system', taints: [x]}]", "hosts[0].taints"),
        ("runtime: qemu\nhosts: [{name: a, uri: 'qemu+ssh://a/system'}]", "runtime"),
        ("libvirt: {uri: 'qemu:///system'}\nhosts: [{name: a, uri: 'x://a'}]", "libvirt.uri"),
        ("libvirt: {pool: {path: vms}}\nhosts: [{name: a, uri: 'x://a'}]", "libvirt.pool.path"),
        ("hosts: [{name: a, uri: 'qemu+ssh://a/s'}]\ndefaults: {cpu: x}", "defaults.cpu"),
        ("hosts: [{name: a, uri: 'qemu+ssh://a/s', network: {mode: nope}}]", "network.mode"),
        ("hosts: [{name: a, uri: 'qemu+ssh://a/s', network: [x]}]", "hosts[0].network"),
        # two hosts that would hand out the same addresses (the shared podCIDR, one pool)
        (
            "hosts: [{name: a, uri: 'qemu+ssh://a/s'}, {name: b, uri: 'qemu+ssh://b/s'}]",
            "hosts[1].podCIDR",
        ),
        (
            f"network: {BRIDGED}\nhosts: [{{name: a, uri: 'qemu+ssh://a/s'}},"
            " {name: b, uri: 'qemu+ssh://b/s', network: {pool: 10.9.0.20-10.9.0.40}}]",
            "hosts[1].network.pool",
        ),
    ],
)
def test_a_bad_fleet_config_names_the_file_and_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_fleet(path)
    assert str(path) in str(caught.value)
    assert f"{field}:" in str(caught.value), caught.value


def test_the_vm_entry_point_makes_one_provider_per_host(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)
    fleet = create(ProviderContext("ignored", path, "10.0.0.9", 10250))
    assert isinstance(fleet, VMFleet)

    async def members() -> list[str]:
        nodes = await anext(aiter(fleet.watch_nodes()))
        for node in nodes:
            assert isinstance(node.provider, VMProvider)
            assert isinstance(node.provider.runtime, PooledLibvirtRuntime)
            assert node.provider.node_name == node.name
        return [n.name for n in nodes]

    assert asyncio.run(members()) == ["hv-1", "hv-2"]


def test_a_volume_marker_names_the_volume_and_a_real_disk_is_none(tmp_path: Path) -> None:
    marker = tmp_path / "root.qcow2"
    volume = {"pool": "vkubelet", "name": "vkubelet-hv-1-ab-root.qcow2", "path": "/p/v"}
    marker.write_text(json.dumps({"libvirtVolume": volume}))
    assert volume_marker(marker) == volume
    disk = tmp_path / "disk.qcow2"
    disk.write_bytes(b"QFI\xfb" + bytes(8192))
    assert volume_marker(disk) is None
    assert volume_marker(tmp_path / "missing") is None


def test_a_single_node_with_a_pool_gets_the_pooled_runtime(tmp_path: Path) -> None:
    path = write(tmp_path, "runtime: libvirt\nlibvirt: {uri: 'qemu+ssh://hv/system', pool: {}}\n")
    provider = create(ProviderContext("hv-1", path, "10.0.0.9", 10250))
    assert isinstance(provider, VMProvider)
    assert isinstance(provider.runtime, PooledLibvirtRuntime)
    assert provider.config.libvirt_pool == LibvirtPool()
