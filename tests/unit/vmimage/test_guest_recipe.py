"""The small test guest's recipe and the disk layout both guests share (no apt, no QEMU)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from vkubelet.vmimage import _build

PACKAGES = {"linux-image-6.1.0-56-cloud-amd64": "6.1.192-2", "busybox-static": "1:1.35.0-4"}


def test_the_mbr_holds_syslinux_boot_code_and_an_active_boot_partition() -> None:
    if not _build.SYSLINUX_MBR.is_file():
        pytest.skip("syslinux-common not installed")
    mbr = _build.mbr([(True, 0x0C, 2048, 98304), (False, 0x83, 100352, 4194304)])
    assert len(mbr) == 512
    assert mbr[:440] == _build.SYSLINUX_MBR.read_bytes()[:440]
    assert mbr[510:] == b"\x55\xaa"
    first = struct.unpack("<B3sB3sII", mbr[446:462])
    second = struct.unpack("<B3sB3sII", mbr[462:478])
    assert (first[0], first[2], first[4], first[5]) == (0x80, 0x0C, 2048, 98304)
    assert (second[0], second[2], second[4], second[5]) == (0, 0x83, 100352, 4194304)
    assert mbr[478:510] == b"\0" * 32


def test_the_small_guest_s_partitions_end_before_a_grown_disk_s_free_space() -> None:
    """Tests mark a root disk grown to 1 GiB at 900 MiB: past the partitions, nothing to break."""
    layout = _build.LAYOUT
    end_mib = layout.root_start * _build.SECTOR // 2**20 + layout.root_mib
    assert end_mib < 900


def test_the_cache_key_changes_with_the_root_file_system_s_recipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An image built by an older recipe (say, the one that ran from its initramfs) is never
    reused: the recipe's version, the layout and the init scripts are in the hash."""
    same = _build.recipe_hash(PACKAGES)
    assert _build.recipe_hash(PACKAGES) == same
    original = _build._data
    for script in ("guest-initramfs.sh", "guest-init.sh", "guest-shutdown.sh"):

        def edited(name: str, script: str = script) -> str:
            return original(name) + ("# edited\n" if name == script else "")

        monkeypatch.setattr(_build, "_data", edited)
        assert _build.recipe_hash(PACKAGES) != same, script
    monkeypatch.undo()
    bigger = dataclasses.replace(_build.LAYOUT, root_mib=2 * _build.LAYOUT.root_mib)
    monkeypatch.setattr(_build, "LAYOUT", bigger)
    assert _build.recipe_hash(PACKAGES) != same
    monkeypatch.undo()
    monkeypatch.setattr(_build, "RECIPE_VERSION", 1)
    assert _build.recipe_hash(PACKAGES) != same
