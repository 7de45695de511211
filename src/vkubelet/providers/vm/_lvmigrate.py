"""Live migration between two libvirt hosts (`runtime: libvirt`): libvirt's own migration,
peer to peer, without shared storage; the engine, which knows no pod (`_migrations` is the
pods' side, the same as for the QEMU runtime's engine `_migrate`).

- **Target** (a pod annotated `vm.vkubelet.io/migration-source`): the agent makes the pod's
  disks and seed as for any pod, but defines no domain. It publishes a `DomainTarget` in the
  pod's `MigrationTarget` condition: its daemon's URI as the *source host's daemon* reaches
  it (`libvirt.migrationURI`, default `libvirt.uri`), the domain's name there (the target
  pod's), its file for each disk, and the target pod (the domain's `<metadata>`). It then
  waits for a domain of that name labelled with its pod's UID (`arrival`): it appears paused
  while the state comes in, when the agent opens its console stream (nothing the guest prints
  after the switchover is lost), and runs once libvirt finished the migration. The console
  history before it comes as on QEMU, to the target pod's console port (`_migrations`).
- **Source** (`migrate-to` with that endpoint): `virDomainMigrateToURI3(uri, params, LIVE |
  PEER2PEER | NON_SHARED_INC | PERSIST_DEST | UNDEFINE_SOURCE)`. The source's daemon connects
  to the target's itself; `DEST_XML` is the domain's migratable XML with the target's files
  and metadata (`destination_xml`), `DEST_NAME` the target pod's domain name, `MIGRATE_DISKS`
  the writable disks (the target's seed is its own). `NON_SHARED_INC` copies each disk's
  overlay alone: the target's overlay has the same base image (both pods pulled the same
  image; the target's disk must exist: libvirt creates none outside a storage pool).
- **Safety** is libvirt's protocol: the guest resumes at the target only after the target
  confirmed (Finish), and the source's QEMU ends only then; a target that refuses or fails
  (its disk missing, its daemon gone) leaves the guest running at the source, and the call
  raises with libvirt's message, which the source reports (the VM runs on here).
- **Trust** between hosts is the site's: the source's daemon logs in to the target's URI
  itself (qemu+ssh: as the user the URI names, with the key its `keyfile=` names, read on the
  source *host*; without one, that user's default key there). vkubelet copies no keys: a
  fleet's hosts trust each other's migration key as libvirt's peer-to-peer migration always
  needs (docs/vm-migration.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from ...sdk.retry import Backoff
from . import _lvimportmig
from ._domainxml import METADATA_URI, Owner, owner_of, rehome
from ._lvnet import retarget_network
from ._machine import MachineError
from ._migrate import DomainTarget, MigrationError, Outcome, Progress
from ._net import GuestNetwork

__all__ = [
    "ArrivingDomain",
    "MigratableDomain",
    "arrival",
    "copied_disks",
    "destination_xml",
    "failure",
    "flags",
    "follow_outgoing",
    "migrate_domain",
    "target_uri",
]

log = logging.getLogger(__name__)

_POLL = 0.1  # the target's look for its domain; the source's progress is read every second
_FOLLOW = 1.0  # a restarted source's look at the job its daemon runs on (`follow_outgoing`)


@runtime_checkable
class MigratableDomain(Protocol):
    """A running machine that libvirt migrates (`_libvirt.LibvirtMachine`)."""

    async def migrate_to(
        self,
        target: DomainTarget,
        report: Callable[[Progress], None],
        *,
        max_bandwidth: int | None = None,
    ) -> Outcome: ...

    async def follow_migration(self, report: Callable[[Progress], None]) -> Outcome:
        """A migration of this domain an earlier agent started (`follow_outgoing`)."""
        ...


@runtime_checkable
class ArrivingDomain(Protocol):
    """A libvirt migration target's machine before its domain arrived
    (`_libvirt.IncomingLibvirtMachine`)."""

    @property
    def target(self) -> DomainTarget: ...  # what the pod publishes

    async def arrive(self) -> None:
        """Until the domain runs here (the machine is then a running one, console open);
        MigrationError when it never will (stopped, or a domain of its name not the pod's)."""
        ...


def _libvirt() -> Any:
    import libvirt  # the runtime checked it is there (`_libvirt._libvirt`)

    return libvirt


def flags(libvirt: Any, *, whole_disks: bool = False) -> int:
    """Live, peer to peer, the disks copied (their overlays; `whole_disks`: their whole chain,
    an imported domain's, `_lvimportmig`), the domain defined at the target and undefined
    here: what works between two hosts without shared storage."""
    copy = (
        libvirt.VIR_MIGRATE_NON_SHARED_DISK if whole_disks else libvirt.VIR_MIGRATE_NON_SHARED_INC
    )
    return int(
        libvirt.VIR_MIGRATE_LIVE
        | libvirt.VIR_MIGRATE_PEER2PEER
        | copy
        | libvirt.VIR_MIGRATE_PERSIST_DEST
        | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
    )


def target_uri(uri: str, migration_uri: str | None) -> str:
    """The URI a source host's daemon reaches this host's with; MigrationError when the
    node's own URI names no host (`qemu:///system`) and no `libvirt.migrationURI` is set."""
    chosen = migration_uri or uri
    if not urlsplit(chosen).hostname:
        raise MigrationError(
            f"libvirt.uri {uri!r} names no host another host's libvirtd could reach: set "
            "libvirt.migrationURI (qemu+ssh://user@this-host/system) to receive migrations"
        )
    return chosen


def destination_xml(xml: str, target: DomainTarget) -> str:
    """The domain's migratable XML for the target: its disks the target pod's files, its
    metadata the target pod's, its interface the target pod's network (the tap's name and
    host side, or the bridge; the MAC stays: the guest is told its new address after it
    arrived, as on QEMU). The name stays (libvirt renames by `DEST_NAME`, and refuses a
    `DEST_XML` of another name). ValueError when the layouts differ."""
    rehomed = rehome(xml, dict(target.files), Owner(*target.owner))
    if (net := target.network) is None:
        return rehomed
    network = GuestNetwork(net.address, net.prefix, net.gateway, mac="")  # the MAC stays
    return retarget_network(rehomed, net.key, network, link=net.link, bridge=net.bridge or None)


def copied_disks(xml: str) -> list[str]:
    """The domain's writable file disks (vda, ...): what the migration copies. The read-only
    seed is not: the target has its own."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    disks = []
    for disk in root.iterfind("./devices/disk"):
        target = disk.find("target")
        if disk.get("device") != "disk" or disk.find("readonly") is not None or target is None:
            continue
        disks.append(str(target.get("dev")))
    return disks


def failure(message: str, uri: str) -> str:
    """What a failed migration's status says: libvirt's message, and where to find the
    target's reason when libvirt lost it. Over the `ssh` binary (qemu+ssh) libvirt 9.0
    replaces the target's error with the end of that ssh connection, closed after the
    failure ("End of file while reading data"); over libssh (qemu+libssh) it keeps it, but
    not always: now and then it reports the closed channel instead ("libssh transport
    error: Remote command terminated ...", seen once in a dozen refusals here)."""
    said = f"libvirt: {message}"
    if message.startswith("End of file while reading data") and uri.startswith("qemu+ssh:"):
        said += (
            " (the target's reason is lost over qemu+ssh: the source host's libvirtd log has"
            " it; a qemu+libssh libvirt.migrationURI reports it here)"
        )
    elif message.startswith("libssh transport error"):
        said += (
            " (the target's reason is lost with the channel: the source host's libvirtd log has it)"
        )
    return said


def _message(error: BaseException) -> str:
    get = getattr(error, "get_error_message", None)
    return str((get() if get is not None else None) or error)


async def migrate_domain(
    connection: Any,
    uuid: str,
    target: DomainTarget,
    report: Callable[[Progress], None],
    *,
    max_bandwidth: int | None = None,
) -> Outcome:
    """Migrate the domain `uuid` of `connection` (a `_libvirt.Connection`) to `target`;
    MigrationError with libvirt's message when it did not move (the guest runs on here)."""
    libvirt = _libvirt()
    started = time.monotonic()
    domain = await connection.domain(uuid)
    if domain is None:
        raise MigrationError(f"the domain {uuid} is gone")
    imported = bool(target.directory)  # an imported domain's target (`_lvimportmig`)
    try:
        xml = await connection.run(domain.XMLDesc, libvirt.VIR_DOMAIN_XML_MIGRATABLE)
        if imported:
            owner = Owner(*target.owner)
            destination, disks = _lvimportmig.destination_xml(xml, target.directory, owner)
        else:
            destination, disks = destination_xml(xml, target), copied_disks(xml)
    except libvirt.libvirtError as e:
        raise MigrationError(f"libvirt {connection.uri}: {_message(e)}") from None
    except ValueError as e:
        what = (
            "this imported domain cannot move"
            if imported
            else "the target pod's disks are not this VM's"
        )
        raise MigrationError(f"{what}: {e}") from None
    params: dict[str, Any] = {
        libvirt.VIR_MIGRATE_PARAM_DEST_XML: destination,
        libvirt.VIR_MIGRATE_PARAM_DEST_NAME: target.domain,
        libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS: disks,
    }
    if max_bandwidth:
        params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] = max(1, max_bandwidth // 2**20)  # MiB/s
    conn = await connection.get()
    completed: dict[str, Any] = {}
    done = asyncio.Event()

    def job_completed(_conn: Any, _domain: Any, stats: dict[str, Any], _opaque: object) -> None:
        completed.update(stats)  # libvirt's final figures, downtime included
        done.set()

    event = libvirt.VIR_DOMAIN_EVENT_ID_JOB_COMPLETED
    callback = conn.domainEventRegisterAny(domain, event, job_completed, None)
    progress = Progress(phase="migrating")
    watching = asyncio.ensure_future(_report(connection, domain, progress, report))
    try:
        await connection.run(
            domain.migrateToURI3, target.uri, params, flags(libvirt, whole_disks=imported)
        )
    except libvirt.libvirtError as e:
        if await _stays(connection, domain):
            raise MigrationError(failure(_message(e), target.uri)) from None
        # Gone from here after all: libvirt moved it and failed after the target took it
        # (its confirmation). It runs there; saying Failed would start it here again.
        log.warning("domain %s: migrated, though libvirt said: %s", uuid, _message(e))
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        with contextlib.suppress(TimeoutError):  # dispatched by the loop, a moment later
            await asyncio.wait_for(done.wait(), 2.0)
        with contextlib.suppress(libvirt.libvirtError):
            conn.domainEventDeregisterAny(callback)
    return _outcome(completed, progress, started)


async def follow_outgoing(
    connection: Any, uuid: str, report: Callable[[Progress], None]
) -> Outcome:
    """A migration of the domain `uuid` that the source host's daemon runs on its own: the
    agent whose call started it died. libvirt 9.0 goes on with a peer-to-peer migration whose
    client went away (found on the lab: the client SIGKILLed mid-copy, the daemon finished the
    move), so a restarted agent only follows the job: its progress to `report` until it
    ends; the Outcome (libvirt's figures, from its job-completed event, when it comes) once the
    domain left this host; MigrationError when the job ended with the domain still here,
    running (libvirt keeps no reason for a failed job: the source host's libvirtd log has it),
    or there is no migration job at all."""
    libvirt = _libvirt()
    started = time.monotonic()
    domain = await connection.domain(uuid)
    if domain is None:
        return Outcome(0, 0, 0, 0, 0)  # it left before we looked
    completed: dict[str, Any] = {}
    conn = await connection.get()

    def job_completed(_conn: Any, _domain: Any, stats: dict[str, Any], _opaque: object) -> None:
        completed.update(stats)

    event = libvirt.VIR_DOMAIN_EVENT_ID_JOB_COMPLETED
    callback = conn.domainEventRegisterAny(domain, event, job_completed, None)
    progress = Progress(phase="migrating")
    retry = Backoff(initial=1.0, cap=10.0)
    try:
        while True:
            try:
                state, reason = await connection.run(domain.state)
                if state == libvirt.VIR_DOMAIN_SHUTOFF:
                    if reason == libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED:
                        break  # left: libvirt undefines it here itself
                    raise MigrationError("the domain shut off here during its migration")
                stats = await connection.run(domain.jobStats)
            except libvirt.libvirtError as e:
                if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    break  # left (and undefined here)
                log.warning("domain %s: following its migration: %s", uuid, _message(e))
                await asyncio.sleep(retry.next_delay())  # the daemon away: ask again
                continue
            except MachineError as e:
                log.warning("domain %s: following its migration: %s", uuid, e)
                await asyncio.sleep(retry.next_delay())
                continue
            retry.reset()
            if stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE) == libvirt.VIR_DOMAIN_JOB_NONE:
                # Over (or none): a domain that moved is shut off or gone by then, the state
                # read before the job may be older than its end
                if await _stays(connection, domain):
                    raise MigrationError(
                        "libvirt's migration ended without moving the VM while no agent "
                        "watched it (libvirt keeps no reason: the source host's libvirtd log "
                        "has it)"
                    )
                break
            if stats.get("operation") != libvirt.VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT:
                raise MigrationError("the domain runs a job that is not its migration")
            progress.disk_done = int(stats.get("disk_processed", 0))
            progress.disk_total = int(stats.get("disk_total", 0))
            progress.ram_done = int(stats.get("memory_processed", 0))
            progress.ram_total = int(stats.get("memory_total", 0))
            report(progress)
            await asyncio.sleep(_FOLLOW)
        await asyncio.sleep(_POLL)  # the job-completed event, dispatched by the loop
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.domainEventDeregisterAny(callback)
    return _outcome(completed, progress, started)


async def _stays(connection: Any, domain: Any) -> bool:
    """Whether a domain whose migration call failed is still this host's: defined here and
    not shut off as migrated (a daemon that cannot be asked: assumed so, the safe answer for
    the caller, whose VM then counts as not moved)."""
    libvirt = _libvirt()
    try:
        state, reason = await connection.run(domain.state)
    except libvirt.libvirtError as e:
        return bool(e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN)
    except MachineError:
        return True
    migrated = state == libvirt.VIR_DOMAIN_SHUTOFF and reason == libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED
    return not migrated


async def _report(
    connection: Any, domain: Any, progress: Progress, report: Callable[[Progress], None]
) -> None:
    """The job's progress, from libvirt's job stats, every second."""
    libvirt = _libvirt()
    while True:
        await asyncio.sleep(1.0)
        with contextlib.suppress(libvirt.libvirtError):
            stats = await connection.run(domain.jobStats)
            progress.disk_done = int(stats.get("disk_processed", 0))
            progress.disk_total = int(stats.get("disk_total", 0))
            progress.ram_done = int(stats.get("memory_processed", 0))
            progress.ram_total = int(stats.get("memory_total", 0))
            report(progress)


async def arrival(
    connection: Any,
    name: str,
    pod_uid: str,
    seen: Callable[[Any], Awaitable[None]],
) -> tuple[Any, str]:
    """Until the domain `name`, labelled with `pod_uid`, runs at `connection`'s host: the
    domain and its UUID. `seen` is called once it exists (paused: the state is coming). One
    that went away before it ran here raises MigrationError: its migration failed or was
    cancelled at the source (the guest runs on there), and no other attempt comes to this
    endpoint (the source tries each endpoint once), as a QEMU target's incoming QEMU exits
    when its source cancels. An unreachable daemon is waited for; a domain of that name that
    is not the pod's raises MigrationError."""
    libvirt = _libvirt()
    retry = Backoff(initial=1.0, cap=10.0)
    shown: str | None = None
    while True:
        try:
            conn = await connection.get()
            try:
                domain = await connection.run(conn.lookupByName, name)
            except libvirt.libvirtError as e:
                if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                    raise MachineError(f"libvirt {connection.uri}: {_message(e)}") from None
                if shown is not None:
                    raise MigrationError(
                        "the domain went away before it ran here: its migration failed or was "
                        "cancelled at the source, where the VM runs on"
                    ) from None
                await asyncio.sleep(_POLL)
                continue
            uuid = await connection.run(domain.UUIDString)
            owner = owner_of(await connection.metadata(domain, METADATA_URI))
            if owner is None or owner.pod_uid != pod_uid:
                # (no metadata is also what a domain that went away meanwhile answers: the
                # next lookup tells)
                await connection.run(conn.lookupByName, name)
                raise MigrationError(
                    f"libvirt {connection.uri} has a domain {name!r} that is not this pod's"
                )
            if shown != uuid:
                shown = uuid
                await seen(domain)
            state, _reason = await connection.run(domain.state)
            retry.reset()
        except libvirt.libvirtError:
            await asyncio.sleep(_POLL)  # it went away between two calls? the lookup says
            continue
        except MachineError as e:
            log.warning("migration target %s: %s; asking again", name, e)
            await asyncio.sleep(retry.next_delay())
            continue
        if state == libvirt.VIR_DOMAIN_RUNNING:
            return domain, uuid
        await asyncio.sleep(_POLL)


def _outcome(completed: dict[str, Any], progress: Progress, started: float) -> Outcome:
    """libvirt's job-completed figures (what was last seen of the job where one is missing)."""
    return Outcome(
        downtime_ms=int(completed.get("downtime", 0)),
        total_ms=int(completed.get("time_elapsed", 0)),
        wall_ms=int((time.monotonic() - started) * 1000),
        ram_bytes=int(completed.get("memory_processed", progress.ram_done)),
        disk_bytes=int(completed.get("disk_processed", progress.disk_done)),
    )
