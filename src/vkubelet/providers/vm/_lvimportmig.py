"""Live migration of an imported libvirt domain (`_domainimport`) to another libvirt host:
what differs from a domain vkubelet made (`_lvmigrate` does the migration itself).

Pure (no daemon): the runtime (`_libvirt`) and `_lvmigrate` do the I/O. Why it differs:

- **The disks are the domain's own**, of any size and chain, which the target pod does not
  know. So the target makes no files: it creates a transient `dir` storage pool over a
  directory of its pod (`imported_disks`, built by the target's daemon, on its host: the
  domain's disks from then on, never removed by vkubelet, as no imported disk is),
  and the source asks for a full copy (`NON_SHARED_DISK`, not the overlay-only `_INC`, which
  libvirt cannot pre-create targets for) into `<directory>/<dev>.<format>` (`DEST_XML`):
  libvirt's target daemon then creates each file in that pool with the source disk's size
  and format before the copy. The copies have no backing chain. The source's files are left
  where they are, untouched.
- **Its identity stays**: the name (no `DEST_NAME` rename), the UUID, its NICs as defined
  (a bridge of the same name must exist on the target host: libvirt refuses the migration
  otherwise, naming the bridge, and the guest runs on at the source). Only vkubelet's
  metadata changes: the pod element names the target pod, the import claim the target node.
- **What it copies**: every writable file disk. A read-only file (a CD-ROM image) is not
  copied: it must exist at the same path on the target host. A block or network disk is
  refused (`ValueError`): vkubelet cannot make its target.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Final
from xml.sax.saxutils import escape

from ._domainimport import IMPORT_URI
from ._domainxml import METADATA_URI, Owner

__all__ = [
    "POOL_PREFIX",
    "copies_in",
    "destination_xml",
    "imported_disks",
    "imported_root",
    "pool_name",
    "pool_xml",
]

#: The transient storage pool a target's imported disks are created in, per target pod.
POOL_PREFIX: Final = "vkubelet-incoming-"


def imported_root(state_dir: Path) -> Path:
    return state_dir / "imported"


def imported_disks(state_dir: Path, pod_uid: str) -> Path:
    """Where a target pod's imported domain's disks are copied: the agent's `stateDir`, not
    the pod's run directory, which goes with the pod (the disks are the domain's: they stay
    when the pod or the VirtualMachine is deleted, until the domain moves on)."""
    return imported_root(state_dir) / pod_uid


def copies_in(xml: str, root: Path) -> list[Path]:
    """The directories of `root` (a node's `imported_root`, as the domain's XML names it)
    that hold the domain's writable file disks: copies an earlier move made on this node.
    Once the domain moved on they are no one's (its disks are the next host's copies)."""
    found: list[Path] = []
    for disk in ET.fromstring(xml).iterfind("./devices/disk"):  # noqa: S314 - our daemon's
        source = disk.find("source")
        if disk.get("type") != "file" or disk.get("device") != "disk" or source is None:
            continue
        if disk.find("readonly") is not None or not source.get("file"):
            continue
        directory = Path(str(source.get("file"))).parent
        if directory.parent == root and directory not in found:
            found.append(directory)
    return found


def pool_name(pod_uid: str) -> str:
    return f"{POOL_PREFIX}{pod_uid}"


def pool_xml(pod_uid: str, directory: str) -> str:
    """A `dir` pool over `directory`: libvirt finds it by its target path and creates the
    migrated disks' files in it."""
    return (
        f"<pool type='dir'><name>{pool_name(pod_uid)}</name>"
        f"<target><path>{escape(directory)}</path></target></pool>"
    )


def destination_xml(xml: str, directory: str, owner: Owner) -> tuple[str, list[str]]:
    """The imported domain's migratable XML for the target, and the disks copied: each
    writable file disk's source `<directory>/<dev>.<format>` without a backing chain, the pod
    element `owner`'s, the import claim's node `owner.node`; everything else as defined.
    ValueError for a disk vkubelet cannot make a target for, or no claim."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    copied = []
    for disk in root.iterfind("./devices/disk"):
        target = disk.find("target")
        dev = target.get("dev") if target is not None else None
        if disk.get("device") != "disk" or disk.find("readonly") is not None or dev is None:
            continue
        if disk.get("type") != "file":
            raise ValueError(
                f"disk {dev} is a {disk.get('type')} disk: only file disks of an imported "
                "domain are migrated"
            )
        driver = disk.find("driver")
        fmt = (driver.get("type") if driver is not None else None) or "raw"
        source = disk.find("source")
        if source is None:
            continue  # an empty drive: nothing to copy
        source.set("file", f"{directory.rstrip('/')}/{dev}.{fmt}")
        for chain in disk.findall("backingStore"):
            disk.remove(chain)
        copied.append(dev)
    metadata = root.find("metadata")
    claim = metadata.find(f"{{{IMPORT_URI}}}import") if metadata is not None else None
    if metadata is None or claim is None:
        raise ValueError("the domain has no import claim")
    claim.set("node", owner.node)
    for old in metadata.findall(f"{{{METADATA_URI}}}pod"):
        metadata.remove(old)
    ours = owner.element()
    ours.tag = f"{{{METADATA_URI}}}pod"
    metadata.append(ours)
    return ET.tostring(root, encoding="unicode"), copied
