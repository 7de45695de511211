"""Persistent machines: the disks of a VirtualMachine outlive its pods.

A pod annotated `vm.vkubelet.io/machine: <id>` (the VirtualMachine's uid, set by the VM
controller) is one incarnation of a persistent machine. Its root overlay and emptyDir disks live
in `<stateDir>/machines/<id>/`, not in the pod's run directory, and are not deleted when the pod
ends: the next pod of the same machine boots from the same disks (a file written before a power
off is there after the power on). Other features keep their per-machine state there too
(`machine_dir`): hibernation images, backup bitmaps.

`machine.json` in that directory records the image the root overlay is backed by, so that the
image GC keeps it while the machine is powered off. Machine directories are removed only when no
VirtualMachine with that uid exists any more (`gc_machines`): the provider lists the
VirtualMachines with the credentials of `machineGC.kubeconfig`; without that setting, or while
the CRD is not installed, nothing is ever removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from lightkube.resources.core_v1 import Pod

from ..._files import write_atomic
from ...kube import ApiError, KubeClient

__all__ = [
    "MACHINE_ANNOTATION",
    "MachineGC",
    "gc_machines",
    "machine_addresses",
    "machine_dir",
    "machine_id",
    "machine_images",
    "record_address",
    "record_image",
]

MACHINE_ANNOTATION: Final = "vm.vkubelet.io/machine"
MACHINES: Final = "machines"
# A uid, or any name that is one safe path component (the annotation is user input).
_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MachineGC:
    kubeconfig: Path
    interval: float = 300.0


def machine_id(pod: Pod) -> str | None:
    """The machine a pod is an incarnation of, None for a plain pod. An id that is not a safe
    path component is refused (ValueError): it would name a directory elsewhere."""
    meta = pod.metadata
    value = (meta.annotations or {}).get(MACHINE_ANNOTATION) if meta is not None else None
    if value is None:
        return None
    value = str(value)
    if not _ID.match(value) or value in (".", ".."):
        raise ValueError(
            f"metadata.annotations[{MACHINE_ANNOTATION}]: {value!r} is not a machine id "
            "(letters, digits, '.', '_', '-'; at most 128)"
        )
    return value


def machine_dir(state_dir: Path, pod: Pod) -> Path | None:
    """`<stateDir>/machines/<id>/` for a pod of a persistent machine, None for a plain pod."""
    ident = machine_id(pod)
    return None if ident is None else state_dir / MACHINES / ident


def _record(directory: Path) -> dict[str, Any]:
    try:
        data = json.loads((directory / "machine.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_image(directory: Path, image_sha256: str | None) -> None:
    """Remember the image the machine's root overlay is backed by (for the image GC)."""
    data = _record(directory)
    images = set(data.get("images") or [])
    if image_sha256:
        images.add(image_sha256)
    data["images"] = sorted(images)
    write_atomic(directory / "machine.json", json.dumps(data))


def record_address(directory: Path, address: str) -> None:
    """Remember the machine's address: this node never gives it to another VM while the
    machine is powered off (its next pod asks for it again)."""
    data = _record(directory)
    if data.get("address") != address:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / "machine.json", json.dumps({**data, "address": address}))


def _records(state_dir: Path) -> list[dict[str, Any]]:
    return [_record(path.parent) for path in (state_dir / MACHINES).glob("*/machine.json")]


def machine_images(state_dir: Path) -> set[str]:
    """The images any machine's disks are backed by: never garbage-collected."""
    images: set[str] = set()
    for data in _records(state_dir):
        with contextlib.suppress(TypeError):
            images.update(str(i) for i in data.get("images") or [])
    return images


def machine_addresses(state_dir: Path) -> set[str]:
    """The addresses the machines of this node keep (`record_address`)."""
    return {str(data["address"]) for data in _records(state_dir) if data.get("address")}


async def existing_machines(kubeconfig: Path) -> set[str] | None:
    """The uids of all VirtualMachines, or None when that cannot be known (the CRD absent, the
    apiserver away, no permission): then nothing may be deleted."""
    client = KubeClient.from_kubeconfig(kubeconfig)
    try:
        listed = await client.get("/apis/vkubelet.io/v1alpha1/virtualmachines")
        items = listed.get("items") or []
        return {str(uid) for vm in items if (uid := (vm.get("metadata") or {}).get("uid"))}
    except Exception as e:
        why = e.message if isinstance(e, ApiError) else e
        log.debug("machine gc: cannot list VirtualMachines (%s); nothing removed", why)
        return None
    finally:
        await client.aclose()


async def gc_machines(state_dir: Path, kubeconfig: Path, in_use: Collection[str]) -> list[str]:
    """Remove the machine directories whose VirtualMachine is gone (and that no pod on this
    node uses); the ids removed."""
    root = state_dir / MACHINES
    if not root.is_dir():
        return []
    candidates = [p for p in root.iterdir() if p.is_dir() and p.name not in in_use]
    if not candidates:
        return []
    existing = await existing_machines(kubeconfig)
    if existing is None:
        return []
    removed = []
    for path in candidates:
        if path.name not in existing:
            await asyncio.to_thread(shutil.rmtree, path, True)
            removed.append(path.name)
    return removed


def machines_in_use(pods: Iterable[Pod]) -> set[str]:
    ids = set()
    for pod in pods:
        try:
            ident = machine_id(pod)
        except ValueError:
            continue
        if ident is not None:
            ids.add(ident)
    return ids


async def grow_root(root: Path, size: int) -> None:
    """A machine's root disk asked bigger while it was powered off: grown before it boots
    (never shrunk: a smaller size is ignored, the disk keeps its data)."""
    from ._disks import image_info, resize

    if (await image_info(root)).virtual_size < size:
        await resize(root, size)
