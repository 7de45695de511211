"""Root overlays, resizes and blank disks with the real qemu-img."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from vkubelet.providers.vm import _disks
from vkubelet.providers.vm._disks import (
    DiskError,
    create_blank,
    create_overlay,
    image_info,
    parse_size,
    resize,
)
from vkubelet.providers.vm._store import StoredImage
from vkubelet.testing.harness import eventually

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")
MiB = 1 << 20


async def qemu_img(*args: str | Path) -> str:
    process = await asyncio.create_subprocess_exec(
        "qemu-img", *map(str, args), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    assert process.returncode == 0
    return out.decode()


@pytest.fixture
async def base(tmp_path: Path) -> StoredImage:
    path = tmp_path / "data" / ("ab" * 32)
    path.parent.mkdir()
    await qemu_img("create", "-q", "-f", "qcow2", path, "64M")
    return StoredImage(path=path, sha256="ab" * 32, format="qcow2", virtual_size=64 * MiB)


async def test_an_overlay_is_backed_by_the_stored_image_with_its_format(
    base: StoredImage, tmp_path: Path
) -> None:
    overlay = tmp_path / "pod" / "root.qcow2"
    overlay.parent.mkdir()
    await create_overlay(base, overlay)
    info = json.loads(await qemu_img("info", "--output=json", overlay))
    assert info["format"] == "qcow2"
    assert info["backing-filename"] == str(base.path)
    assert info["backing-filename-format"] == "qcow2"
    assert info["virtual-size"] == 64 * MiB
    assert [p.name for p in overlay.parent.iterdir()] == ["root.qcow2"]


async def test_an_overlay_can_be_larger_than_its_image(base: StoredImage, tmp_path: Path) -> None:
    await create_overlay(base, tmp_path / "root.qcow2", size="1Gi")
    assert (await image_info(tmp_path / "root.qcow2")).virtual_size == 1 << 30


async def test_an_overlay_smaller_than_its_image_is_refused_with_both_sizes(
    base: StoredImage, tmp_path: Path
) -> None:
    with pytest.raises(DiskError, match=r"root disk size 10Mi \(10485760 bytes\).*67108864"):
        await create_overlay(base, tmp_path / "root.qcow2", size="10Mi")
    assert not (tmp_path / "root.qcow2").exists()


async def test_an_existing_disk_is_never_overwritten(base: StoredImage, tmp_path: Path) -> None:
    disk = tmp_path / "root.qcow2"
    disk.write_bytes(b"pod data")
    with pytest.raises(DiskError, match="already exists"):
        await create_overlay(base, disk)
    with pytest.raises(DiskError, match="already exists"):
        await create_blank(disk, "1Mi")
    assert disk.read_bytes() == b"pod data"


async def test_a_raw_image_gets_a_qcow2_overlay(tmp_path: Path) -> None:
    raw = tmp_path / "img.raw"
    raw.write_bytes(bytes(MiB))
    image = StoredImage(path=raw, sha256="cd" * 32, format="raw", virtual_size=MiB)
    await create_overlay(image, tmp_path / "root.qcow2", size=2 * MiB)
    info = json.loads(await qemu_img("info", "--output=json", tmp_path / "root.qcow2"))
    assert (info["backing-filename-format"], info["virtual-size"]) == ("raw", 2 * MiB)


async def test_resize_grows_and_never_shrinks(base: StoredImage, tmp_path: Path) -> None:
    disk = tmp_path / "root.qcow2"
    await create_overlay(base, disk)
    await resize(disk, "128Mi")
    assert (await image_info(disk)).virtual_size == 128 * MiB
    with pytest.raises(DiskError, match="never shrunk"):
        await resize(disk, "64Mi")
    assert (await image_info(disk)).virtual_size == 128 * MiB


@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
async def test_a_blank_disk_has_the_size_asked(tmp_path: Path, fmt: str) -> None:
    disk = tmp_path / f"scratch.{fmt}"
    await create_blank(disk, "100M", format=fmt)
    info = await image_info(disk)
    assert (info.format, info.virtual_size, info.backing_file) == (fmt, 100_000_256, None)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("1Gi", 1 << 30),
        ("1G", 1_000_000_000),
        ("512", 512),
        ("1", 512),
        ("1.5Ki", 1536),
        (1000, 1024),
    ],
)
def test_sizes_are_quantities_rounded_up_to_sectors(value: str | int, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("value", ["", "ten", "-1Gi", "0", "1Gb"])
def test_a_bad_size_names_the_field(value: str) -> None:
    with pytest.raises(DiskError, match=r"^root size: "):
        parse_size(value, field="root size")


async def test_qemu_img_errors_are_reported(tmp_path: Path) -> None:
    with pytest.raises(DiskError, match="qemu-img info failed"):
        await image_info(tmp_path / "missing.qcow2")


def _running(marker: bytes) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == marker:
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    return True
        except OSError:
            continue
    return False


async def test_a_cancelled_disk_step_leaves_no_qemu_img_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod deleted while its disk is restored: the copy must not go on writing."""
    monkeypatch.setattr(_disks, "QEMU_IMG", "sleep")
    marker = b"sleep\x0030.4127\x00"
    task = asyncio.create_task(_disks._qemu_img(["30.4127"]))
    await eventually(lambda: _running(marker), what="the process started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _running(marker)
