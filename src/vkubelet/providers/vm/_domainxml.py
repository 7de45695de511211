"""The libvirt domain of a VM, as XML, from the same `LaunchSpec` the QEMU runtime gets.

Pure: no daemon, no I/O, so every rule is unit-tested. What the domain holds, and why:

- Its name is the pod's, namespace-qualified (`<namespace>_<name>`): neither a namespace nor a
  pod name can hold `_`, so two pods never map to one name, and `virsh list` reads as the pod.
- Its `<metadata>` names the pod (UID, namespace, name) and the node that owns it: the
  runtime adopts a domain after an agent restart only when that UID is its pod's, and never
  touches a domain without it (one a site made by hand).
- `type='qemu'` (TCG) unless the accelerator probe chose KVM: libvirt advertises KVM whenever
  `/dev/kvm` exists, whether or not it can boot a guest.
- The disks in order (root first, its boot order 1), the seed read-only after them, then the
  PVC disks (serial = the claim's name), as the QEMU runtime attaches them; a serial console
  on a pty (libvirt's console stream reaches it over any URI); the guest agent's
  virtio-serial channel (libvirt connects to it, and answers `qemuAgentCommand`); a balloon;
  an ISA panic device (libvirt 9 refuses `pvpanic`), so a guest kernel panic ends the domain
  with reason `crashed`.
- A hibernated domain (libvirt's managed save) is restored by the machine's next pod, whose
  seed is another file and whose UID is another: `retarget` points the saved XML's disks at
  the new pod's files and its metadata at the new pod. The name stays (libvirt renames no
  domain with a managed save image).
- vCPUs and memory with the live-resize headroom: `<vcpu current=...>max`, and `maxMemory`
  with its slots, which libvirt wants beside one NUMA cell holding the boot memory. What live
  resize plugged before (`LaunchSpec.hotplug`: a relaunch of a resized machine) is started
  with: the vCPUs counted in `current`, each DIMM a `<memory model='dimm'>` device.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass

from ._backend import LaunchSpec

__all__ = [
    "METADATA_URI",
    "Owner",
    "dimm",
    "disk_files",
    "domain_name",
    "domain_xml",
    "owner_of",
    "rehome",
    "retarget",
]

#: The namespace of vkubelet's element in a domain's `<metadata>`.
METADATA_URI = "https://vkubelet.io/xmlns/vm-domain/1"
ET.register_namespace("vkubelet", METADATA_URI)


@dataclass(frozen=True)
class Owner:
    """Whose domain it is: the pod (its UID decides) and the node that made it."""

    pod_uid: str
    namespace: str
    name: str
    node: str

    def element(self) -> ET.Element:
        """vkubelet's `<metadata>` element (libvirt keeps it as given, under METADATA_URI)."""
        return ET.Element(
            "pod",
            {
                "uid": self.pod_uid,
                "namespace": self.namespace,
                "name": self.name,
                "node": self.node,
            },
        )


def domain_name(namespace: str, name: str) -> str:
    """The domain of pod `namespace/name`."""
    return f"{namespace}_{name}"


def owner_of(metadata: str | None) -> Owner | None:
    """The Owner in vkubelet's `<metadata>` element as libvirt returns it (None: not ours)."""
    values = metadata_values(metadata, "pod", ("uid", "namespace", "name", "node"))
    return Owner(*values) if values is not None else None


def metadata_values(metadata: str | None, tag: str, keys: Sequence[str]) -> list[str] | None:
    """The attributes `keys` of one of vkubelet's `<metadata>` elements (`tag`, in whatever
    namespace libvirt returns it), as libvirt returns it; None unless it is that element and
    has every one of them."""
    if not metadata:
        return None
    try:
        element = ET.fromstring(metadata)  # noqa: S314 - from the libvirt daemon we drive
    except ET.ParseError:
        return None
    if element.tag.rsplit("}", 1)[-1] != tag:
        return None
    values = [element.get(k) for k in keys]
    return [str(v) for v in values] if all(values) else None


def _disk_target(bus: str, index: int) -> str:
    """vda, vdb, ... for virtio; sda, ... for scsi (libvirt derives the unit from the name)."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return ("vd" if bus == "virtio" else "sd") + letters


def domain_xml(spec: LaunchSpec, owner: Owner, *, kvm: bool) -> str:
    """The domain's XML; ValueError for what the libvirt runtime does not do yet (named)."""
    if spec.incoming:
        raise ValueError("the libvirt runtime cannot receive a live migration yet")
    if spec.extra_args:
        raise ValueError("the libvirt runtime cannot pass QEMU options")
    name = domain_name(owner.namespace, owner.name)
    root = ET.Element("domain", {"type": "kvm" if kvm else "qemu"})
    ET.SubElement(root, "name").text = name
    ET.SubElement(root, "title").text = f"pod {owner.namespace}/{owner.name} (vkubelet)"
    metadata = ET.SubElement(root, "metadata")
    ours = owner.element()
    ours.tag = f"{{{METADATA_URI}}}pod"
    metadata.append(ours)

    max_vcpus = max(spec.vcpus, spec.max_vcpus or spec.vcpus)
    vcpus, dimms = _plugged(spec)
    vcpu = ET.SubElement(root, "vcpu", {"placement": "static"})
    vcpu.text = str(max_vcpus)
    if max_vcpus > vcpus:
        vcpu.set("current", str(vcpus))
    hotplug_memory = (
        spec.memory_slots > 0
        and spec.max_memory_mib is not None
        and spec.max_memory_mib > spec.memory_mib
    )
    if hotplug_memory:
        maximum = ET.SubElement(root, "maxMemory", {"slots": str(spec.memory_slots), "unit": "MiB"})
        maximum.text = str(spec.max_memory_mib)
    total = str(spec.memory_mib + sum(dimms))
    ET.SubElement(root, "memory", {"unit": "MiB"}).text = total
    ET.SubElement(root, "currentMemory", {"unit": "MiB"}).text = total

    os_ = ET.SubElement(root, "os")
    ET.SubElement(os_, "type", {"arch": "x86_64", "machine": "q35"}).text = "hvm"
    features = ET.SubElement(root, "features")
    ET.SubElement(features, "acpi")
    if hotplug_memory:  # libvirt wants the boot memory in a NUMA cell to plug DIMMs
        cpu = ET.SubElement(root, "cpu")
        numa = ET.SubElement(cpu, "numa")
        ET.SubElement(
            numa,
            "cell",
            {
                "id": "0",
                "cpus": f"0-{max_vcpus - 1}",
                "memory": str(spec.memory_mib),
                "unit": "MiB",
            },
        )
    ET.SubElement(root, "on_poweroff").text = "destroy"
    ET.SubElement(root, "on_reboot").text = "restart"
    ET.SubElement(root, "on_crash").text = "destroy"

    devices = ET.SubElement(root, "devices")
    used: dict[str, int] = {}
    for index, (path, bus) in enumerate(spec.disks):
        disk = _disk(devices, str(path), "qcow2", bus, used)
        if index == 0:
            ET.SubElement(disk, "boot", {"order": "1"})
    if spec.seed is not None:
        seed = _disk(devices, str(spec.seed), "raw", "virtio", used)
        ET.SubElement(seed, "readonly")
    for path, claim_serial in spec.claims:  # PVC disks, as QEMU's `-drive`s: after the seed
        claim = _disk(devices, str(path), "qcow2", "virtio", used)
        ET.SubElement(claim, "serial").text = claim_serial
    if any(bus == "scsi" for _, bus in spec.disks):
        ET.SubElement(devices, "controller", {"type": "scsi", "model": "virtio-scsi"})
    serial = ET.SubElement(devices, "serial", {"type": "pty"})
    ET.SubElement(serial, "target", {"port": "0"})
    console = ET.SubElement(devices, "console", {"type": "pty"})
    ET.SubElement(console, "target", {"type": "serial", "port": "0"})
    channel = ET.SubElement(devices, "channel", {"type": "unix"})
    ET.SubElement(channel, "target", {"type": "virtio", "name": "org.qemu.guest_agent.0"})
    ET.SubElement(devices, "memballoon", {"model": "virtio"})
    ET.SubElement(devices, "panic", {"model": "isa"})
    devices.extend(dimm(mib) for mib in dimms)
    return ET.tostring(root, encoding="unicode")


def _plugged(spec: LaunchSpec) -> tuple[int, list[int]]:
    """The vCPUs to start with and the DIMMs (MiB) to define: the spec's size plus what live
    resize plugged into the machine before (a relaunch keeps the size it had, as QEMU's does)."""
    vcpus = spec.vcpus + len(spec.hotplug.get("cpus", ()))
    return min(vcpus, max(spec.vcpus, spec.max_vcpus or spec.vcpus)), [
        int(d["mib"]) for d in spec.hotplug.get("dimms", ())
    ]


def dimm(mib: int) -> ET.Element:
    """One DIMM of `mib` MiB in NUMA cell 0, the domain's only cell (live resize's memory)."""
    memory = ET.Element("memory", {"model": "dimm"})
    target = ET.SubElement(memory, "target")
    ET.SubElement(target, "size", {"unit": "MiB"}).text = str(mib)
    ET.SubElement(target, "node").text = "0"
    return memory


def _disk(
    devices: ET.Element, path: str, format: str, bus: str, used: dict[str, int]
) -> ET.Element:
    index = used.get(bus, 0)
    used[bus] = index + 1
    disk = ET.SubElement(devices, "disk", {"type": "file", "device": "disk"})
    ET.SubElement(disk, "driver", {"name": "qemu", "type": format})
    ET.SubElement(disk, "source", {"file": path})
    ET.SubElement(disk, "target", {"dev": _disk_target(bus, index), "bus": bus})
    return disk


def _targets(spec: LaunchSpec) -> dict[str, str]:
    """Each disk's target (vda, ...) and its file, as `domain_xml` attaches them."""
    used: dict[str, int] = {}
    files = [(str(path), bus) for path, bus in spec.disks]
    if spec.seed is not None:
        files.append((str(spec.seed), "virtio"))
    files += [(str(path), "virtio") for path, _ in spec.claims]
    targets = {}
    for path, bus in files:
        index = used.get(bus, 0)
        used[bus] = index + 1
        targets[_disk_target(bus, index)] = path
    return targets


def retarget(xml: str, spec: LaunchSpec, owner: Owner) -> str:
    """A saved domain's XML for the machine's next pod: its disks' files are `spec`'s (the
    same targets: the layout was checked to be the same), its metadata and title the new
    pod's; the rest (name, devices, layout) as saved. ValueError when a disk of `spec` has no
    target in the saved domain."""
    return rehome(xml, disk_files(spec), owner)


def disk_files(spec: LaunchSpec) -> dict[str, str]:
    """Each disk's target (vda, ...) and its file, as `domain_xml` attaches them."""
    return _targets(spec)


def rehome(xml: str, files: dict[str, str], owner: Owner) -> str:
    """A domain's XML for another pod's files: each disk's source the file `files` names for
    its target (vda, ...), the metadata and title `owner`'s; the rest as given (a hibernated
    domain's next pod, a migrated domain's target pod). ValueError when a target of `files`
    is not a disk of the domain."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    found = set()
    for disk in root.iterfind("./devices/disk"):
        target = disk.find("target")
        dev = target.get("dev") if target is not None else None
        if dev not in files:
            continue
        source = disk.find("source")
        if source is None:
            source = ET.SubElement(disk, "source")
        source.set("file", files[dev])
        found.add(dev)
    if missing := sorted(set(files) - found):
        raise ValueError(f"the domain has no disk {', '.join(missing)}")
    title = root.find("title")
    if title is None:
        title = ET.SubElement(root, "title")
    title.text = f"pod {owner.namespace}/{owner.name} (vkubelet)"
    metadata = root.find("metadata")
    if metadata is None:
        metadata = ET.SubElement(root, "metadata")
    for old in metadata.findall(f"{{{METADATA_URI}}}pod"):
        metadata.remove(old)
    ours = owner.element()
    ours.tag = f"{{{METADATA_URI}}}pod"
    metadata.append(ours)
    return ET.tostring(root, encoding="unicode")
