"""The NoCloud seed ISO, read back with pycdlib the way a guest would see it."""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pycdlib
import pytest

from vkubelet.providers.vm._seed import SeedError, write_seed_iso


@dataclass(frozen=True)
class Content:
    meta_data: str = "instance-id: uid-1\nlocal-hostname: web-0\n"
    user_data: str = "#cloud-config\n"
    network_config: str | None = "version: 2\n"
    extra_files: Mapping[str, bytes] = field(default_factory=dict)


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
