"""The VM provider's config file: defaults, paths relative to the file, errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.providers.vm._config import ConfigError, load_config
from vkubelet.sdk.logs import LogRotation


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vm.yaml"
    path.write_text(text)
    return path


def test_an_empty_file_gives_defaults_next_to_it(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config.state_dir == tmp_path / "vm-state"
    assert config.image_store == tmp_path / "vm-state" / "images"
    assert config.accel == "auto"
    assert config.image_prefix == "vm.vkubelet.io"
    assert config.log_rotation == LogRotation(max_bytes=10 * 2**20, max_files=5)  # the kubelet's


def test_the_console_log_rotation_is_configured_as_the_kubelet_s(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "containerLogMaxSize: 1Mi\ncontainerLogMaxFiles: 2\n"))
    assert config.log_rotation == LogRotation(max_bytes=2**20, max_files=2)


def test_paths_are_relative_to_the_file_and_quantities_are_parsed(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            "stateDir: state\nimageStore: /srv/images\naccel: tcg\n"
            "reserved: {cpu: 500m, memory: 1Gi}\npodCIDR: 10.9.0.0/24\n"
            "translations: [{name: tiny, url: 'file:///x.qcow2'}]\n"
            "translationsFile: rules.yaml\nimageGCIntervalSeconds: 30\n"
            "translationConfigMap: {namespace: kube-system, name: vm-images, kubeconfig: r.kc}\n",
        )
    )
    assert config.state_dir == tmp_path / "state"
    assert config.image_store == Path("/srv/images")
    assert config.accel == "tcg"
    assert (config.reserved_millicpu, config.reserved_memory) == (500, 2**30)
    assert config.pod_cidr == "10.9.0.0/24"
    assert config.translations == [{"name": "tiny", "url": "file:///x.qcow2"}]
    assert config.translations_file == tmp_path / "rules.yaml"
    assert config.image_gc_interval == 30
    cm = config.translation_config_map
    assert cm is not None and (cm.namespace, cm.name) == ("kube-system", "vm-images")
    assert cm.kubeconfig == tmp_path / "r.kc" and cm.interval == 30


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("accel: fast\n", "accel"),
        ("reserved: {memory: lots}\n", "reserved.memory"),
        ("reserved: {cpu: x}\n", "reserved.cpu"),
        ("podCIDR: 10.0.0.0/30\n", "podCIDR"),
        ("podCIDR: nonsense\n", "podCIDR"),
        ("translations: {a: b}\n", "translations"),
        ("imageGCIntervalSeconds: -1\n", "imageGCIntervalSeconds"),
        ("stateDirr: x\n", "stateDirr"),
        ("defaults: {memory: 1Mi}\n", "defaults"),
        ("containerLogMaxSize: 1Ki\n", "containerLogMaxSize"),
        ("containerLogMaxSize: big\n", "containerLogMaxSize"),
        ("containerLogMaxFiles: 1\n", "containerLogMaxFiles"),
        ("translationConfigMap: {namespace: a, name: b}\n", "translationConfigMap.kubeconfig"),
        (
            "translationConfigMap: {namespace: a, name: b, kubeconfig: k, x: 1}\n",
            "translationConfigMap.x",
        ),
    ],
)
def test_a_bad_option_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: {field}:"):
        load_config(path)


def test_a_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [\n"))


def test_the_network_is_routed_without_cluster_dns_unless_configured(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "{}\n"))
    assert (config.network_mode, config.cluster_dns, config.cluster_domain) == (
        "routed",
        (),
        "cluster.local",
    )
    text = "network: {mode: host-only, clusterDNS: [10.96.0.10], clusterDomain: corp.example.}\n"
    config = load_config(write(tmp_path, text))
    assert (config.network_mode, config.cluster_dns, config.cluster_domain) == (
        "host-only",
        ("10.96.0.10",),
        "corp.example",
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("network: {mode: overlay}\n", "network.mode"),
        ("network: {clusterDNS: [10.96.0.10, dns.local]}\n", r"network\.clusterDNS\[1\]"),
        ("network: {clusterDomain: 'cluster local'}\n", "network.clusterDomain"),
    ],
)
def test_a_bad_network_setting_is_refused_naming_it(tmp_path: Path, text: str, field: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: {field}:"):
        load_config(path)


BRIDGED = "{mode: bridged, bridge: br0, subnet: 192.0.2.0/24, gateway: 192.0.2.1, pool: %s}"


def test_bridged_mode_takes_the_bridge_subnet_gateway_and_pool(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "network: " + BRIDGED % "192.0.2.100-192.0.2.150"))
    assert config.network_mode == "bridged"
    assert config.bridged is not None
    assert (config.bridged.bridge, config.bridged.subnet, config.bridged.gateway) == (
        "br0",
        "192.0.2.0/24",
        "192.0.2.1",
    )
    assert config.bridged.pool == ("192.0.2.100", "192.0.2.150")


@pytest.mark.parametrize(
    ("network", "field", "why"),
    [
        ("{mode: bridged, subnet: 192.0.2.0/24, gateway: 192.0.2.1, pool: 192.0.2.9-192.0.2.9}",
         "network.bridge", "required"),
        ("{mode: bridged, bridge: br0, subnet: 192.0.2.0/24, pool: 192.0.2.9-192.0.2.9}",
         "network.gateway", "required"),
        (BRIDGED % "192.0.2.100-192.0.3.150", "network.pool", "not a host address of subnet"),
        (BRIDGED % "192.0.2.100", "network.pool", "not a range"),
        (BRIDGED % "192.0.2.150-192.0.2.100", "network.pool", "ends before it starts"),
        (BRIDGED % "192.0.2.1-192.0.2.20", "network.pool", "holds the gateway"),
        (BRIDGED.replace("gateway: 192.0.2.1", "gateway: 198.51.100.1") % "192.0.2.9-192.0.2.9",
         "network.gateway", "not a host address of subnet"),
        (BRIDGED.replace("192.0.2.0/24", "192.0.2.0/33") % "192.0.2.9-192.0.2.9",
         "network.subnet", "not an IPv4 network"),
        (BRIDGED.replace("br0", "'a/b'") % "192.0.2.9-192.0.2.9", "network.bridge", "not a net"),
        ("{mode: routed, pool: 192.0.2.9-192.0.2.9}", "network.pool", "only for network.mode"),
    ],
)  # fmt: skip
def test_a_bad_bridged_setting_is_refused_naming_it(
    tmp_path: Path, network: str, field: str, why: str
) -> None:
    path = write(tmp_path, f"network: {network}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: {field}: .*{why}"):
        load_config(path)


def test_the_runtime_is_qemu_unless_libvirt_is_chosen_with_its_uri(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "{}\n"))
    assert (config.runtime, config.libvirt_uri) == ("qemu", "qemu:///system")
    config = load_config(write(tmp_path, "runtime: libvirt\n"))
    assert (config.runtime, config.libvirt_uri) == ("libvirt", "qemu:///system")
    remote = "qemu+ssh://root@hv-2/system?keyfile=/k&no_tty=1"
    config = load_config(write(tmp_path, f"runtime: libvirt\nlibvirt: {{uri: '{remote}'}}\n"))
    assert config.libvirt_uri == remote


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("runtime: xen\n", "runtime"),
        ("libvirt: {uri: 'qemu:///system'}\n", "libvirt"),
        ("runtime: libvirt\nlibvirt: {uri: hv-2}\n", "libvirt.uri"),
        ("runtime: libvirt\nlibvirt: {url: 'qemu:///system'}\n", "libvirt.url"),
        ("runtime: libvirt\nlibvirt: {uri: ''}\n", "libvirt.uri"),
        ("runtime: libvirt\nnetwork: {mode: host-only}\n", "network.mode"),
    ],
)
def test_a_bad_runtime_setting_is_refused_naming_it(tmp_path: Path, text: str, field: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: {field}:"):
        load_config(path)
