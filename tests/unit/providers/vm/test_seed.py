"""The seed ISO (NoCloud or ConfigDrive), read back with pycdlib the way a guest would see it."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pycdlib
import pytest

from vkubelet.providers.vm._cloudinit import build_seed_content
from vkubelet.providers.vm._seed import SeedError, write_seed_iso


@dataclass(frozen=True)
class Content:
    meta_data: str = "instance-id: uid-1\nlocal-hostname: web-0\n"
    user_data: str = "#cloud-config\n"
    network_config: str | None = "version: 2\n"
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    kind: str = "nocloud"


def _open(path: Path) -> pycdlib.PyCdlib:
    iso = pycdlib.PyCdlib()
    iso.open(str(path))
    return iso


def _read(iso: pycdlib.PyCdlib, **where: str) -> bytes:
    out = io.BytesIO()
    iso.get_file_from_iso_fp(out, **where)
    return out.getvalue()


def _mode(iso: pycdlib.PyCdlib, path: str) -> int:
    record = iso.get_record(rr_path=path)
    rock_ridge = getattr(record, "rock_ridge", None)
    assert rock_ridge is not None
    return int(rock_ridge.get_file_mode()) & 0o777


def test_seed_is_labelled_cidata_with_rock_ridge_and_joliet_names(tmp_path: Path) -> None:
    seed = tmp_path / "seed.iso"
    write_seed_iso(Content(), seed)
    iso = _open(seed)
    assert iso.pvd.volume_identifier.decode().strip() == "cidata"
    assert iso.has_rock_ridge() and iso.has_joliet()
    assert _read(iso, rr_path="/meta-data").startswith(b"instance-id: uid-1")
    assert _read(iso, joliet_path="/user-data") == b"#cloud-config\n"
    assert _read(iso, rr_path="/network-config") == b"version: 2\n"


def test_extra_files_land_in_nested_directories_with_their_modes(tmp_path: Path) -> None:
    seed = tmp_path / "seed.iso"
    files = {
        "vkubelet/hostname": b"web-0\n",
        "vkubelet/files/etc/app/config.yaml": b"a: 1\n",
        "vkubelet/files/run/secrets/token": b"s3cr3t",
    }
    write_seed_iso(
        Content(network_config=None, extra_files=files),
        seed,
        file_modes={"vkubelet/files/run/secrets/token": 0o600},
    )
    iso = _open(seed)
    for name, data in files.items():
        assert _read(iso, rr_path="/" + name) == data
        assert _read(iso, joliet_path="/" + name) == data
    assert _mode(iso, "/vkubelet/files/run/secrets/token") == 0o600
    assert _mode(iso, "/vkubelet/hostname") == 0o644
    names = {c.file_identifier().decode() for c in iso.list_children(rr_path="/")}
    assert "network-config" not in {n.lower() for n in names}


@pytest.mark.parametrize("bad", ["/etc/passwd", "vkubelet/../etc", "", "a/" + "x" * 65])
def test_paths_that_could_escape_or_not_fit_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SeedError):
        write_seed_iso(Content(extra_files={bad: b"x"}), tmp_path / "seed.iso")
    assert not (tmp_path / "seed.iso").exists()


@dataclass(frozen=True)
class Net:
    address: str = "10.244.1.5"
    prefix: int = 24
    gateway: str = "10.244.1.1"
    mac: str = "52:54:00:ab:cd:ef"
    dns: tuple[str, ...] = ("10.96.0.10",)
    search: tuple[str, ...] = ()


def test_a_configdrive_is_labelled_config_2_with_openstack_files_and_the_same_extras(
    tmp_path: Path,
) -> None:
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA alice@example"
    content = build_seed_content(
        "web-0",
        "uid-1",
        {"vm.vkubelet.io/cloud-init-type": "configdrive"},
        {"/run/secrets/token": b"s3cr3t"},
        Net(),
        [key],
        modes={"/run/secrets/token": 0o600},
    )
    seed = tmp_path / "seed.iso"
    write_seed_iso(content, seed, file_modes={"vkubelet/files/run/secrets/token": 0o600})
    iso = _open(seed)
    assert iso.pvd.volume_identifier.decode().strip() == "config-2"
    assert iso.has_rock_ridge() and iso.has_joliet()
    meta = json.loads(_read(iso, rr_path="/openstack/latest/meta_data.json"))
    assert meta == {
        "uuid": "uid-1",
        "hostname": "web-0",
        "name": "web-0",
        "public_keys": {"key0": key},
    }
    network = json.loads(_read(iso, joliet_path="/openstack/latest/network_data.json"))
    assert network["links"][0]["ethernet_mac_address"] == "52:54:00:ab:cd:ef"
    assert network["networks"][0]["ip_address"] == "10.244.1.5"
    assert network["networks"][0]["routes"][0]["gateway"] == "10.244.1.1"
    assert network["services"] == [{"type": "dns", "address": "10.96.0.10"}]
    assert _read(iso, rr_path="/openstack/latest/user_data").startswith(b"#cloud-config\n")
    assert _read(iso, rr_path="/vkubelet/hostname") == b"web-0\n"
    assert _read(iso, rr_path="/vkubelet/files/run/secrets/token") == b"s3cr3t"
    assert _mode(iso, "/vkubelet/files/run/secrets/token") == 0o600
    root = {c.file_identifier().decode().lower() for c in iso.list_children(rr_path="/")}
    assert not {"meta-data", "user-data", "network-config"} & root


def test_an_unknown_seed_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SeedError, match="seed kind 'iso'"):
        write_seed_iso(Content(kind="iso"), tmp_path / "seed.iso")
    assert not (tmp_path / "seed.iso").exists()


def test_the_runtime_writes_the_kind_the_pod_s_annotation_asks_for(tmp_path: Path) -> None:
    from vkubelet.providers.vm._config import VMConfig
    from vkubelet.providers.vm._runtime import QemuRuntime

    runtime = QemuRuntime(VMConfig(state_dir=tmp_path, image_store=tmp_path / "images"))
    seed = tmp_path / "seed.iso"

    def write(annotations: dict[str, str]) -> pycdlib.PyCdlib:
        runtime.write_seed(
            seed,
            pod_name="web-0",
            pod_namespace="default",
            pod_uid="uid-1",
            annotations=annotations,
            files={"/run/secrets/token": b"s3cr3t"},
            network_key=None,
            secret_files={"/run/secrets/token"},
        )
        return _open(seed)

    iso = write({"VirtletCloudInitImageType": "configdrive"})
    assert iso.pvd.volume_identifier.decode().strip() == "config-2"
    assert json.loads(_read(iso, rr_path="/openstack/latest/meta_data.json"))["uuid"] == "uid-1"
    assert _mode(iso, "/vkubelet/files/run/secrets/token") == 0o600
    iso.close()
    iso = write({})
    assert iso.pvd.volume_identifier.decode().strip() == "cidata"
    iso.close()
    # A ValueError naming the annotation: the provider's CreateContainerConfigError.
    with pytest.raises(ValueError, match=r"^annotation vm\.vkubelet\.io/cloud-init-type: "):
        write({"vm.vkubelet.io/cloud-init-type": "cdrom"})


def test_the_runtime_gives_a_guest_the_cluster_dns_with_its_namespace_s_search_list(
    tmp_path: Path,
) -> None:
    from vkubelet.providers.vm._config import VMConfig
    from vkubelet.providers.vm._net import GuestNetwork
    from vkubelet.providers.vm._runtime import QemuRuntime

    config = VMConfig(
        state_dir=tmp_path, image_store=tmp_path / "images", cluster_dns=("10.96.0.10",)
    )
    runtime = QemuRuntime(config)
    runtime._networks["uid-1"] = GuestNetwork("10.224.1.2", 24, "10.224.1.1", "52:54:00:aa:bb:cc")
    seed = tmp_path / "seed.iso"
    runtime.write_seed(
        seed,
        pod_name="web-0",
        pod_namespace="shop",
        pod_uid="uid-1",
        annotations={},
        files={},
        network_key="uid-1",
    )
    iso = _open(seed)
    lines = _read(iso, rr_path="/vkubelet/network").decode().splitlines()
    assert lines[-2:] == [
        "DNS=10.96.0.10",
        "SEARCH=shop.svc.cluster.local svc.cluster.local cluster.local",
    ]
    iso.close()
