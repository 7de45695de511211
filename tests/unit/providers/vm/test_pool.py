"""The base volumes of a libvirt pool (`_pool`): which ones the image GC removes, and that it
cannot remove one a pod starting meanwhile makes its overlay over. On a fake daemon (its pool,
volumes and domains in memory); tests/integration/test_helm_chart_vm_fleet.py runs the pool on
real daemons."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.providers.vm import _pool
from vkubelet.providers.vm._backend import PulledImage
from vkubelet.providers.vm._config import LibvirtPool
from vkubelet.providers.vm._pool import (
    PoolVolume,
    StoragePool,
    _overlay_xml,
    unbacked_bases,
    volume_marker,
)
from vkubelet.testing.harness import eventually

A, B = "a" * 64, "b" * 64
DIR = "/var/lib/libvirt/images/vkubelet"


def base(digest: str) -> str:
    return f"vkubelet-base-{digest}"


def test_a_base_no_volume_and_no_domain_uses_is_removed_and_only_that() -> None:
    volumes = {
        base(A): PoolVolume(f"{DIR}/{base(A)}"),  # backs the overlay below
        base(B): PoolVolume(f"{DIR}/{base(B)}"),  # unused
        "vkubelet-hv-1-0123-root.qcow2": PoolVolume(f"{DIR}/root", f"{DIR}/{base(A)}"),
        "vkubelet-hv-1-4567-seed.iso": PoolVolume(f"{DIR}/seed"),  # not a base: never here
    }
    assert unbacked_bases(volumes, ()) == [base(B)]
    # a domain whose disk (or its backing chain) names a base keeps it, pool volume or not
    assert unbacked_bases(volumes, {f"{DIR}/{base(B)}"}) == []
    # a half upload (its `.uploading` mark beside it) is the next upload's to redo
    half = {base(B): volumes[base(B)], f"{base(B)}.uploading": PoolVolume(f"{DIR}/u")}
    assert unbacked_bases(half, ()) == []


class _Error(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"libvirt error {code}")
        self.code = code

    def get_error_code(self) -> int:
        return self.code


FAKE_LIBVIRT = SimpleNamespace(
    libvirtError=_Error, VIR_ERR_NO_STORAGE_POOL=49, VIR_ERR_NO_STORAGE_VOL=50
)


class FakeVolume:
    def __init__(self, pool: FakePool, name: str, backing: str | None) -> None:
        self.pool, self._name, self.backing = pool, name, backing

    def name(self) -> str:
        return self._name

    def path(self) -> str:
        return f"{DIR}/{self._name}"

    def XMLDesc(self, flags: int) -> str:
        backing = (
            f"<backingStore><path>{self.backing}</path></backingStore>" if self.backing else ""
        )
        return f"<volume><name>{self._name}</name><target><path>{self.path()}</path></target>{backing}</volume>"  # noqa: E501

    def delete(self, flags: int) -> None:
        del self.pool.volumes[self._name]

    def upload(self, stream: Any, offset: int, length: int, flags: int) -> None:
        self.pool.uploads.append(self._name)


class FakePool:
    def __init__(self) -> None:
        self.volumes: dict[str, FakeVolume] = {}
        self.uploads: list[str] = []
        self.listings = 0  # listAllVolumes calls

    def isActive(self) -> bool:
        return True

    def storageVolLookupByName(self, name: str) -> FakeVolume:
        if name not in self.volumes:
            raise _Error(FAKE_LIBVIRT.VIR_ERR_NO_STORAGE_VOL)
        return self.volumes[name]

    def listAllVolumes(self, flags: int) -> list[FakeVolume]:
        self.listings += 1
        return list(self.volumes.values())

    def createXML(self, xml: str, flags: int) -> FakeVolume:
        root = ET.fromstring(xml)  # noqa: S314
        name = str(root.findtext("name"))
        backing = root.findtext("backingStore/path")
        if backing is not None and backing.rpartition("/")[2] not in self.volumes:
            raise _Error(1)  # qemu-img: could not open the backing file
        self.volumes[name] = FakeVolume(self, name, backing)
        return self.volumes[name]


class FakeConn:
    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.domains: list[str] = []  # their XML

    def storagePoolLookupByName(self, name: str) -> FakePool:
        return self.pool

    def newStream(self, flags: int) -> Any:
        return SimpleNamespace(send=len, finish=lambda: None, abort=lambda: None)

    def listAllDomains(self, flags: int) -> list[Any]:
        return [SimpleNamespace(XMLDesc=lambda _, x=xml: x) for xml in self.domains]


class FakeConnection:
    """`_libvirt.Connection`'s surface: each call yields to the loop first, as a thread would."""

    uri = "qemu+ssh://root@hv-1/system"

    def __init__(self, conn: FakeConn) -> None:
        self.conn = conn

    async def get(self) -> FakeConn:
        return self.conn

    async def run(self, call: Any, *args: Any) -> Any:
        await asyncio.sleep(0)
        return call(*args)


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> FakeConn:
    monkeypatch.setattr(_pool, "_libvirt", lambda: FAKE_LIBVIRT)
    return FakeConn(FakePool())


def image(tmp_path: Path, digest: str) -> PulledImage:
    path = tmp_path / digest
    path.write_bytes(b"qcow2 bytes")
    return PulledImage(path, digest, 1 << 20)


async def make_overlay(pool: StoragePool, pulled: PulledImage, local: Path) -> None:
    """What `PooledLibvirtRuntime.create_overlay` does."""
    async with pool.base(pulled) as path:
        await pool.create(local, lambda name: _overlay_xml(name, path, "qcow2", 1 << 20))


async def test_the_gc_removes_an_unused_base_and_a_later_start_uploads_it_again(
    daemon: FakeConn, tmp_path: Path
) -> None:
    pool = StoragePool(FakeConnection(daemon), LibvirtPool(), "hv-1")  # type: ignore[arg-type]
    pulled = image(tmp_path, A)
    await make_overlay(pool, pulled, tmp_path / "vms" / "uid-1" / "root.qcow2")
    assert await pool.collect_bases() == []  # the overlay backs it
    # the pod is gone: its overlay goes (`collect`), then its base
    (tmp_path / "vms" / "uid-1" / "root.qcow2").unlink()
    assert len(await pool.collect(tmp_path / "vms")) == 1
    daemon.domains = [
        f"<domain><devices><disk><source file='{DIR}/{base(A)}'/></disk></devices></domain>"
    ]
    assert await pool.collect_bases() == []  # ...unless a domain's disk names it
    daemon.domains = []
    assert await pool.collect_bases() == [base(A)]
    assert base(A) not in daemon.pool.volumes
    await make_overlay(pool, pulled, tmp_path / "vms" / "uid-2" / "root.qcow2")
    assert daemon.pool.uploads == [base(A), base(A)]


async def test_the_gc_cannot_remove_the_base_a_starting_pod_makes_its_overlay_over(
    daemon: FakeConn, tmp_path: Path
) -> None:
    pool = StoragePool(FakeConnection(daemon), LibvirtPool(), "hv-1")  # type: ignore[arg-type]
    pulled = image(tmp_path, A)
    async with pool.base(pulled) as path:  # the start has its base, no overlay yet
        collecting = asyncio.create_task(pool.collect_bases())
        # the GC lists the base as unused, then waits for the start's lock
        await eventually(lambda: daemon.pool.listings >= 1, what="the GC's listing")
        assert not collecting.done()
        local = tmp_path / "vms" / "uid-1" / "root.qcow2"
        await pool.create(local, lambda name: _overlay_xml(name, path, "qcow2", 1 << 20))
    assert await collecting == []
    assert base(A) in daemon.pool.volumes


async def test_a_volume_a_domain_uses_is_kept_without_its_local_marker(
    daemon: FakeConn, tmp_path: Path
) -> None:
    """An agent that starts with an empty stateDir (the chart's pod replaced): its GC may run
    before the running VMs' pods are taken again and their markers written."""
    pool = StoragePool(FakeConnection(daemon), LibvirtPool(), "hv-1")  # type: ignore[arg-type]
    root = tmp_path / "vms" / "uid-1" / "root.qcow2"
    await make_overlay(pool, image(tmp_path, A), root)
    overlay = pool.volume_name(root)
    root.unlink()  # the state directory lost
    daemon.domains = [
        f"<domain><devices><disk><source file='{DIR}/{overlay}'/></disk></devices></domain>"
    ]
    assert await pool.collect(tmp_path / "vms") == []
    assert await pool.collect_bases() == []
    daemon.domains = []  # the domain gone: its volume goes, then its base
    assert await pool.collect(tmp_path / "vms") == [overlay]
    assert await pool.collect_bases() == [base(A)]


async def test_a_new_agent_keeps_a_powered_off_machine_s_volumes_whose_marker_it_never_saw(
    daemon: FakeConn, tmp_path: Path
) -> None:
    """The chart's pod replaced (its stateDir an emptyDir): a powered-off machine has no domain
    and no marker; the new agent keeps its disk, which the machine's next pod finds again."""
    root = tmp_path / "vms" / "m-1" / "root.qcow2"
    first = StoragePool(FakeConnection(daemon), LibvirtPool(), "hv-1")  # type: ignore[arg-type]
    await make_overlay(first, image(tmp_path, A), root)
    disk = first.volume_name(root)
    root.unlink()  # the old pod's emptyDir is gone
    second = StoragePool(FakeConnection(daemon), LibvirtPool(), "hv-1")  # type: ignore[arg-type]
    assert await second.collect(tmp_path / "vms") == []
    assert disk in daemon.pool.volumes
    await make_overlay(second, image(tmp_path, A), root)  # the machine's next pod: its own disk
    assert volume_marker(root) is not None and disk in daemon.pool.volumes
    root.unlink()  # this agent removed it (the machine's VirtualMachine gone): now it goes
    assert await second.collect(tmp_path / "vms") == [disk]
