"""Live resize's runtime side: how a running machine gets one more vCPU, one more DIMM or a
bigger root disk.

`_resize` decides what to do (from the pod, the headroom and what was plugged before) and
onlines what was plugged through the guest agent; it reaches the runtime only through
`Hotplug`, which each machine carries (`MachineHandle.hotplug`): QMP's here (`QmpHotplug`, the
QEMU runtime) and libvirt's in `_lvhotplug` (the libvirt runtime). A machine without one (the
provider's test fake) cannot be resized live, and the refusal names its runtime.

Each plug returns its record, which `Launch.hotplug` keeps (`{"cpus": [...], "dimms": [...]}`):
an `id` for every vCPU and an `id` and `mib` for every DIMM, so the running size is known
whatever the runtime; the QEMU runtime adds the CPU's driver and slot, with which a new QEMU
recreates the devices (`qemu_args`: a resume loads state into a machine that must have them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ._qmp import Monitor

__all__ = ["Hotplug", "HotplugRecords", "QmpHotplug", "ResizeError", "qemu_args"]

_MIB = 2**20
ROOT_DEVICE = "disk0"  # the QEMU runtime's id of the root disk's drive (`_machine`)

#: What live resize plugged into a machine: `{"cpus": [{"id", ...}], "dimms": [{"id", "mib"}]}`.
HotplugRecords = Mapping[str, Sequence[Mapping[str, Any]]]


class ResizeError(RuntimeError):
    """A live resize step that the runtime refused or could not do; the message says why."""


class Hotplug(Protocol):
    """The runtime's half of a live resize, one device at a time (so that what was plugged
    before a failure is recorded). Raises ResizeError, or the monitor's or daemon's errors
    that `_resize` reports as a failed resize; the machine runs on either way."""

    async def plug_vcpu(self, name: str, total: int) -> dict[str, Any]:
        """One more vCPU, named `name` (the machine then has `total`); not yet online in the
        guest. Returns its record."""
        ...

    async def plug_memory(self, name: str, mib: int) -> dict[str, Any]:
        """A DIMM of `mib` MiB named `name`; its memory blocks not yet online. Its record."""
        ...

    async def root_disk_size(self) -> int:
        """The root disk's virtual size in bytes, as the guest sees it."""
        ...

    async def grow_root_disk(self, size: int) -> None:
        """The root disk grown to `size` bytes (a multiple of 512), live."""
        ...


class QmpHotplug:
    """QEMU's monitor: `device_add` of the CPU type and slot `query-hotpluggable-cpus` lists;
    `object-add memory-backend-ram` + `device_add pc-dimm`; `query-block`, `block_resize`."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    async def plug_vcpu(self, name: str, total: int) -> dict[str, Any]:
        slots = await self.monitor.execute("query-hotpluggable-cpus")
        free = sorted(
            (s for s in slots if not s.get("qom-path")),
            key=lambda s: tuple(sorted(s["props"].items())),
        )
        if not free:
            raise ResizeError(f"QEMU has no free CPU slot for vCPU {total}")
        slot = free[0]
        props = {k: int(v) for k, v in slot["props"].items() if k.endswith("-id")}
        await self.monitor.execute("device_add", {"driver": slot["type"], "id": name, **props})
        return {"driver": slot["type"], "id": name, "props": props}

    async def plug_memory(self, name: str, mib: int) -> dict[str, Any]:
        await self.monitor.execute(
            "object-add",
            {"qom-type": "memory-backend-ram", "id": f"mem-{name}", "size": mib * _MIB},
        )
        await self.monitor.execute(
            "device_add", {"driver": "pc-dimm", "id": name, "memdev": f"mem-{name}"}
        )
        return {"id": name, "mib": mib}

    async def root_disk_size(self) -> int:
        for device in await self.monitor.execute("query-block"):
            if device.get("device") == ROOT_DEVICE:
                return int(device["inserted"]["image"]["virtual-size"])
        raise ResizeError("the root disk is not attached")

    async def grow_root_disk(self, size: int) -> None:
        await self.monitor.execute("block_resize", {"device": ROOT_DEVICE, "size": size})


def qemu_args(hotplug: HotplugRecords) -> tuple[str, ...]:
    """QEMU options that recreate the devices live resize plugged (for a resume: the incoming
    machine must have the same devices as the one whose state it loads)."""
    args: list[str] = []
    for cpu in hotplug.get("cpus", []):
        props = ",".join(f"{k}={int(v)}" for k, v in sorted(cpu["props"].items()))
        args += ["-device", f"{cpu['driver']},id={cpu['id']},{props}"]
    for dimm in hotplug.get("dimms", []):
        args += ["-object", f"memory-backend-ram,id=mem-{dimm['id']},size={int(dimm['mib'])}M"]
        args += ["-device", f"pc-dimm,id={dimm['id']},memdev=mem-{dimm['id']}"]
    return tuple(args)
