"""Persistent machines: the disks of a VirtualMachine outlive its pods.

A pod annotated `vm.vkubelet.io/machine: <id>` (the VirtualMachine's uid, set by the VM
controller) is one incarnation of a persistent machine. Its root overlay and emptyDir disks live
in `<stateDir>/machines/<id>/`, not in the pod's run directory, and are not deleted when the pod
ends: the next pod of the same machine boots from the same disks (a file written before a power
off is there after the power on). Other features keep their per-machine state there too
(`machine_dir`): hibernation images, backup bitmaps.

A machine belongs to a tenant. `machine.json` records its owner when a pod first claims it: the
pod's namespace and, for a VirtualMachine's pod (the controller makes it with a controller
reference to the VirtualMachine whose uid is the machine id), that VirtualMachine's uid. A later
pod of another namespace, or one that is not that VirtualMachine's, is refused
(`MachineRefused`): it never sees the machine's disks or hibernated memory, and nothing in the
directory changes. A directory an older version made has no owner: the first pod that claims it
after the upgrade becomes its owner (the agent's restart adopts its running VMs first, so those
machines are claimed by their own pods; a powered-off one by its next power-on). Machine
directories and what they hold are private to the agent (0700, 0600), tightened when claimed.

`machine.json` also records the image the root overlay is backed by, so that the
image GC keeps it while the machine is powered off. Machine directories are removed only when no
VirtualMachine with that uid exists any more (`gc_machines`): the provider lists the
VirtualMachines with the credentials of `machineGC.kubeconfig`, or, when the setting names none,
the ones the process finds as kubectl would (`$KUBECONFIG`, a pod's service account: what the
Helm chart's agent gives it, since its pod's kubelet keeps that token fresh); without
`machineGC`, or while the CRD is not installed or cannot be listed, nothing is ever removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from lightkube.resources.core_v1 import Pod

from ..._files import make_private, private_dir, write_atomic
from ...kube import ApiError, KubeClient

__all__ = [
    "MACHINE_ANNOTATION",
    "MachineGC",
    "MachineRefused",
    "claim_machine",
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
_GROUP: Final = "vkubelet.io/"
# A uid, or any name that is one safe path component (the annotation is user input).
_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MachineGC:
    kubeconfig: Path | None  # None: $KUBECONFIG, else the pod's service account
    interval: float = 300.0


class MachineRefused(ValueError):
    """The pod may not use the machine it names: another tenant's (reason MachineRefused), or
    an id that is not one safe path component (CreateContainerConfigError: the pod's error)."""

    def __init__(self, message: str, reason: str = "MachineRefused") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Owner:
    """Who a machine belongs to: a namespace, and the VirtualMachine when the controller made it."""

    namespace: str
    virtual_machine: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"namespace": self.namespace, "virtualMachine": self.virtual_machine}

    @classmethod
    def from_json(cls, data: object) -> Owner | None:
        if not isinstance(data, dict) or not isinstance(data.get("namespace"), str):
            return None
        vm = data.get("virtualMachine")
        return cls(data["namespace"], str(vm) if vm else None)


def _controller_vm(pod: Pod) -> str | None:
    """The uid of the VirtualMachine that controls the pod (its controller reference)."""
    refs = (pod.metadata.ownerReferences if pod.metadata is not None else None) or []
    for ref in refs:
        if ref.controller and ref.kind == "VirtualMachine" and ref.apiVersion.startswith(_GROUP):
            return str(ref.uid)
    return None


def claimant(pod: Pod, ident: str) -> Owner:
    """The owner a pod claims to be for machine `ident`: its namespace, and its VirtualMachine
    when that VirtualMachine's uid is the machine id (what the controller makes)."""
    meta = pod.metadata
    namespace = str(meta.namespace) if meta is not None and meta.namespace else "default"
    vm = _controller_vm(pod)
    return Owner(namespace, vm if vm == ident else None)


def refusal(ident: str, owner: Owner | None, pod: Pod) -> str | None:
    """Why the pod may not use machine `ident` owned by `owner` (None: it may; an unowned
    machine is anyone's first claim)."""
    if owner is None:
        return None
    wants = claimant(pod, ident)
    field = f"metadata.annotations[{MACHINE_ANNOTATION}]"
    if wants.namespace != owner.namespace:
        return (
            f"{field}: machine {ident} belongs to another namespace; a pod uses only the "
            f"machines of its own namespace ({wants.namespace})"
        )
    if owner.virtual_machine is not None and wants.virtual_machine != owner.virtual_machine:
        return (
            f"{field}: machine {ident} is VirtualMachine {owner.virtual_machine}'s; only that "
            "VirtualMachine's pods (controller reference) use it"
        )
    return None


def machine_id(pod: Pod) -> str | None:
    """The machine a pod is an incarnation of, None for a plain pod. An id that is not a safe
    path component is refused (ValueError): it would name a directory elsewhere."""
    meta = pod.metadata
    value = (meta.annotations or {}).get(MACHINE_ANNOTATION) if meta is not None else None
    if value is None:
        return None
    value = str(value)
    if not _ID.match(value) or value in (".", ".."):
        raise MachineRefused(
            f"metadata.annotations[{MACHINE_ANNOTATION}]: {value!r} is not a machine id "
            "(letters, digits, '.', '_', '-'; at most 128)",
            "CreateContainerConfigError",
        )
    return value


def machine_dir(state_dir: Path, pod: Pod) -> Path | None:
    """`<stateDir>/machines/<id>/` for a pod of a persistent machine, None for a plain pod.
    Raises MachineRefused when the pod may not use it (an unsafe id, another owner's machine):
    every way to a machine's files goes through here."""
    ident = machine_id(pod)
    if ident is None:
        return None
    directory = state_dir / MACHINES / ident
    if (why := refusal(ident, Owner.from_json(_record(directory).get("owner")), pod)) is not None:
        raise MachineRefused(why)
    return directory


def claim_machine(state_dir: Path, pod: Pod) -> Path | None:
    """The pod's machine directory, made (0700) or tightened, with its owner recorded when it
    has none yet; MachineRefused as `machine_dir`."""
    directory = machine_dir(state_dir, pod)
    if directory is None:
        return None
    private_dir(state_dir / MACHINES)
    if directory.is_dir():
        make_private(directory)  # what an older version left readable
    private_dir(directory)
    data = _record(directory)
    if Owner.from_json(data.get("owner")) is None:
        data["owner"] = claimant(pod, directory.name).to_json()
        write_atomic(directory / "machine.json", json.dumps(data), mode=0o600)
    return directory


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
    write_atomic(directory / "machine.json", json.dumps(data), mode=0o600)


def record_address(directory: Path, address: str) -> None:
    """Remember the machine's address: this node never gives it to another VM while the
    machine is powered off (its next pod asks for it again). `directory` is claimed."""
    data = _record(directory)
    if data.get("address") != address:
        write_atomic(
            directory / "machine.json", json.dumps({**data, "address": address}), mode=0o600
        )


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


async def existing_machines(kubeconfig: Path | None) -> set[str] | None:
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


async def gc_machines(
    state_dir: Path,
    kubeconfig: Path | None,
    in_use: Collection[str],
    discard: Callable[[Path], Awaitable[None]] | None = None,
) -> list[str]:
    """Remove the machine directories whose VirtualMachine is gone (and that no pod on this
    node uses); the ids removed. `discard` first drops what the runtime keeps for a machine
    elsewhere (a hibernated libvirt domain); when it fails the directory stays, for the next
    round (it is what names that state)."""
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
            if discard is not None:
                try:
                    await discard(path)
                except Exception as e:
                    log.warning("machine gc: %s kept: its runtime state stays: %s", path.name, e)
                    continue
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
