"""Live resize through libvirt's own APIs (`Hotplug` for the libvirt runtime's domains).

- **vCPUs**: `virDomainSetVcpusFlags(total, LIVE | CONFIG)`. The domain starts with
  `<vcpu current=N>max</vcpu>` (`_domainxml`); libvirt plugs the CPU into the running QEMU
  (LIVE) and writes the count into the definition (CONFIG), so a managed save, a migration's
  persistent copy and `virsh vcpucount` all say the same.
- **Memory**: one DIMM per step, `virDomainAttachDeviceFlags(<memory model='dimm'>, LIVE |
  CONFIG)` into NUMA cell 0. libvirt wants `<maxMemory slots=...>` and the boot memory in a NUMA
  cell for that (the domain has both when it has room). Why DIMMs and not virtio-mem: they are
  what the QEMU runtime plugs, so the room (`maxMemory`, slots), the 128 MiB steps and the
  records are the same on both runtimes, and the test guest's kernel onlines them as it is;
  virtio-mem would need its driver in the guest (the test guest's initramfs has no
  virtio_mem) and a guest that did not load it would never see the memory.
- **Root disk**: `virDomainBlockResize` of the first disk (the root, `_domainxml` attaches it
  first), its size read with `virDomainGetBlockInfo`.

What libvirt refuses (more vCPUs than the domain's maximum, a DIMM past `maxMemory` or the
slots) is a ResizeError with libvirt's words; the domain runs on as it was. Onlining in the
guest is `_resize`'s, through the guest agent, as for QEMU.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._domainxml import dimm
from ._hotplug import ResizeError
from ._machine import MachineError

__all__ = ["Domains", "LibvirtHotplug", "root_target"]

T = TypeVar("T")


class Domains(Protocol):
    """What this needs of the runtime's connection (`_libvirt.Connection`)."""

    @property
    def uri(self) -> str: ...

    async def run(self, call: Callable[..., T], *args: Any) -> T: ...

    async def domain(self, uuid: str) -> Any: ...


def root_target(xml: str) -> str:
    """The root disk's target (`vda`, `sda`) in a domain's XML: its first disk. ValueError
    when it has none."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    for disk in root.iterfind("./devices/disk[@device='disk']"):
        target = disk.find("target")
        if target is not None and target.get("dev"):
            return str(target.get("dev"))
    raise ValueError("the domain has no disk")


class LibvirtHotplug:
    """`Hotplug` on the domain `uuid` of `connection`'s daemon."""

    def __init__(self, connection: Domains, uuid: str) -> None:
        self.connection, self.uuid = connection, uuid

    async def _call(self, method: str, *args: Any) -> Any:
        """`domain.<method>(*args)` in the connection's threads; ResizeError with libvirt's
        message (and the URI) when the domain is gone or libvirt refuses."""
        import libvirt

        try:
            domain = await self.connection.domain(self.uuid)
        except MachineError as e:
            raise ResizeError(str(e)) from None
        if domain is None:
            raise ResizeError(f"libvirt {self.connection.uri}: domain {self.uuid} is gone")
        try:
            return await self.connection.run(getattr(domain, method), *args)
        except libvirt.libvirtError as e:
            message = e.get_error_message() or str(e)
            raise ResizeError(f"libvirt {self.connection.uri}: {message}") from None

    @staticmethod
    def _flags() -> int:
        import libvirt

        return int(libvirt.VIR_DOMAIN_AFFECT_LIVE | libvirt.VIR_DOMAIN_AFFECT_CONFIG)

    async def plug_vcpu(self, name: str, total: int) -> dict[str, Any]:
        await self._call("setVcpusFlags", total, self._flags())
        return {"id": name}

    async def plug_memory(self, name: str, mib: int) -> dict[str, Any]:
        xml = ET.tostring(dimm(mib), encoding="unicode")
        await self._call("attachDeviceFlags", xml, self._flags())
        return {"id": name, "mib": mib}

    async def _root(self) -> str:
        try:
            return root_target(await self._call("XMLDesc", 0))
        except ValueError as e:
            raise ResizeError(str(e)) from None

    async def root_disk_size(self) -> int:
        capacity, _allocation, _physical = await self._call("blockInfo", await self._root(), 0)
        return int(capacity)

    async def grow_root_disk(self, size: int) -> None:
        import libvirt

        flags = libvirt.VIR_DOMAIN_BLOCK_RESIZE_BYTES
        await self._call("blockResize", await self._root(), size, flags)
