"""Seed content: meta-data, merged user-data, netplan, and the small guest's extra files."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from vkubelet.providers.vm._cloudinit import CloudInitError, SeedContent, build_seed_content

UID = "6f1c7b9e-3a1d-4d7e-9b1a-2f0c8e6d5a41"
KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA alice@example"
KEY_B = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ bob@example"
SECRET = b"password=hunter2\n"


@dataclass(frozen=True)
class Net:
    address: str = "10.244.1.5"
    prefix: int = 24
    gateway: str = "10.244.1.1"
    mac: str = "52:54:00:AB:CD:EF"
    dns: tuple[str, ...] = ("10.96.0.10", "1.1.1.1")
    search: tuple[str, ...] = ()


def seed(
    annotations: dict[str, str] | None = None,
    files: dict[str, bytes] | None = None,
    **kwargs: Any,
) -> SeedContent:
    return build_seed_content(
        "web-0", UID, annotations or {}, files or {}, kwargs.pop("network", None), **kwargs
    )


def cloud_config(content: SeedContent) -> dict[str, Any]:
    assert content.user_data.startswith("#cloud-config\n")
    data = yaml.safe_load(content.user_data)
    assert isinstance(data, dict)
    return data


def test_meta_data_names_the_pod_uid_and_hostname() -> None:
    assert yaml.safe_load(seed().meta_data) == {"instance-id": UID, "local-hostname": "web-0"}
    assert seed().extra_files["vkubelet/hostname"] == b"web-0\n"


def test_a_long_pod_name_is_cut_to_a_valid_hostname() -> None:
    content = build_seed_content("a" * 62 + "-b" * 10, UID, {}, {}, None)
    assert yaml.safe_load(content.meta_data)["local-hostname"] == "a" * 62


def test_files_become_write_files_with_their_modes_and_extra_files() -> None:
    files = {"/etc/app/config.yaml": b"a: 1\n", "/run/secrets/db": SECRET, "/bin/x": b"\xff\x00"}
    content = seed(files=files, modes={"/run/secrets/db": 0o600})
    written = {f["path"]: f for f in cloud_config(content)["write_files"]}
    assert {path: base64.b64decode(f["content"]) for path, f in written.items()} == files
    assert written["/run/secrets/db"]["permissions"] == "0600"
    assert written["/etc/app/config.yaml"]["permissions"] == "0644"
    assert {f["encoding"] for f in written.values()} == {"b64"}
    for path, data in files.items():
        assert content.extra_files["vkubelet/files" + path] == data
    assert set(content.extra_files) == {"vkubelet/hostname"} | {
        "vkubelet/files" + path for path in files
    }


def test_ssh_keys_from_the_pod_and_both_annotations_are_merged_once() -> None:
    annotations = {
        "VirtletSSHKeys": f"{KEY_A}\n\n# comment\n{KEY_B}\n",
        "vm.vkubelet.io/ssh-keys": KEY_A,
    }
    content = seed(annotations, ssh_keys=[KEY_B])
    assert cloud_config(content)["ssh_authorized_keys"] == [KEY_B, KEY_A]
    assert yaml.safe_load(content.meta_data)["public-keys"] == [KEY_B, KEY_A]
    assert content.extra_files["vkubelet/authorized_keys"] == f"{KEY_B}\n{KEY_A}\n".encode()


def test_user_data_annotations_are_merged_with_lists_appended() -> None:
    annotations = {
        "VirtletCloudInitUserData": "runcmd: [[touch, /a]]\nssh_authorized_keys: [k2]\n",
        "vm.vkubelet.io/cloud-init-user-data": (
            "runcmd: [[touch, /b]]\nusers: [{name: ops}]\npackage_update: false\n"
        ),
    }
    data = cloud_config(seed(annotations, {"/etc/f": b"x"}, ssh_keys=["k1"]))
    assert data["runcmd"] == [["touch", "/a"], ["touch", "/b"]]
    assert data["ssh_authorized_keys"] == ["k1", "k2"]
    assert data["users"] == [{"name": "ops"}]
    assert data["package_update"] is False
    assert [f["path"] for f in data["write_files"]] == ["/etc/f"]


def test_where_the_two_annotations_clash_the_project_one_wins() -> None:
    annotations = {
        "VirtletCloudInitUserData": "a: {x: 1}\nb: [1]\nc: 1\n",
        "vm.vkubelet.io/cloud-init-user-data": "a: [2]\nb: {y: 2}\nc: [3]\n",
    }
    assert cloud_config(seed(annotations)) == {"a": [2], "b": {"y": 2}, "c": [3]}


def test_user_data_overwrite_replaces_the_generated_user_data() -> None:
    annotations = {
        "VirtletCloudInitUserData": "runcmd: [reboot]\n",
        "VirtletCloudInitUserDataOverwrite": "true",
    }
    content = seed(annotations, {"/etc/f": b"x"}, ssh_keys=[KEY_A])
    assert cloud_config(content) == {"runcmd": ["reboot"]}
    assert yaml.safe_load(content.meta_data)["public-keys"] == [KEY_A]  # keys still installed
    assert content.extra_files["vkubelet/files/etc/f"] == b"x"  # the small guest still gets it


def test_a_user_data_script_is_used_verbatim() -> None:
    script = "#!/bin/sh\necho hello > /tmp/hi\n"
    content = seed({"vm.vkubelet.io/cloud-init-user-data-script": script}, {"/etc/f": b"x"})
    assert content.user_data == script


def test_meta_data_annotations_are_merged_over_the_generated() -> None:
    annotations = {
        "VirtletCloudInitMetaData": '{"public-keys": ["k"], "local-hostname": "vm1"}',
        "vm.vkubelet.io/cloud-init-meta-data": "zone: a\n",
    }
    assert yaml.safe_load(seed(annotations).meta_data) == {
        "instance-id": UID,
        "local-hostname": "vm1",
        "public-keys": ["k"],
        "zone": "a",
    }


_USER_DATA = "VirtletCloudInitUserData"
_META_DATA = "vm.vkubelet.io/cloud-init-meta-data"
_OVERWRITE = "VirtletCloudInitUserDataOverwrite"
_KIND = "vm.vkubelet.io/cloud-init-type"


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({_USER_DATA: "a: 1\nb: [\n"}, rf"^annotation {_USER_DATA}: line \d+"),
        ({_META_DATA: "a: b: c"}, rf"^annotation {_META_DATA}: line 1"),
        ({_USER_DATA: "- a\n- b\n"}, "must be a YAML mapping, not list"),
        ({_OVERWRITE: "maybe"}, f"{_OVERWRITE}: must be true or false"),
        ({_USER_DATA: "write_files: nope"}, f"{_USER_DATA}: write_files: must be a list"),
        ({_KIND: "iso"}, f"^annotation {_KIND}: must be nocloud or configdrive, got 'iso'"),
        (
            {"VirtletCloudInitImageType": "configdrive", _KIND: ""},
            f"^annotation {_KIND}: must be nocloud or configdrive",
        ),
    ],
)
def test_a_broken_annotation_is_named_in_the_error(
    annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(CloudInitError, match=message) as caught:
        seed(annotations, {"/run/secrets/db": SECRET})
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("path", ["relative", "/a/../etc/shadow", "/a//b", "/", "/a\nb"])
def test_a_bad_file_path_is_refused(path: str) -> None:
    with pytest.raises(CloudInitError, match="files: ") as caught:
        seed(files={path: SECRET})
    assert "hunter2" not in str(caught.value)


def test_network_config_is_netplan_v2_matched_by_mac() -> None:
    content = seed(network=Net())
    assert content.network_config is not None
    assert yaml.safe_load(content.network_config) == {
        "version": 2,
        "ethernets": {
            "eth0": {
                "match": {"macaddress": "52:54:00:ab:cd:ef"},
                "set-name": "eth0",
                "addresses": ["10.244.1.5/24"],
                "routes": [{"to": "0.0.0.0/0", "via": "10.244.1.1"}],
                "nameservers": {"addresses": ["10.96.0.10", "1.1.1.1"]},
            }
        },
    }
    assert content.extra_files["vkubelet/network"] == (
        b"MAC=52:54:00:ab:cd:ef\nADDRESS=10.244.1.5/24\nGATEWAY=10.244.1.1\n"
        b"DNS=10.96.0.10 1.1.1.1\n"
    )


def test_no_network_means_no_network_config() -> None:
    content = seed()
    assert content.network_config is None
    assert "vkubelet/network" not in content.extra_files
    assert "vkubelet/authorized_keys" not in content.extra_files


@pytest.mark.parametrize(
    ("net", "field"),
    [
        (Net(address="10.0.0.300"), "network.address"),
        (Net(address="$(reboot)"), "network.address"),
        (Net(prefix=33), "network.prefix"),
        (Net(gateway="gw"), "network.gateway"),
        (Net(mac="52:54:00:ab:cd"), "network.mac"),
        (Net(dns=("1.1.1.1; reboot",)), "network.dns"),
    ],
)
def test_a_bad_network_value_is_refused(net: Net, field: str) -> None:
    with pytest.raises(CloudInitError, match=f"^{field}: "):
        seed(network=net)


# -- the merge keeps everything the user gave ----------------------------------------------------
_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
_keys = st.text(min_size=1, max_size=12).filter(
    lambda k: k not in ("write_files", "ssh_authorized_keys")
)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=4),
    max_leaves=20,
)
_user_data = st.dictionaries(_keys, _values, max_size=6)


def _contains(merged: Any, given: Any) -> bool:
    if isinstance(given, dict):
        return isinstance(merged, dict) and all(
            key in merged and _contains(merged[key], value) for key, value in given.items()
        )
    if isinstance(given, list):
        return isinstance(merged, list) and merged[len(merged) - len(given) :] == given
    return bool(merged == given)


@given(
    first=_user_data,
    second=_user_data,
    extra_files=st.lists(st.text("abc/", min_size=1, max_size=5), max_size=3),
    extra_keys=st.lists(st.text("xyz", min_size=1, max_size=5), max_size=3),
)
def test_merged_user_data_keeps_every_value_the_user_gave_and_the_pods_needs(
    first: dict[str, Any], second: dict[str, Any], extra_files: list[str], extra_keys: list[str]
) -> None:
    first = {**first, "write_files": [{"path": "/user/" + p} for p in extra_files]}
    second = {**second, "ssh_authorized_keys": extra_keys}
    annotations = {
        "VirtletCloudInitUserData": yaml.safe_dump(first),
        "vm.vkubelet.io/cloud-init-user-data": yaml.safe_dump(second),
    }
    data = cloud_config(seed(annotations, {"/pod/file": b"x"}, ssh_keys=[KEY_A]))
    # The later annotation wins where values clash; the earlier keeps all it does not touch.
    assert _contains(data, second)
    for key, value in first.items():
        if key not in second:
            assert _contains(data[key], value)
    assert data["write_files"][0]["path"] == "/pod/file"
    assert data["write_files"][1:] == first["write_files"]
    assert data["ssh_authorized_keys"] == [KEY_A, *extra_keys]


def configdrive(annotations: dict[str, str] | None = None, **kwargs: Any) -> SeedContent:
    return seed({"VirtletCloudInitImageType": "configdrive", **(annotations or {})}, **kwargs)


def test_the_seed_is_nocloud_unless_an_annotation_asks_for_a_configdrive() -> None:
    assert seed().kind == "nocloud"
    assert seed({"VirtletCloudInitImageType": "nocloud"}).kind == "nocloud"
    assert seed({"VirtletCloudInitImageType": " ConfigDrive "}).kind == "configdrive"
    assert seed({_KIND: "configdrive"}).kind == "configdrive"
    # The project's annotation applies after virtlet's.
    both = {"VirtletCloudInitImageType": "configdrive", _KIND: "nocloud"}
    assert seed(both).kind == "nocloud"


def test_configdrive_meta_data_is_openstack_json_with_the_pod_uid_name_and_keys() -> None:
    content = configdrive(
        {"VirtletSSHKeys": KEY_A, _META_DATA: "availability_zone: a\nlaunched: 2024-01-02\n"},
        ssh_keys=[KEY_B],
    )
    assert json.loads(content.meta_data) == {
        "uuid": UID,
        "hostname": "web-0",
        "name": "web-0",
        "public_keys": {"key0": KEY_B, "key1": KEY_A},
        "availability_zone": "a",
        "launched": "2024-01-02",  # a YAML date, written as JSON text
    }
    # user-data and the small guest's extras are those of a NoCloud seed.
    nocloud = seed({"VirtletSSHKeys": KEY_A}, ssh_keys=[KEY_B])
    assert content.user_data == nocloud.user_data
    assert content.extra_files == nocloud.extra_files


def test_configdrive_network_data_is_openstack_static_ipv4_matched_by_mac() -> None:
    content = configdrive(network=Net())
    assert content.network_config is not None
    dns = [{"type": "dns", "address": "10.96.0.10"}, {"type": "dns", "address": "1.1.1.1"}]
    default = "0.0.0.0"  # noqa: S104  (the default route, not an address to bind)
    assert json.loads(content.network_config) == {
        "links": [
            {
                "id": "eth0",
                "name": "eth0",
                "type": "phy",
                "ethernet_mac_address": "52:54:00:ab:cd:ef",
            }
        ],
        "networks": [
            {
                "id": "network0",
                "link": "eth0",
                "type": "ipv4",
                "ip_address": "10.244.1.5",
                "netmask": "255.255.255.0",
                "routes": [{"network": default, "netmask": default, "gateway": "10.244.1.1"}],
                "services": dns,
            }
        ],
        "services": dns,
    }
    assert (
        content.extra_files["vkubelet/network"]
        == seed(network=Net()).extra_files["vkubelet/network"]
    )
    assert configdrive().network_config is None


def test_cluster_dns_search_domains_reach_netplan_and_the_small_guest() -> None:
    search = ("shop.svc.cluster.local", "svc.cluster.local", "cluster.local")
    content = seed(network=Net(dns=("10.96.0.10",), search=search))
    assert content.network_config is not None
    eth0 = yaml.safe_load(content.network_config)["ethernets"]["eth0"]
    assert eth0["nameservers"] == {"addresses": ["10.96.0.10"], "search": list(search)}
    assert content.extra_files["vkubelet/network"].endswith(
        b"DNS=10.96.0.10\nSEARCH=shop.svc.cluster.local svc.cluster.local cluster.local\n"
    )
    with pytest.raises(CloudInitError, match=r"^network\.search: "):
        seed(network=Net(search=("a b; reboot",)))
