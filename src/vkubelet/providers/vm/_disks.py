"""Disk files for VM pods, made with `qemu-img` (argv lists only, never a shell).

- the root disk: a qcow2 overlay per pod backed by the stored image, so the image stays shared and
  untouched and a pod's writes die with the pod; optionally grown to the size the pod asks for;
- emptyDir volumes: blank disks of the volume's `sizeLimit`.

Sizes are Kubernetes quantities ("10Gi", "500M") parsed with the SDK's exact parser, rounded up to
whole 512-byte sectors because qcow2 refuses anything else. A size below the image's virtual size
is refused with both figures: shrinking would cut the guest's filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ...sdk.quantity import Quantity, QuantityError, divide_ceil, parse_quantity

__all__ = [
    "DiskError",
    "ImageInfo",
    "StoredImage",
    "create_blank",
    "create_overlay",
    "image_info",
    "parse_size",
    "rebase_unsafe",
    "resize",
]

QEMU_IMG: Final = "qemu-img"
_SECTOR: Final = 512
_TIMEOUT: Final = 120.0
_ONE: Final = Quantity(1, 0)


@dataclass(frozen=True)
class StoredImage:
    path: Path  # <root>/data/<sha256>: stable while the data file lives (overlays point here)
    sha256: str
    format: Literal["qcow2", "raw"]
    virtual_size: int


class DiskError(Exception):
    """A disk could not be made or changed; the message says why (sizes, qemu-img's words)."""


@dataclass(frozen=True)
class ImageInfo:
    format: str
    virtual_size: int
    backing_file: str | None


def parse_size(value: str | int, *, field: str = "size") -> int:
    """Bytes from a quantity, rounded up to whole sectors; `field` names the source in errors."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        try:
            quantity = parse_quantity(value)
        except QuantityError as exc:
            raise DiskError(f"{field}: {exc}") from None
        if quantity.sign <= 0:
            raise DiskError(f"{field}: must be positive, got {value!r}")
        size = divide_ceil(quantity, _ONE)
    if size <= 0:
        raise DiskError(f"{field}: must be positive, got {value!r}")
    return -(-size // _SECTOR) * _SECTOR


async def _qemu_img(args: Sequence[str], *, limit: float = _TIMEOUT) -> str:
    """Run qemu-img; what it creates (disks, restores, backup files) is owner-only (umask 077):
    a tenant's disk is never readable by the host's other users."""
    process = await asyncio.create_subprocess_exec(
        QEMU_IMG,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        umask=0o077,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), limit)
    except TimeoutError:
        await _kill(process)
        raise DiskError(f"qemu-img {args[0]} timed out after {limit:g}s") from None
    except asyncio.CancelledError:
        # The pod was deleted while its disk was made (a restore can take an hour): the
        # process must not go on writing into the machine's folder.
        await asyncio.shield(_kill(process))
        raise
    if process.returncode != 0:
        words = stderr.decode(errors="replace").strip() or f"exit code {process.returncode}"
        raise DiskError(f"qemu-img {args[0]} failed: {words}")
    return stdout.decode(errors="replace")


async def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()


async def image_info(path: Path) -> ImageInfo:
    """Format and virtual size as qemu-img sees them (`--force-share`: the image may be open)."""
    out = await _qemu_img(["info", "--force-share", "--output=json", str(path)])
    try:
        info = json.loads(out)
        return ImageInfo(
            format=str(info["format"]),
            virtual_size=int(info["virtual-size"]),
            backing_file=info.get("backing-filename"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DiskError(f"qemu-img info gave unexpected output for {path.name}: {exc}") from None


async def _create_new(path: Path, options: Sequence[str], size: int | None) -> None:
    """qemu-img create into a temporary name, then link it in place: never clobbers an existing
    disk (a pod's data) and never leaves a half-made one under the final name."""
    if path.exists():  # noqa: ASYNC240 (a stat: instant)
        raise DiskError(f"{path} already exists")
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        tail = [str(size)] if size is not None else []
        await _qemu_img(["create", "-q", *options, str(temporary), *tail])
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise DiskError(f"{path} already exists") from None
    finally:
        temporary.unlink(missing_ok=True)


async def create_overlay(
    base: StoredImage, overlay: Path, *, size: int | str | None = None
) -> None:
    """A qcow2 overlay backed by `base` (its absolute path, format given with -F so qemu never
    probes it); at least the image's virtual size, larger when `size` asks."""
    wanted = None
    if size is not None:
        wanted = parse_size(size, field="root disk size")
        if wanted < base.virtual_size:
            raise DiskError(
                f"root disk size {size} ({wanted} bytes) is smaller than the image's virtual "
                f"size ({base.virtual_size} bytes); a root disk cannot shrink below its image"
            )
    options = ["-f", "qcow2", "-b", str(base.path.resolve()), "-F", base.format]
    await _create_new(overlay, options, wanted)


async def resize(path: Path, size: int | str, *, format: str = "qcow2") -> None:
    """Grow a disk that is not in use (a running VM is grown over QMP instead). Never shrinks."""
    wanted = parse_size(size, field="disk size")
    current = (await image_info(path)).virtual_size
    if wanted < current:
        raise DiskError(
            f"disk size {size} ({wanted} bytes) is smaller than the disk's current size "
            f"({current} bytes); disks are never shrunk"
        )
    if wanted != current:
        await _qemu_img(["resize", "-q", "-f", format, str(path), str(wanted)])


async def rebase_unsafe(path: Path, backing: str, *, backing_format: str = "qcow2") -> None:
    """Name `backing` as the backing file of the qcow2 at `path` without touching its data
    (`qemu-img rebase -u`): for a copy that holds only what changed since that file."""
    await _qemu_img(["rebase", "-u", "-f", "qcow2", "-b", backing, "-F", backing_format, str(path)])


async def create_blank(path: Path, size: int | str, *, format: str = "qcow2") -> None:
    """An empty disk for an emptyDir volume (the guest formats it)."""
    if format not in ("qcow2", "raw"):
        raise DiskError(f"unsupported disk format {format!r}")
    wanted = parse_size(size, field="emptyDir size")
    await _create_new(path, ["-f", format], wanted)
