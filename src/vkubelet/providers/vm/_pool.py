"""Disks and seeds as volumes of a libvirt storage pool (`libvirt.pool`), for a daemon that
cannot see the agent's files: the agent in a pod, the hypervisor elsewhere.

Without a pool the libvirt runtime gives the daemon paths under the agent's `stateDir`, which
only works when the daemon's host sees them at the same path. With one, everything a domain
reads is a volume of a directory pool on the daemon's host, made through libvirt's own APIs
over the same connection (so over `qemu+ssh` too):

- **Base images**: the image store's file, uploaded once per digest (`virStorageVolUpload`)
  as `vkubelet-base-<sha256>`, with `vkubelet-base-<sha256>.uploading` beside it until the
  upload is complete: an agent killed mid-upload leaves both, and the next upload starts
  again; one upload of an image at a time per node. A base is removed by the image GC
  (`collect_bases`) once no volume of the pool is backed by it and no domain's disk names it.
  That cannot race a pod starting on this node: a start holds the base's lock from the base's
  upload (or lookup) until its overlay exists, and the GC decides on a fresh listing under the
  same lock, so it sees the overlay, or the start finds no base and uploads it again.
- **Root overlay and emptyDir disks**: made by the daemon (`virStorageVolCreateXML`: a qcow2
  over the base volume, or a blank qcow2), unless the volume exists: its name is the disk's
  local path's, so it is that disk (an agent that lost its state directory finds its running
  VMs' disks, never makes them anew). The provider's local file at the disk's path is a small
  marker naming the volume, so the provider's "does the disk exist" stays a file test.
- **The seed**: written locally as with QEMU, uploaded at each launch into its own volume.
- **Names**: `vkubelet-<node>-<hash of the local path>-<file name>`: one per disk of each
  pod, per node (two nodes may share a daemon and its pool). `collect` removes this node's
  volumes whose local file is gone (the pod's directory was removed) unless a domain names
  them as a disk (an agent that lost its state directory writes its running VMs' markers
  only when it takes their pods again).

The pool is defined, built and started when missing (a `dir` pool at `libvirt.pool.path`).
- **PVC disks**: the claim provisioner (`_volumes`) makes them with this runtime's
  `create_blank`, so they are blank qcow2 volumes with a marker at the PV's local path; a claim
  deleted with `Delete` removes the marker, and `collect` the volume.

- **Root-disk growth** of a powered-off machine: `virStorageVolResize` of its volume.

- **Backups** (`PoolBackupStaging`): libvirt copies each disk into a blank volume, which the
  agent downloads into its own backup files; the chain, manifest and restores stay the agent's
  files. A disk restored from them is uploaded as its volume at the first launch (`adopt`).

Two nodes that share one daemon's pool share its base volumes but not their locks: a base
removed by one node's GC while the other makes an overlay over it fails that start (libvirt
finds no backing file), and the pod's next start uploads it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from ..._files import write_atomic
from ._backend import LaunchSpec, MachineHandle, MachineRefused, PulledImage
from ._backup import BackupError, BackupPlan
from ._config import LibvirtPool, VMConfig
from ._disks import image_info, rebase_unsafe
from ._libvirt import Connection, LibvirtRuntime, _code, _libvirt, message_of
from ._machine import MachineError

__all__ = ["PoolVolume", "PooledLibvirtRuntime", "StoragePool", "unbacked_bases", "volume_marker"]

log = logging.getLogger(__name__)

_MARKER_KEY = "libvirtVolume"
_MARKER_MAX = 4096  # a marker is a line of JSON; a real disk or seed is far bigger
_CHUNK = 1 << 20
_BASE = re.compile(r"vkubelet-base-[0-9a-f]{64}")
_UPLOADING = ".uploading"


@dataclass(frozen=True)
class PoolVolume:
    """What the base GC needs of a volume: its path and the path of what backs it."""

    path: str
    backing: str | None = None


def unbacked_bases(volumes: Mapping[str, PoolVolume], domain_disks: Collection[str]) -> list[str]:
    """The names of the base volumes to remove: whole ones (no `.uploading` mark beside them:
    a half upload is the next upload's to redo) whose path backs no other volume of the pool
    and is no domain's disk file or backing file (`domain_disks`)."""
    used = {*domain_disks, *(v.backing for v in volumes.values() if v.backing is not None)}
    return sorted(
        name
        for name, volume in volumes.items()
        if _BASE.fullmatch(name) and f"{name}{_UPLOADING}" not in volumes
        and volume.path not in used
    )  # fmt: skip


def volume_marker(path: Path) -> dict[str, str] | None:
    """The volume a local marker file names (None: not a marker, or no file)."""
    try:
        if path.stat().st_size > _MARKER_MAX:
            return None
        found = json.loads(path.read_text())[_MARKER_KEY]
        return {k: str(found[k]) for k in ("pool", "name", "path")}
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class StoragePool:
    """One directory pool of the daemon at `connection.uri`; every call is an RPC in the
    connection's threads. Errors are MachineError with libvirt's message and the URI."""

    def __init__(self, connection: Connection, config: LibvirtPool, node: str) -> None:
        self.connection, self.config, self.node = connection, config, node
        self._uploading: dict[str, asyncio.Lock] = {}
        self._seen: set[str] = set()  # volumes whose local file this process saw (`collect`)

    def volume_name(self, local: Path) -> str:
        digest = hashlib.sha256(str(local.resolve()).encode()).hexdigest()[:12]
        return f"vkubelet-{self.node}-{digest}-{local.name}"

    def _error(self, error: BaseException) -> MachineError:
        return MachineError(
            f"libvirt {self.connection.uri}: pool {self.config.name}: {message_of(error)}"
        )

    async def pool(self) -> Any:
        """The pool, made and started when missing."""
        libvirt = _libvirt()
        conn = await self.connection.get()
        try:
            return await self.connection.run(_ensure_pool, libvirt, conn, self.config)
        except libvirt.libvirtError as e:
            raise self._error(e) from None

    def _base_lock(self, name: str) -> asyncio.Lock:
        """Held by a start from its base's upload until its overlay exists, and by the base GC
        while it decides on that base (see the module)."""
        return self._uploading.setdefault(name, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def base(self, image: PulledImage) -> AsyncIterator[str]:
        """The path on the daemon's host of `image`'s volume, uploaded when missing; the base
        GC leaves it alone until the block ends (make the overlay over it in the block)."""
        libvirt = _libvirt()
        pool = await self.pool()
        conn = await self.connection.get()
        name = f"vkubelet-base-{image.sha256}"
        upload = partial(_uploaded, libvirt, conn, pool, name, image.path, staged=True)
        async with self._base_lock(name):  # two pods, one image; or the GC
            try:
                path = await self.connection.run(upload)
            except (libvirt.libvirtError, OSError) as e:
                raise self._error(e) from None
            yield path

    async def collect_bases(self) -> list[str]:
        """Remove the base volumes nothing uses any more (`unbacked_bases`); returns their
        names. Each is decided again under its lock on a fresh listing, so an overlay a start
        made meanwhile keeps it."""
        libvirt = _libvirt()
        pool = await self.pool()
        conn = await self.connection.get()
        removed = []
        try:
            volumes = await self.connection.run(_pool_volumes, libvirt, pool)
            for name in unbacked_bases(volumes, ()):  # candidates; domains read below
                async with self._base_lock(name):
                    volumes = await self.connection.run(_pool_volumes, libvirt, pool)
                    disks = await self.connection.run(_domain_disks, libvirt, conn)
                    if name in unbacked_bases(volumes, disks):
                        await self.connection.run(_delete_volume, libvirt, pool, name)
                        removed.append(name)
        except libvirt.libvirtError as e:
            raise self._error(e) from None
        return removed

    async def create(self, local: Path, xml_of: Callable[[str], str]) -> None:
        """The marker at `local` naming its volume, made from `xml_of(name)` unless it exists:
        the name is the local path's, so one that exists is this disk's own (an agent whose
        state directory was lost, a pod's in an emptyDir, finds its running VMs' disks)."""
        libvirt = _libvirt()
        pool = await self.pool()
        name = self.volume_name(local)
        try:
            path = await self.connection.run(_found_or_created, libvirt, pool, name, xml_of(name))
        except libvirt.libvirtError as e:
            raise self._error(e) from None
        marker = {_MARKER_KEY: {"pool": self.config.name, "name": name, "path": path}}
        local.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(local, json.dumps(marker) + "\n")
        self._seen.add(name)

    async def grow(self, local: Path, size: int) -> None:
        """The volume `local`'s marker names grown to `size` bytes (`virStorageVolResize`);
        never shrunk."""
        libvirt = _libvirt()
        pool = await self.pool()
        marker = volume_marker(local)
        if marker is None:
            raise MachineRefused("UnsupportedByRuntime", f"disk {local.name}: not a pool volume")
        try:
            volume = await self.connection.run(pool.storageVolLookupByName, marker["name"])
            capacity = int((await self.connection.run(volume.info))[1])
            if capacity < size:
                await self.connection.run(volume.resize, size, 0)
        except libvirt.libvirtError as e:
            raise self._error(e) from None

    async def upload(self, local: Path) -> str:
        """`local`'s bytes as a volume of their own (replaced if it exists); its path."""
        libvirt = _libvirt()
        pool = await self.pool()
        conn = await self.connection.get()
        name = self.volume_name(local)
        try:
            await self.connection.run(_delete_volume, libvirt, pool, name)
            upload = partial(_uploaded, libvirt, conn, pool, name, local, staged=False)
            path = await self.connection.run(upload)
        except (libvirt.libvirtError, OSError) as e:
            raise self._error(e) from None
        self._seen.add(name)
        return path

    async def blank(self, name: str, size: int) -> Path:
        """A new blank qcow2 volume `name` (one left by an interrupted run is replaced)."""
        libvirt = _libvirt()
        pool = await self.pool()
        try:
            await self.connection.run(_delete_volume, libvirt, pool, name)
            volume = await self.connection.run(pool.createXML, _blank_xml(name, size), 0)
            return Path(await self.connection.run(volume.path))
        except libvirt.libvirtError as e:
            raise self._error(e) from None

    async def download(self, name: str, local: Path) -> None:
        """Volume `name`'s bytes into the file `local` (made or replaced)."""
        libvirt = _libvirt()
        pool = await self.pool()
        conn = await self.connection.get()
        try:
            await self.connection.run(_downloaded, libvirt, conn, pool, name, local)
        except (libvirt.libvirtError, OSError) as e:
            raise self._error(e) from None

    async def delete(self, name: str) -> None:
        libvirt = _libvirt()
        pool = await self.pool()
        try:
            await self.connection.run(_delete_volume, libvirt, pool, name)
        except libvirt.libvirtError as e:
            raise self._error(e) from None

    async def adopt(self, local: Path) -> None:
        """A disk file the agent made (a restored backup) uploaded as its volume, then
        replaced by the marker naming it: from then on it is a disk like the others."""
        uploaded = await self.upload(local)
        marker = {
            _MARKER_KEY: {
                "pool": self.config.name,
                "name": self.volume_name(local),
                "path": uploaded,
            }
        }
        write_atomic(local, json.dumps(marker) + "\n")

    def _live(self, local_root: Path) -> set[str]:
        return {self.volume_name(p) for p in local_root.rglob("*") if p.is_file()}

    async def collect(self, local_root: Path) -> list[str]:
        """Remove this node's volumes whose local file (marker or seed) under `local_root` this
        process saw, or made, and that is gone now, and that no domain names as a disk; returns
        their names. The volumes are listed before the files are: a disk made meanwhile has its
        marker by the time the files are read, and is kept. A volume whose marker this process
        never saw is kept: an agent that starts with an empty `stateDir` (the chart's pod
        replaced: an emptyDir) writes a machine's markers only when the machine's next pod
        runs, and a powered-off machine has no domain to name its disks meanwhile (its volumes
        leak if its VirtualMachine is deleted before that: a leak, never a lost disk)."""
        libvirt = _libvirt()
        pool = await self.pool()
        conn = await self.connection.get()
        prefix = f"vkubelet-{self.node}-"
        removed = []
        try:
            volumes = await self.connection.run(_pool_volumes, libvirt, pool)
            disks = await self.connection.run(_domain_disks, libvirt, conn)
            live = await asyncio.to_thread(self._live, local_root)
            self._seen |= live & set(volumes)
            for name, volume in volumes.items():
                gone = name in self._seen and name not in live
                if name.startswith(prefix) and gone and volume.path not in disks:
                    await self.connection.run(_delete_volume, libvirt, pool, name)
                    self._seen.discard(name)
                    removed.append(name)
        except libvirt.libvirtError as e:
            raise self._error(e) from None
        return removed


def _ensure_pool(libvirt: Any, conn: Any, config: LibvirtPool) -> Any:
    try:
        pool = conn.storagePoolLookupByName(config.name)
    except libvirt.libvirtError as e:
        if _code(e) != libvirt.VIR_ERR_NO_STORAGE_POOL:
            raise
        xml = (
            f"<pool type='dir'><name>{escape(config.name)}</name>"
            f"<target><path>{escape(config.path)}</path>"
            "<permissions><mode>0700</mode></permissions></target></pool>"
        )
        pool = conn.storagePoolDefineXML(xml, 0)
        pool.build(0)
        with contextlib.suppress(libvirt.libvirtError):
            pool.setAutostart(1)
    if not pool.isActive():
        pool.create(0)
    return pool


def _pool_volumes(libvirt: Any, pool: Any) -> dict[str, PoolVolume]:
    """The pool's volumes by name as libvirt knows them (an overlay made through it carries
    its backing store; a refresh is not asked: a failed one stops the pool); one that
    vanished while listed is left out."""
    found = {}
    for volume in pool.listAllVolumes(0):
        try:
            root = ET.fromstring(volume.XMLDesc(0))  # noqa: S314 - from the daemon we drive
        except libvirt.libvirtError:
            continue
        name, path = root.findtext("name"), root.findtext("target/path")
        if name and path:
            found[name] = PoolVolume(path, root.findtext("backingStore/path") or None)
    return found


def _domain_disks(libvirt: Any, conn: Any) -> set[str]:
    """Every file any domain of the daemon names as a disk or a disk's backing file (running
    domains' XML carries the backing chain)."""
    files = set()
    for domain in conn.listAllDomains(0):
        try:
            root = ET.fromstring(domain.XMLDesc(0))  # noqa: S314 - from the daemon we drive
        except libvirt.libvirtError:
            continue  # gone meanwhile
        files |= {str(s.get("file")) for s in root.iterfind("./devices/disk//source[@file]")}
    return files


def _delete_volume(libvirt: Any, pool: Any, name: str) -> None:
    try:
        volume = pool.storageVolLookupByName(name)
    except libvirt.libvirtError as e:
        if _code(e) == libvirt.VIR_ERR_NO_STORAGE_VOL:
            return
        raise
    volume.delete(0)


def _found_or_created(libvirt: Any, pool: Any, name: str, xml: str) -> str:
    try:
        return str(pool.storageVolLookupByName(name).path())
    except libvirt.libvirtError as e:
        if _code(e) != libvirt.VIR_ERR_NO_STORAGE_VOL:
            raise
    return str(pool.createXML(xml, 0).path())


def _volume_path(local: Path, what: str) -> Path:
    """The daemon's path of the volume `local`'s marker names; MachineRefused naming the disk
    when `local` is no marker (a file only the agent's host has)."""
    marker = volume_marker(Path(local))
    if marker is None:
        raise MachineRefused("UnsupportedByRuntime", f"disk {Path(local).name}: {what}")
    return Path(marker["path"])


def _raw_xml(name: str, size: int) -> str:
    return (
        f"<volume><name>{escape(name)}</name><capacity unit='bytes'>{size}</capacity>"
        "<target><format type='raw'/><permissions><mode>0600</mode></permissions></target>"
        "</volume>"
    )


def _exists(libvirt: Any, pool: Any, name: str) -> bool:
    try:
        pool.storageVolLookupByName(name)
    except libvirt.libvirtError as e:
        if _code(e) != libvirt.VIR_ERR_NO_STORAGE_VOL:
            raise
        return False
    return True


def _uploaded(libvirt: Any, conn: Any, pool: Any, name: str, local: Path, *, staged: bool) -> str:
    """The volume `name` holding `local`'s bytes: found, or created and uploaded (removed
    again if the upload fails). `staged`: a volume `<name>.uploading` stands beside it while
    it is written, so that one found without it is whole (an agent killed in the middle of an
    upload leaves both, and the next upload starts again)."""
    pending = f"{name}.uploading"
    if staged and _exists(libvirt, pool, pending):
        _delete_volume(libvirt, pool, name)
        _delete_volume(libvirt, pool, pending)
    try:
        return str(pool.storageVolLookupByName(name).path())
    except libvirt.libvirtError as e:
        if _code(e) != libvirt.VIR_ERR_NO_STORAGE_VOL:
            raise
    if staged:
        pool.createXML(_raw_xml(pending, 0), 0)
    size = local.stat().st_size
    volume = pool.createXML(_raw_xml(name, size), 0)
    try:
        stream = conn.newStream(0)
        volume.upload(stream, 0, size, 0)
        try:
            with local.open("rb") as source:
                while chunk := source.read(_CHUNK):
                    view = memoryview(chunk)
                    while view:
                        sent = stream.send(bytes(view))
                        view = view[sent:]
            stream.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            raise
    except BaseException:
        with contextlib.suppress(libvirt.libvirtError):
            volume.delete(0)
        raise
    if staged:
        _delete_volume(libvirt, pool, pending)
    return str(volume.path())


def _downloaded(libvirt: Any, conn: Any, pool: Any, name: str, local: Path) -> None:
    volume = pool.storageVolLookupByName(name)
    stream = conn.newStream(0)
    volume.download(stream, 0, 0, 0)  # the whole volume
    try:
        with local.open("wb") as out:
            while data := stream.recv(_CHUNK):
                out.write(data)
        stream.finish()
    except BaseException:
        with contextlib.suppress(libvirt.libvirtError):
            stream.abort()
        raise


class PoolBackupStaging:
    """Backups on a daemon that cannot see the agent's files (`_backuplibvirt.BackupStaging`):
    libvirt copies each disk into a blank volume of the pool, named after the chain and the
    backup (`vkubelet.backup-...`, which the volume GC leaves alone), whose bytes the agent then
    downloads into its target file; an incremental one gets its backing file back (`qemu-img
    rebase -u`: the copy holds only what changed, so the chain reads through it as with QEMU)."""

    def __init__(self, pool: StoragePool) -> None:
        self.pool = pool

    def host_path(self, disk: Path) -> Path:
        marker = volume_marker(disk)
        if marker is None:
            raise BackupError("BackupFailed", f"disk {disk.name}: not a volume of libvirt.pool")
        return Path(marker["path"])

    def _names(self, plan: BackupPlan) -> list[str]:
        node = self.pool.node
        return [
            f"vkubelet.backup-{node}-{plan.chain}-{plan.backup_id}-{i}"
            for i in range(len(plan.files))
        ]

    async def targets(self, plan: BackupPlan, sizes: Sequence[int]) -> list[Path]:
        return [await self.pool.blank(n, s) for n, s in zip(self._names(plan), sizes, strict=True)]

    async def fetch(self, plan: BackupPlan) -> None:
        for name, local in zip(self._names(plan), plan.files, strict=True):
            backing = (await image_info(local)).backing_file  # what `run_backup` made it over
            part = local.with_name(local.name + ".part")
            try:
                await self.pool.download(name, part)
                if backing is not None:
                    await rebase_unsafe(part, backing)
                part.replace(local)
            finally:
                part.unlink(missing_ok=True)
            await self.pool.delete(name)

    async def drop(self, plan: BackupPlan) -> None:
        for name in self._names(plan):
            try:
                await self.pool.delete(name)
            except MachineError as e:
                log.warning("backup volume %s not removed: %s", name, e)


def _overlay_xml(name: str, base: str, base_format: str, capacity: int) -> str:
    return (
        f"<volume><name>{escape(name)}</name><capacity unit='bytes'>{capacity}</capacity>"
        "<target><format type='qcow2'/><compat>1.1</compat>"
        "<permissions><mode>0600</mode></permissions></target>"
        f"<backingStore><path>{escape(base)}</path><format type='{base_format}'/>"
        "</backingStore></volume>"
    )


def _blank_xml(name: str, capacity: int) -> str:
    return (
        f"<volume><name>{escape(name)}</name><capacity unit='bytes'>{capacity}</capacity>"
        "<target><format type='qcow2'/><compat>1.1</compat>"
        "<permissions><mode>0600</mode></permissions></target>"
        "</volume>"
    )


class PooledLibvirtRuntime(LibvirtRuntime):
    """`LibvirtRuntime` whose disks and seed are volumes of `config.libvirt_pool` (see the
    module): the daemon never reads a path of the agent's host."""

    def __init__(self, config: VMConfig, node_name: str) -> None:
        super().__init__(config, node_name)
        assert config.libvirt_pool is not None
        self.pool = StoragePool(self.connection, config.libvirt_pool, node_name)
        self.backup_staging = PoolBackupStaging(self.pool)
        self._collecting: asyncio.Task[None] | None = None

    async def create_overlay(self, base: PulledImage, path: Path, size: int | None) -> None:
        capacity = max(size or 0, base.size)
        async with self.pool.base(base) as base_path:  # (the base GC waits for the overlay)
            await self.pool.create(
                path, lambda name: _overlay_xml(name, base_path, base.format, capacity)
            )

    async def create_blank(self, path: Path, size: int) -> None:
        await self.pool.create(path, lambda name: _blank_xml(name, size))

    async def grow_disk(self, path: Path, size: int) -> None:
        await self.pool.grow(path, size)

    async def launch(self, spec: LaunchSpec) -> MachineHandle:
        """The spec's disks, PVC disks and seed as the daemon's paths of their volumes; a disk
        that is a local file (restored from a backup) is uploaded as its volume first."""
        disks = []
        for path, bus in spec.disks:
            if volume_marker(Path(path)) is None:  # a disk restored from a backup
                await self.pool.adopt(Path(path))
            disks.append((_volume_path(path, "not a volume of libvirt.pool"), bus))
        claims = [
            # the provisioner made them with this runtime's `create_blank`: markers too
            (_volume_path(path, "a PVC disk of another node's provisioner"), serial)
            for path, serial in spec.claims
        ]
        seed = await self.pool.upload(Path(spec.seed)) if spec.seed is not None else None
        return await super().launch(
            replace(
                spec,
                disks=tuple(disks),
                claims=tuple(claims),
                seed=Path(seed) if seed is not None else None,
            )
        )

    def gc_images(self, in_use: Collection[str]) -> list[str]:
        """The image store's GC, and (in the background: this is called from the provider's
        GC loop, a sync call) the volumes of pods that are gone, then the base volumes no
        volume or domain uses any more."""
        if self._collecting is None or self._collecting.done():
            self._collecting = asyncio.get_running_loop().create_task(
                self._collect(), name="pool volume gc"
            )
        return super().gc_images(in_use)

    async def _collect(self) -> None:
        try:
            removed = await self.pool.collect(self.config.state_dir)
            removed += await self.pool.collect_bases()  # (after: the overlays just removed)
        except MachineError as e:
            log.warning("node %s: volumes not collected: %s", self.node_name, e)
            return
        if removed:
            log.info("node %s: removed volumes %s", self.node_name, ", ".join(removed))
