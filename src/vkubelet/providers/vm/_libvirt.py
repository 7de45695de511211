"""The libvirt runtime (`runtime: libvirt`): each VM is a libvirt domain, local or remote.

What differs from the QEMU runtime (`_runtime`, `_machine`) is the machine and where the pod
network is made (`_lvnet`): images, disks, the seed and the address rules are the same parts
(`LibvirtRuntime` is a `QemuRuntime` whose `launch` and `adopt` make and find domains). The
domain's XML comes from `_domainxml`.

- **One event loop, a blocking binding.** libvirt-python's calls block until the daemon
  answers (a remote one over SSH: a round trip). Every RPC runs in this connection's own small
  thread pool (`Connection.run`), so the loop stays responsive and a slow daemon cannot starve
  `asyncio.to_thread` for the rest of the agent. Streams (the serial console) are not RPCs: they
  are non-blocking and driven by the loop itself through libvirtaio, libvirt-python's asyncio
  event implementation, which the connection registers before it opens (keepalives need it too).
- **Ownership.** A domain is ours when its `<metadata>` names the pod's UID. `launch` never
  touches a domain of that name that is not the pod's (`MachineRefused`, the pod fails with the
  reason); one that is the pod's and runs already is taken as it is (a machine never starts
  twice). The run directory keeps `domain.json` (URI, name, UUID, start time), which `adopt`
  reads after an agent restart.
- **Console.** The serial console is a pty in the domain; the agent holds libvirt's console
  stream (`virDomainOpenConsole`, which works over any URI) from the domain's start, appends
  what arrives to `console.log` in the run directory (the file the console tailer turns into
  `kubectl logs`, as with QEMU's own console file) and relays it to `kubectl attach` clients
  through `console.sock`. The domain starts paused until the stream is open, so the log has
  the boot from its first byte. What the guest prints while no agent runs is not kept (the pty
  drops it).
- **Guest agent.** libvirt connects to the guest agent's channel itself; commands go through
  `qemuAgentCommand` (`LibvirtGuestAgent`, the same `GuestAgent` interface the provider uses).
- **End.** A domain that shut off is read for why (guest poweroff, crash, destroyed), the
  outcome recorded in the run directory as the QEMU runtime records it, and the domain's
  definition removed: `virsh list --all` shows only running and hibernated VMs' domains.
- **Hibernation** is libvirt's managed save (`LibvirtMachine.save_state`): the domain stays
  defined, shut off with its image, and nothing here removes it (`_remove` keeps a domain
  with a managed save image); the machine's directory records its UUID (`_hibernate`). The
  machine's next pod restores it (`LaunchSpec.restore`): the saved XML retargeted to that
  pod's files (`_domainxml.retarget`), then started, which restores rather than boots.
- **Network.** The pod's interface is in the domain's XML and libvirt makes it on the daemon's
  host (`_lvnet`); the address book is the daemon's running domains, nothing on the agent's
  host.
- **Imported domains** (`LaunchSpec.domain`, `_domainimport`): a domain vkubelet did not
  make is checked (`check_import`: nothing changed on a refusal), claimed in its metadata,
  started as defined (`_launch_imported`) and never undefined by its machine
  (`LibvirtMachine.imported`, kept in `domain.json`); its VirtualMachine's deletion policy is
  applied by `release_import`. Its pod's IP is the guest's own (`guest_address`, `_guestaddr`).
  It live-migrates with its disks copied whole into files the target's daemon makes in a
  transient pool (`_incoming_imported`, `_lvimportmig`).
- **Live resize** is libvirt's own calls (`_lvhotplug`, the machine's `hotplug`): vCPUs set,
  DIMMs attached, the root disk resized, live and into the definition.
- **Backups** are libvirt's backup API with checkpoints (`_backuplibvirt`, `disk_backup`); a
  domain's checkpoints go with its definition (`UNDEFINE_CHECKPOINTS_METADATA`).
- **Live migration** is libvirt's own, peer to peer (`_lvmigrate`): `LibvirtMachine.migrate_to`
  on the source, `IncomingLibvirtMachine` (the pod's disks and network, no domain until it
  arrives) on the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from ..._files import write_atomic
from ...sdk.retry import Backoff
from ...sdk.tasks import SharedWatch
from ._backend import (
    DomainImport,
    GuestAddress,
    LaunchSpec,
    MachineHandle,
    MachineRefused,
    RestoreFailed,
)
from ._backup import CHAIN_PREFIX
from ._backuplibvirt import BackupStaging, LibvirtDiskBackup
from ._config import VMConfig
from ._domainimport import IMPORT_URI, ImportClaim, claim_of, refusal
from ._domainxml import (
    METADATA_URI,
    Owner,
    disk_files,
    domain_name,
    domain_xml,
    owner_of,
    retarget,
)
from ._guestaddr import first_ipv4, routed_peer
from ._lvhotplug import LibvirtHotplug
from ._lvimportmig import copies_in, imported_disks, imported_root, pool_name, pool_xml
from ._lvmigrate import arrival, follow_outgoing, migrate_domain, target_uri
from ._lvnet import bridge_refused, libvirt_network, retarget_network, with_network
from ._machine import MachineError, MachineExit, Usage
from ._migrate import DomainNetwork, DomainTarget, MigrationError, Outcome, Progress
from ._net import GuestNetwork
from ._qga import ExecOutput, GuestAgent, GuestAgentError, GuestAgentUnavailable, encode
from ._runtime import QemuRuntime

__all__ = ["Connection", "LibvirtMachine", "LibvirtRuntime"]

log = logging.getLogger(__name__)

T = TypeVar("T")
DOMAIN_FILE = "domain.json"
INCOMING_FILE = "incoming.json"  # a migration target's `DomainTarget`, until its domain came
_CHUNK = 65536
_POLL = 1.0  # seconds between state reads while a domain runs (the console's end wakes earlier)
PING_SECONDS = 4.0


def _libvirt() -> Any:
    """The binding, imported when the runtime is used: the QEMU runtime does without it."""
    try:
        import libvirt
    except ImportError:
        raise MachineError(
            "runtime: libvirt needs the Python binding: pip install libvirt-python "
            "(it builds against libvirt-dev and pkg-config)"
        ) from None
    return libvirt


def message_of(error: BaseException) -> str:
    """libvirt's own words for an error (its exceptions' str() can be empty)."""
    get = getattr(error, "get_error_message", None)
    return str((get() if get is not None else None) or error)


def _code(error: BaseException) -> int | None:
    get = getattr(error, "get_error_code", None)
    return int(get()) if get is not None else None


class Connection:
    """One connection to the daemon at `uri`, opened when first needed and again after it
    dropped (a restarted libvirtd, a broken SSH link): domains are found again by UUID. One
    attempt to open runs at a time, whoever waits for it; `last_error` is the last failed one's
    message (libvirt's), for a caller that cannot wait as long as SSH takes."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.last_error: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="libvirt")
        self._conn: Any = None
        self._opening: asyncio.Future[Any] | None = None

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """A blocking binding call in this connection's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(call, *args))

    async def get(self) -> Any:
        """The open connection; raises MachineError with libvirt's message when it cannot."""
        if self._conn is not None and self._conn.isAlive():
            return self._conn
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._opening)

    async def _open(self) -> Any:
        libvirt = _libvirt()
        _register_event_loop(libvirt)
        try:
            self._conn = await self.run(_open, libvirt, self.uri)
        except libvirt.libvirtError as e:
            self.last_error = f"libvirt {self.uri}: {message_of(e)}"
            raise MachineError(self.last_error) from None
        self.last_error = None
        return self._conn

    @property
    def current(self) -> Any:
        """The connection now open (None before the first): streams opened on an earlier one
        are dead, even though libvirt tells them nothing."""
        return self._conn

    async def domain(self, uuid: str) -> Any:
        """The domain of `uuid`, or None when the daemon has none."""
        libvirt = _libvirt()
        conn = await self.get()
        try:
            return await self.run(conn.lookupByUUIDString, uuid)
        except libvirt.libvirtError as e:
            if _code(e) == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise MachineError(f"libvirt {self.uri}: {message_of(e)}") from None

    async def metadata(self, domain: Any, uri: str) -> str | None:
        """The domain's `<metadata>` element of namespace `uri` as libvirt returns it (None:
        it has none, or it is gone): how vkubelet's elements are read, whoever reads them."""
        libvirt = _libvirt()
        try:
            found = await self.run(domain.metadata, libvirt.VIR_DOMAIN_METADATA_ELEMENT, uri)
        except libvirt.libvirtError:
            return None
        return str(found)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self.run(conn.close)
        self._pool.shutdown(wait=False)


_registered: list[asyncio.AbstractEventLoop] = []


def _register_event_loop(libvirt: Any) -> None:
    """libvirtaio as libvirt's event loop, on the running loop (once per loop; a process has
    one, tests may have several in turn)."""
    loop = asyncio.get_running_loop()
    if _registered and _registered[-1] is loop:
        return
    import libvirtaio

    libvirt.registerErrorHandler(lambda _ctx, _error: None, None)  # errors are raised, not printed
    libvirtaio.virEventRegisterAsyncIOImpl(loop=loop)
    _registered.append(loop)


def _open(libvirt: Any, uri: str) -> Any:
    """Open without prompting for credentials (the agent has no one to ask): missing or wrong
    ones fail with libvirt's message."""
    auth = [[libvirt.VIR_CRED_AUTHNAME, libvirt.VIR_CRED_PASSPHRASE], lambda creds, data: -1, None]
    conn = libvirt.openAuth(uri, auth, 0)
    # A dead peer is noticed in ~20 s, not at the next call's timeout. (A driver in this
    # process, libvirt's test:///default, has no peer and no keepalive.)
    with contextlib.suppress(libvirt.libvirtError):
        conn.setKeepAlive(5, 3)
    return conn


class LibvirtGuestAgent(GuestAgent):
    """The guest agent through libvirt (`qemuAgentCommand`): libvirt owns the channel and its
    synchronisation, so each call is one RPC. `exec` and the rest are `GuestAgent`'s."""

    def __init__(self, connection: Connection, uuid: str, *, timeout: float = 10.0) -> None:
        super().__init__(Path("/nonexistent"), timeout=timeout)
        self._connection, self._uuid = connection, uuid

    async def close(self) -> None:
        return None

    async def call(
        self,
        command: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the guest agent's own limit
    ) -> Any:
        libvirt = _libvirt()
        import libvirt_qemu

        domain = await self._connection.domain(self._uuid)
        if domain is None:
            raise GuestAgentUnavailable(f"guest agent: the domain {self._uuid} is gone")
        seconds = max(1, round(timeout or self.timeout))
        text = encode(command, arguments).decode()
        try:
            reply = await self._connection.run(
                libvirt_qemu.qemuAgentCommand, domain, text, seconds, 0
            )
        except libvirt.libvirtError as e:
            code, message = _code(e), message_of(e)
            if code in (libvirt.VIR_ERR_AGENT_UNRESPONSIVE, libvirt.VIR_ERR_OPERATION_INVALID):
                raise GuestAgentUnavailable(f"guest agent: {message}") from None
            if code == libvirt.VIR_ERR_OPERATION_TIMEOUT:
                raise TimeoutError(f"guest agent: {command} unanswered after {seconds} s") from None
            raise GuestAgentError(command, "libvirt", message) from None
        return json.loads(reply).get("return")

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        pause = Backoff(initial=0.2, cap=1.0, factor=1.5, jitter=0.0)
        while True:
            try:
                await self.call("guest-ping", timeout=2)
                return
            except (GuestAgentUnavailable, TimeoutError):
                if time.monotonic() > deadline:
                    raise GuestAgentUnavailable(
                        f"guest agent: no answer within {timeout:g} s"
                    ) from None
            await asyncio.sleep(pause.next_delay())

    async def shutdown(self, mode: str = "powerdown") -> None:
        """libvirt's agent shutdown (it knows that QGA does not answer one)."""
        libvirt = _libvirt()
        domain = await self._connection.domain(self._uuid)
        if domain is None:
            raise GuestAgentUnavailable("guest agent: the domain is gone")
        try:
            await self._connection.run(
                domain.shutdownFlags, libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT
            )
        except libvirt.libvirtError as e:
            raise GuestAgentUnavailable(f"guest agent: {message_of(e)}") from None


class _Console:
    """libvirt's console stream of one domain: appended to `log`, relayed to the clients of
    `socket` (kubectl attach). Driven by the event loop (libvirtaio), never a thread. The
    stream ends with the domain, and also when its connection drops (a restarted libvirtd):
    `open` again then gives a new stream to the same file and clients."""

    def __init__(self, log: Path, socket: Path) -> None:
        self.log, self.socket = log, socket
        self.ended = asyncio.Event()  # the current stream ended (or none was opened)
        self.ended.set()
        self._stream: Any = None
        self.connection: Any = None  # the libvirt connection the stream belongs to
        self._file: Any = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def open(self, connection: Connection, domain: Any) -> None:
        libvirt = _libvirt()
        conn = await connection.get()
        stream = conn.newStream(libvirt.VIR_STREAM_NONBLOCK)
        # FORCE: a stream an earlier agent (or connection) left open is taken over.
        await connection.run(domain.openConsole, None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
        if self._file is None:
            self._file = self.log.open("ab")
        self._stream_ended()  # a stream of an earlier connection, if any
        self._stream, self.connection = stream, conn
        self.ended.clear()
        events = (
            libvirt.VIR_STREAM_EVENT_READABLE
            | libvirt.VIR_STREAM_EVENT_ERROR
            | libvirt.VIR_STREAM_EVENT_HANGUP
        )
        stream.eventAddCallback(events, self._readable, None)
        if self._server is None:
            self.socket.unlink(missing_ok=True)
            self._server = await asyncio.start_unix_server(self._client, path=str(self.socket))

    def _readable(self, stream: Any, _events: int, _opaque: object) -> None:
        libvirt = _libvirt()
        while True:
            try:
                data = stream.recv(_CHUNK)
            except libvirt.libvirtError:
                data = b""
            if data == -2:  # nothing more now
                return
            if not data:
                self._stream_ended()
                return
            self._file.write(data)
            self._file.flush()
            for client in list(self._clients):
                if not client.is_closing():
                    client.write(data)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while data := await reader.read(_CHUNK):
                await self._send(data)  # (dropped while no stream is open)
        except OSError:  # the client went away (kubectl attach ended)
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _send(self, data: bytes) -> None:
        while data and self._stream is not None:
            sent = self._stream.send(data)
            if sent == -2:  # the stream's buffer is full: the guest reads slowly
                await asyncio.sleep(0.01)
                continue
            data = data[sent:]

    def _stream_ended(self) -> None:
        self.ended.set()
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.eventRemoveCallback()
            with contextlib.suppress(Exception):
                stream.abort()

    def close(self) -> None:
        """The domain ended (or the agent stops): the stream, the file and the clients."""
        self._stream_ended()
        if self._file is not None:
            self._file.close()
            self._file = None
        for client in self._clients:
            client.close()
        if self._server is not None:
            self._server.close()
            self._server = None


async def undefine(
    connection: Connection, domain: Any, flags: int = 0, *, optional: int | None = None
) -> None:
    """Remove a domain's definition with what libvirt refuses to undefine a domain with unless
    told: `optional`, by default its backups' checkpoints (`_backuplibvirt`). A driver that knows
    no such thing (libvirt's test driver) refuses those flags, and is asked without them."""
    libvirt = _libvirt()
    if optional is None:
        optional = libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
    try:
        await connection.run(domain.undefineFlags, flags | optional)
    except libvirt.libvirtError as e:
        if _code(e) != libvirt.VIR_ERR_INVALID_ARG:
            raise
        await connection.run(domain.undefineFlags, flags)


async def discard_copies(connection: Connection, directory: Path) -> None:
    """Delete the files of `directory` (an imported domain's disks copied there by a move,
    `_lvimportmig`) through the daemon, on its host: a transient pool over the directory, its
    volumes deleted, the pool ended; then the empty directory where the agent sees it."""
    libvirt = _libvirt()
    conn = await connection.get()
    xml = pool_xml(directory.name, str(directory))
    pool = await connection.run(conn.storagePoolCreateXML, xml, 0)
    try:
        for volume in await connection.run(pool.listAllVolumes, 0):
            await connection.run(volume.delete, 0)
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            await connection.run(pool.destroy)
    with contextlib.suppress(OSError):
        await asyncio.to_thread(directory.rmdir)


def _outcome(libvirt: Any, state: int, reason: int) -> MachineExit | None:
    """Why a domain in `state` ended (None: it has not)."""
    if state == libvirt.VIR_DOMAIN_CRASHED:
        return MachineExit(1, "Error", "guest kernel panic")
    if state != libvirt.VIR_DOMAIN_SHUTOFF:
        return None
    if reason == libvirt.VIR_DOMAIN_SHUTOFF_SHUTDOWN:
        return MachineExit(0, "Completed", "guest powered off")
    if reason == libvirt.VIR_DOMAIN_SHUTOFF_CRASHED:
        return MachineExit(1, "Error", "guest kernel panic")
    if reason == libvirt.VIR_DOMAIN_SHUTOFF_DESTROYED:
        return MachineExit(137, "Killed", "the domain was destroyed")
    if reason == libvirt.VIR_DOMAIN_SHUTOFF_FAILED:
        return MachineExit(1, "Error", "the domain failed to start")
    if reason == libvirt.VIR_DOMAIN_SHUTOFF_SAVED:
        return MachineExit(0, "Hibernated", "the domain was saved (libvirt's managed save)")
    return MachineExit(1, "Error", f"the domain shut off (libvirt reason {reason})")


class LibvirtMachine:
    """One domain, as the provider's `MachineHandle`."""

    runtime = "libvirt"
    monitor = None  # no QMP through libvirt here: hibernation, live resize, backups and
    # migration are libvirt's own (`save_state`, `hotplug`, `disk_backup`, `migrate_to`)

    def __init__(
        self,
        connection: Connection,
        run_dir: Path,
        uuid: str,
        domain_id: int,
        started: float,
        *,
        imported: bool = False,
        staging: BackupStaging | None = None,
        copies: Path | None = None,
    ) -> None:
        self.connection, self.run_dir, self.uuid = connection, run_dir, uuid
        self.imported = imported  # a domain vkubelet did not make: stopped, never undefined
        self.copies = copies  # an imported one's: where moves copy its disks on this node
        self.staging = staging  # where its backups are written (`libvirt.pool`'s volumes)
        self.pid = domain_id  # the domain's id, as `virsh list` shows it
        self.started = started
        self.console_log = run_dir / "console.log"
        self.console_socket = run_dir / "console.sock"
        self.agent = LibvirtGuestAgent(connection, uuid)
        self.hotplug = LibvirtHotplug(connection, uuid)
        self._console = _Console(self.console_log, self.console_socket)
        self._gone = asyncio.Event()  # the watcher saw the domain end
        self._watcher = SharedWatch(self._watch, name=f"watch domain {self.uuid}")

    async def open_console(self, domain: Any) -> None:
        await self._console.open(self.connection, domain)

    def disk_backup(self) -> LibvirtDiskBackup:
        """Backups through libvirt's backup API and checkpoints (`_backuplibvirt`)."""
        return LibvirtDiskBackup(self.connection, self.uuid, self.agent, self.staging)

    async def wait(self) -> MachineExit:
        """Until the domain is off; then its definition is removed and the outcome returned.
        Waiters share one watcher, cancelled with the last of them (the agent stops: the
        domain runs on for the next agent): `SharedWatch`."""
        return await self._watcher.wait()

    async def _watch(self) -> MachineExit:
        try:
            return await self._watch_domain()
        finally:
            self._console.close()

    async def _watch_domain(self) -> MachineExit:
        libvirt = _libvirt()
        retry = Backoff(initial=1.0, cap=30.0)
        while True:
            try:
                domain = await self.connection.domain(self.uuid)
                if domain is None:
                    self._gone.set()
                    return self._recorded() or MachineExit(137, "Killed", "domain removed")
                try:
                    state, reason = await self.connection.run(domain.state)
                except libvirt.libvirtError as e:  # gone since the lookup, or the link broke:
                    # the next lookup says which (a run must not end on a guess)
                    raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
                retry.reset()
            except MachineError as e:  # the daemon away: the domain runs on, ask again later
                log.warning("domain %s: %s; asking again", self.uuid, e)
                await asyncio.sleep(retry.next_delay())
                continue
            if (state, reason) == (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED):
                self._gone.set()  # libvirt undefines it itself (`_lvmigrate`)
                return MachineExit(0, "Migrated", "the domain migrated to another host")
            if (outcome := _outcome(libvirt, state, reason)) is not None:
                self._gone.set()
                await self._remove()
                return self._recorded() or outcome
            # The stream's connection dropped (libvirtd restarted, the link broke) and another
            # is open: the domain runs on, its console is opened again.
            if self._console.connection is not self.connection.current:
                self._console.ended.set()
            if self._console.ended.is_set():
                with contextlib.suppress(MachineError, OSError, libvirt.libvirtError):
                    await self._console.open(self.connection, domain)
                    log.info("domain %s: console stream open again", self.uuid)
                if self._console.ended.is_set():
                    await asyncio.sleep(_POLL)
                    continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._console.ended.wait(), _POLL)

    async def wait_guest_agent(self, timeout: float) -> None:  # noqa: ASYNC109
        await self.agent.wait_ready_unless(
            self._gone.wait(), timeout, f"domain {self.uuid} ended before its guest agent answered"
        )

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ExecOutput:
        return await self.agent.exec(argv, stdin=stdin, timeout=timeout)

    async def stop(self, grace: float) -> MachineExit:
        """Graceful, as the QEMU runtime's: the guest agent's shutdown, then the ACPI power
        button, then destroyed at the end of the grace period."""
        libvirt = _libvirt()
        waiting = asyncio.ensure_future(self.wait())
        deadline = time.monotonic() + grace

        async def ended(by: float) -> bool:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting), max(0.0, by - time.monotonic()))
                return True
            return False

        try:
            try:
                await asyncio.wait_for(self.agent.shutdown(), max(0.1, min(2.0, grace / 2)))
                asked_agent = True
            except (GuestAgentUnavailable, MachineError, TimeoutError):
                asked_agent = False
            if not await ended(time.monotonic() + (grace / 2 if asked_agent else 0.0)):
                with contextlib.suppress(MachineError, libvirt.libvirtError):
                    domain = await self.connection.domain(self.uuid)
                    if domain is not None:
                        flag = libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN
                        await self.connection.run(domain.shutdownFlags, flag)
                if not await ended(deadline):
                    self._record(MachineExit(137, "Killed", f"not off after the {grace:g} s grace"))
                    await self._remove()
            return await waiting
        finally:
            waiting.cancel()

    async def end(self, outcome: MachineExit) -> MachineExit:
        waiting = asyncio.ensure_future(self.wait())
        try:
            self._record(outcome)
            await self._remove()
            return await waiting
        finally:
            waiting.cancel()

    async def kill(self) -> None:
        self._record(MachineExit(137, "Killed", "killed"))
        await self._remove()
        self._console.close()

    async def migrate_to(
        self,
        target: DomainTarget,
        report: Callable[[Progress], None],
        *,
        max_bandwidth: int | None = None,
    ) -> Outcome:
        """Live-migrate the domain to another libvirt host (`_lvmigrate`; an imported one's
        disks copied whole into files the target's daemon makes, `_lvimportmig`)."""
        if self.imported != bool(target.directory):
            whose = "an imported domain's" if target.directory else "a pod's own domain"
            raise MigrationError(f"the target pod is {whose} target, not this VM's")
        xml = None
        if self.copies is not None:  # its disks here, to know which were copies of ours
            with contextlib.suppress(MachineError, _libvirt().libvirtError):
                if (domain := await self.connection.domain(self.uuid)) is not None:
                    xml = await self.connection.run(domain.XMLDesc, 0)
        outcome = await migrate_domain(
            self.connection, self.uuid, target, report, max_bandwidth=max_bandwidth
        )
        if xml is not None and self.copies is not None:
            await self._discard_left_copies(xml, self.copies)
        return outcome

    async def _discard_left_copies(self, xml: str, root: Path) -> None:
        """The imported domain moved on: the copies of its disks an earlier move made here
        (`copies_in`) are no one's now. Deleted, unless the domain is still defined here."""
        libvirt = _libvirt()
        try:
            if await self.connection.domain(self.uuid) is not None:
                return
            for directory in copies_in(xml, root):
                await discard_copies(self.connection, directory)
                log.info(
                    "domain %s moved on: its disks' copies in %s deleted", self.uuid, directory
                )
        except (MachineError, libvirt.libvirtError) as e:
            log.warning("domain %s moved on; its disks' copies here stay: %s", self.uuid, e)

    async def follow_migration(self, report: Callable[[Progress], None]) -> Outcome:
        """The migration an earlier agent started, which the daemon runs on (`_lvmigrate`)."""
        return await follow_outgoing(self.connection, self.uuid, report)

    @property
    def reference(self) -> str:
        return self.uuid

    async def save_state(self, timeout: float) -> str:  # noqa: ASYNC109
        """Hibernate: libvirt's managed save (the guest paused, its memory and devices written
        to the daemon's host, the domain shut off with the image). Past `timeout` the save is
        aborted and the guest runs on (MachineError)."""
        libvirt = _libvirt()
        domain = await self.connection.domain(self.uuid)
        if domain is None:
            raise MachineError(f"domain {self.uuid} is gone")
        started = time.monotonic()
        saving = asyncio.ensure_future(self.connection.run(domain.managedSave, 0))
        try:
            await asyncio.wait_for(asyncio.shield(saving), timeout)
        except TimeoutError:
            with contextlib.suppress(libvirt.libvirtError):
                await self.connection.run(domain.abortJob)
            with contextlib.suppress(libvirt.libvirtError):
                await saving
            if not await self.connection.run(domain.hasManagedSaveImage, 0):
                raise MachineError(f"the managed save took longer than {timeout:g} s") from None
        except libvirt.libvirtError as e:
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        took = time.monotonic() - started
        return f"state saved by libvirt (managed save) in {took:.2f} s"

    async def usage(self) -> Usage:
        domain = await self.connection.domain(self.uuid)
        if domain is None:
            raise MachineError(f"domain {self.uuid} is gone")
        return await self.connection.run(_usage, domain)

    async def guest_address(self) -> str | None:
        """The guest's own IPv4 address (an imported domain's pod IP, `_guestaddr`): its guest
        agent's view; with no agent answering, a routed tap's peer in the live XML."""
        libvirt = _libvirt()
        domain = await self.connection.domain(self.uuid)
        if domain is None:
            return None
        agent = libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT
        try:
            return first_ipv4(await self.connection.run(domain.interfaceAddresses, agent, 0))
        except libvirt.libvirtError:
            return routed_peer(await self.connection.run(domain.XMLDesc, 0))

    async def _remove(self) -> None:
        """Destroy the domain if it runs and drop its definition (it is ours: checked when it
        was made or adopted); a hibernated one (a managed save image) is kept for its resume,
        an imported one's definition is the site's (it is only destroyed)."""
        libvirt = _libvirt()
        domain = await self.connection.domain(self.uuid)
        if domain is None:
            return
        with contextlib.suppress(libvirt.libvirtError):
            if await self.connection.run(domain.hasManagedSaveImage, 0):
                return
        with contextlib.suppress(libvirt.libvirtError):
            if await self.connection.run(domain.isActive):
                await self.connection.run(domain.destroy)
        if self.imported:
            return
        with contextlib.suppress(libvirt.libvirtError):
            await undefine(self.connection, domain)

    def _record(self, outcome: MachineExit) -> None:
        path = self.run_dir / "exit.json"
        if not path.exists():
            path.write_text(json.dumps(asdict(outcome)) + "\n")

    def _recorded(self) -> MachineExit | None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            return MachineExit(**json.loads((self.run_dir / "exit.json").read_text()))
        return None


class IncomingLibvirtMachine(LibvirtMachine):
    """A live migration's target (`_lvmigrate`): no domain yet, its pod's disks made; the
    domain arrives from the source's host under `target.domain`, labelled with this pod.
    Once `arrive` returned it is the running domain's machine like any other."""

    def __init__(
        self,
        connection: Connection,
        run_dir: Path,
        target: DomainTarget,
        *,
        imported: bool = False,
        copies: Path | None = None,
    ) -> None:
        super().__init__(connection, run_dir, "", -1, time.time(), imported=imported, copies=copies)
        self.target = target
        self._stopping = asyncio.Event()

    async def arrive(self) -> None:
        waiting = asyncio.ensure_future(
            arrival(self.connection, self.target.domain, self.target.owner[0], self._seen)
        )
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            raise MigrationError("the target pod stopped before the VM arrived")
        domain, uuid = waiting.result()
        self._adopt(uuid, await self.connection.run(domain.ID))
        await self._drop_pool()
        if self._console.ended.is_set():  # not opened while it came in
            await self.open_console(domain)

    async def _seen(self, domain: Any) -> None:
        """The domain exists here, paused while its state comes: its console stream is opened
        now, so the first thing the guest prints here is in the log."""
        with contextlib.suppress(MachineError, OSError, _libvirt().libvirtError):
            await self.open_console(domain)

    async def _drop_pool(self, *, discard: bool = False) -> None:
        """An imported domain's transient pool (`_incoming_pool`) ends: its files stay, the
        domain's disks now. `discard` (the domain never arrived): what libvirt created in it is
        a copy of a VM that runs on at its source, of the size of its disks: its volumes are
        deleted through the daemon (on its host), then the empty directory where the agent
        sees it."""
        if not self.target.directory:
            return
        libvirt = _libvirt()
        with contextlib.suppress(MachineError, libvirt.libvirtError):
            conn = await self.connection.get()
            name = pool_name(self.target.owner[0])
            pool = await self.connection.run(conn.storagePoolLookupByName, name)
            if discard:  # (no refresh: the pool made them; a failed refresh stops a pool)
                for volume in await self.connection.run(pool.listAllVolumes, 0):
                    await self.connection.run(volume.delete, 0)
            await self.connection.run(pool.destroy)
        if discard:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(Path(self.target.directory).rmdir)

    def _adopt(self, uuid: str, domain_id: int) -> None:
        self.uuid, self.pid = uuid, domain_id
        self.agent = LibvirtGuestAgent(self.connection, uuid)
        record: dict[str, object] = {"uri": self.connection.uri, "uuid": uuid, "id": domain_id}
        if self.imported:
            record["imported"] = True
        write_atomic(self.run_dir / DOMAIN_FILE, json.dumps({**record, "started": self.started}))

    async def kill(self) -> None:
        """Before the domain arrived: stop waiting, destroy a domain of this pod that is
        coming in (the source's libvirt then fails the migration and resumes the guest
        there), and discard an imported domain's copied disks unless it came after all; after,
        as any domain."""
        self._stopping.set()
        if self.uuid:
            await self._drop_pool()
            await super().kill()
            return
        self._record(MachineExit(137, "Killed", "killed before the VM arrived"))
        self._gone.set()
        self._console.close()
        await self._drop_pool(discard=not await self._destroy_incoming())

    async def _destroy_incoming(self) -> bool:
        """Destroy this pod's domain if one is coming in; whether one of this pod's is still
        defined here (it arrived after all: its disks are kept; so too when the daemon cannot
        tell)."""
        libvirt = _libvirt()
        try:
            conn = await self.connection.get()
            domain = await self.connection.run(conn.lookupByName, self.target.domain)
            owner = owner_of(await self.connection.metadata(domain, METADATA_URI))
            if owner is None or owner.pod_uid != self.target.owner[0]:
                return False  # another's: the pool and its directory are this pod's alone
            await self.connection.run(domain.destroy)  # a transient incoming one vanishes
            return bool(await self.connection.run(domain.isPersistent))
        except MachineError:
            return True
        except libvirt.libvirtError as e:
            return bool(_code(e) != libvirt.VIR_ERR_NO_DOMAIN)


def _usage(domain: Any) -> Usage:
    """CPU time and resident memory of the domain's QEMU, as libvirt reads them (`info` needs
    no cgroups; `memoryStats`' rss is the process's, else the guest's memory)."""
    info = domain.info()
    rss = domain.memoryStats().get("rss")
    memory = int(rss) * 1024 if rss else int(info[2]) * 1024
    return Usage(cpu_ns=int(info[4]), memory_bytes=memory)


class LibvirtRuntime(QemuRuntime):
    """`QemuRuntime`'s images, seed and network; machines as domains of `config.libvirt_uri`."""

    tools = ("qemu-img",)  # the disks are made here; QEMU runs where the daemon is

    def __init__(self, config: VMConfig, node_name: str) -> None:
        super().__init__(config)
        self.node_name = node_name
        self.connection = Connection(config.libvirt_uri)
        self.backup_staging: BackupStaging | None = None  # `libvirt.pool` sets its own
        self._copies = imported_root(config.state_dir).resolve()  # (as the targets name it)
        reserved = self.network.reserved
        self.network = libvirt_network(config, self._running_domains, reserved)

    async def _running_domains(self) -> list[str]:
        """The XML of every running domain of the daemon: the network's address book."""
        conn = await self.connection.get()
        return await self.connection.run(_running_xml, _libvirt(), conn)

    def _attached(self, key: str, network: GuestNetwork) -> GuestAddress:
        """No netns here: the domain's tap is on the daemon's host (`_lvnet`)."""
        return replace(super()._attached(key, network), netns=None)

    def _new_pod(self, xml: str, spec: LaunchSpec) -> str:
        """A hibernated domain's XML with the restoring pod's address and gateway on its
        interface (`_lvnet.retarget_network`)."""
        key = spec.network_key
        if key is None or (network := self._networks.get(key)) is None:
            return xml
        return retarget_network(xml, key, network)

    def _with_network(self, xml: str, key: str | None) -> str:
        """The domain's XML with the pod's interface (`_lvnet`), once its network is attached."""
        if key is None or (network := self._networks.get(key)) is None:
            return xml
        bridge = self.config.bridged.bridge if self.config.bridged is not None else None
        return with_network(xml, key, self.network.host_link(key), network, bridge=bridge)

    async def ping(self) -> None:
        """Unhealthy (the node NotReady) without qemu-img (disks are made here) or when the
        daemon cannot be reached: libvirt's message, with the URI. Within `PING_SECONDS`
        (the node's ping has 5 s): an SSH connection slower than that is still being made,
        and the message is the previous attempt's."""
        await super().ping()
        try:
            conn = await asyncio.wait_for(self.connection.get(), PING_SECONDS)
        except TimeoutError:
            last = self.connection.last_error
            raise MachineError(
                f"libvirt {self.connection.uri}: not connected after {PING_SECONDS:g} s"
                + (f"; the last attempt: {last}" if last else "")
            ) from None
        libvirt = _libvirt()
        try:
            await self.connection.run(conn.getLibVersion)
        except libvirt.libvirtError as e:
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None

    async def host_resources(self) -> tuple[int, int] | None:
        """The daemon's host's CPUs and memory (`virNodeGetInfo`): the node's capacity."""
        conn = await self.connection.get()
        info = await self.connection.run(conn.getInfo)  # [model, MiB, cpus, MHz, ...]
        return int(info[2]) * 1000, int(info[1]) * 2**20

    async def check_machine(
        self, namespace: str, name: str, pod_uid: str, *, restoring: str | None = None
    ) -> None:
        await self._existing(namespace, name, pod_uid, restoring)

    async def _existing(
        self, namespace: str, name: str, pod_uid: str, restoring: str | None = None
    ) -> Any:
        """The pod's domain if there is one; MachineRefused when a domain of its name is not
        the pod's (left as it is), unless it is the hibernated domain the pod restores (a pod
        of the machine named as the one that hibernated it)."""
        libvirt = _libvirt()
        conn = await self.connection.get()
        wanted = domain_name(namespace, name)
        try:
            domain = await self.connection.run(conn.lookupByName, wanted)
        except libvirt.libvirtError as e:
            if _code(e) == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        if restoring is not None and await self.connection.run(domain.UUIDString) == restoring:
            return None
        owner = owner_of(await self.connection.metadata(domain, METADATA_URI))
        if owner is None or owner.pod_uid != pod_uid:
            whose = "no vkubelet pod" if owner is None else f"pod UID {owner.pod_uid}"
            raise MachineRefused(
                "DomainExists",
                f"libvirt {self.connection.uri} has a domain {wanted!r} that is not this pod's "
                f"(its metadata names {whose}); it is left as it is: rename or remove it",
            )
        return domain

    async def launch(self, spec: LaunchSpec) -> MachineHandle:
        libvirt = _libvirt()
        namespace, _, name = spec.name.partition("/")
        pod_uid = spec.network_key or spec.run_dir.parent.name
        owner = Owner(pod_uid, namespace, name, self.node_name)
        if spec.domain is not None and spec.incoming:
            return await self._incoming_imported(spec, spec.domain, owner)
        if spec.domain is not None:
            return await self._launch_imported(spec, spec.domain, owner)
        resolved = replace(
            spec,
            disks=tuple((path.resolve(), bus) for path, bus in spec.disks),
            seed=spec.seed.resolve() if spec.seed is not None else None,
            claims=tuple((path.resolve(), serial) for path, serial in spec.claims),
        )
        if spec.restore is not None:
            return await self._restore(resolved, owner, spec.restore)
        if spec.incoming:
            return await self._incoming(resolved, owner)
        try:
            xml = domain_xml(resolved, owner, kvm=spec.accel == "kvm")
        except ValueError as e:
            raise MachineRefused("UnsupportedByRuntime", str(e)) from None
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("console.sock", "exit.json"):
            (spec.run_dir / stale).unlink(missing_ok=True)
        if spec.network_key is not None:
            await self.attach_network(spec.network_key, spec.network_address)
            xml = self._with_network(xml, spec.network_key)
        domain = await self._existing(namespace, name, pod_uid)
        if domain is not None and await self.connection.run(domain.isActive):
            log.info(
                "domain %s of pod %s runs already: taken as it is",
                domain_name(namespace, name),
                spec.name,
            )
            uuid = await self.connection.run(domain.UUIDString)
            return await self._handle(spec.run_dir, domain, uuid, _known_start(spec.run_dir, uuid))
        conn = await self.connection.get()
        try:
            domain = await self.connection.run(conn.defineXML, xml)
            uuid = await self.connection.run(domain.UUIDString)
            await self.connection.run(domain.createWithFlags, libvirt.VIR_DOMAIN_START_PAUSED)
            machine = await self._handle(spec.run_dir, domain, uuid, time.time())
            await self.connection.run(domain.resume)
        except (libvirt.libvirtError, OSError) as e:
            with contextlib.suppress(Exception):  # nothing half-made is left behind
                if domain is not None:
                    if await self.connection.run(domain.isActive):
                        await self.connection.run(domain.destroy)
                    await self.connection.run(domain.undefine)
            message = f"libvirt {self.connection.uri}: {message_of(e)}"
            if (refused := bridge_refused(self.config.bridged, message)) is not None:
                raise refused from None
            raise MachineError(message) from None
        return machine

    async def _incoming(self, spec: LaunchSpec, owner: Owner) -> MachineHandle:
        """A live migration's target: the pod's disks are made, no domain is defined (it
        arrives, `_lvmigrate`); a domain of the pod's name that is not the pod's refuses it."""
        if spec.extra_args or spec.claims:
            raise MachineRefused(
                "UnsupportedByRuntime",
                "the libvirt runtime cannot live-migrate a VM with PVC disks or hotplugged "
                "devices yet",
            )
        await self._existing(owner.namespace, owner.name, owner.pod_uid)
        uri = self._incoming_run_dir(spec)
        network = None
        if (key := spec.network_key) is not None:
            await self.attach_network(key, spec.network_address, standby=True)
            if (guest := self._networks.get(key)) is not None:
                bridged = self.config.bridged
                network = DomainNetwork(
                    key=key,
                    link=self.network.host_link(key),
                    address=guest.address,
                    prefix=guest.prefix,
                    gateway=guest.gateway,
                    bridge=bridged.bridge if bridged is not None else "",
                )
        target = DomainTarget(
            uri=uri,
            domain=domain_name(owner.namespace, owner.name),
            files=tuple(sorted(disk_files(spec).items())),
            owner=(owner.pod_uid, owner.namespace, owner.name, owner.node),
            network=network,
        )
        _record_incoming(spec.run_dir, target)
        return IncomingLibvirtMachine(self.connection, spec.run_dir, target)

    def _incoming_run_dir(self, spec: LaunchSpec) -> str:
        """A migration target's run directory, cleared of what a previous machine there left;
        the URI the source's daemon is to send the domain to."""
        try:
            uri = target_uri(self.connection.uri, self.config.libvirt_migration_uri)
        except MigrationError as e:
            raise MachineRefused("MigrationUnsupported", str(e)) from None
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("console.sock", "exit.json", DOMAIN_FILE, INCOMING_FILE):
            (spec.run_dir / stale).unlink(missing_ok=True)
        return uri

    async def _incoming_imported(
        self, spec: LaunchSpec, request: DomainImport, owner: Owner
    ) -> MachineHandle:
        """An imported domain's migration target (`_lvimportmig`): no files made here; a
        transient storage pool over `<stateDir>/imported/<pod uid>/`, built by this host's daemon,
        in which libvirt creates each disk's file as the copy arrives. A domain of that name on
        this host refuses it (DomainExists, left as it is)."""
        libvirt = _libvirt()
        conn = await self.connection.get()
        try:
            await self.connection.run(conn.lookupByName, request.name)
        except libvirt.libvirtError as e:
            if _code(e) != libvirt.VIR_ERR_NO_DOMAIN:
                raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        else:
            raise MachineRefused(
                "DomainExists",
                f"libvirt {self.connection.uri} has a domain {request.name!r} already: the "
                "imported domain cannot move to this host; it is left as it is",
            )
        uri = self._incoming_run_dir(spec)
        directory = str(imported_disks(self.config.state_dir, owner.pod_uid).resolve())
        await self._incoming_pool(owner.pod_uid, directory)
        target = DomainTarget(
            uri=uri,
            domain=request.name,
            files=(),
            owner=(owner.pod_uid, owner.namespace, owner.name, owner.node),
            directory=directory,
        )
        _record_incoming(spec.run_dir, target)
        return IncomingLibvirtMachine(
            self.connection, spec.run_dir, target, imported=True, copies=self._copies
        )

    async def _incoming_pool(self, pod_uid: str, directory: str) -> None:
        """The target's transient pool (`_lvimportmig.pool_xml`), its directory built by the
        daemon; one left by a previous agent of this pod is taken as it is."""
        libvirt = _libvirt()
        conn = await self.connection.get()
        with contextlib.suppress(libvirt.libvirtError):
            await self.connection.run(conn.storagePoolLookupByName, pool_name(pod_uid))
            return
        try:
            build = libvirt.VIR_STORAGE_POOL_CREATE_WITH_BUILD
            await self.connection.run(
                conn.storagePoolCreateXML, pool_xml(pod_uid, directory), build
            )
        except libvirt.libvirtError as e:
            raise MachineRefused(
                "MigrationUnsupported",
                f"libvirt {self.connection.uri}: no storage pool for the imported domain's "
                f"disks at {directory}: {message_of(e)}",
            ) from None

    async def _restore(self, spec: LaunchSpec, owner: Owner, uuid: str) -> MachineHandle:
        """The hibernated domain `uuid`, restored for this pod: its saved XML (the image's and
        the definition's) retargeted to the pod's files and metadata, then started paused
        until the console stream is open, as a boot is. RestoreFailed when the domain or its
        image is gone, or libvirt refuses it; MachineError when the daemon cannot be reached
        (tried again: the state is kept)."""
        libvirt = _libvirt()
        domain = await self.connection.domain(uuid)
        where = f"libvirt {self.connection.uri}: the hibernated domain {uuid}"
        if domain is None:
            raise RestoreFailed(f"{where} is gone")
        try:
            if await self.connection.run(domain.isActive):
                raise MachineError(f"{where} runs (started by someone else); not started twice")
            if not await self.connection.run(domain.hasManagedSaveImage, 0):
                raise RestoreFailed(f"{where} has no managed save image any more")
            saved = await self.connection.run(domain.managedSaveGetXMLDesc, 0)
            saved = self._new_pod(retarget(saved, spec, owner), spec)
            await self.connection.run(domain.managedSaveDefineXML, saved, 0)
            inactive = await self.connection.run(domain.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE)
            conn = await self.connection.get()
            await self.connection.run(
                conn.defineXML, self._new_pod(retarget(inactive, spec, owner), spec)
            )
            await self.connection.run(domain.createWithFlags, libvirt.VIR_DOMAIN_START_PAUSED)
        except (libvirt.libvirtError, ValueError) as e:
            raise RestoreFailed(f"{where}: {message_of(e)}") from None
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("console.sock", "exit.json"):
            (spec.run_dir / stale).unlink(missing_ok=True)
        try:
            machine = await self._handle(spec.run_dir, domain, uuid, time.time())
            await self.connection.run(domain.resume)
        except (libvirt.libvirtError, OSError) as e:
            with contextlib.suppress(Exception):  # restored, then lost: it boots cold
                await self.connection.run(domain.destroy)
                await undefine(self.connection, domain)
            raise RestoreFailed(f"{where}: {message_of(e)}") from None
        return machine

    async def discard_saved(self, reference: str) -> None:
        """A hibernated domain of ours that will not be restored: its image and definition
        removed (an imported one's image only: its definition is the site's). One that runs
        (someone started it) or is not ours is left as it is."""
        libvirt = _libvirt()
        domain = await self.connection.domain(reference)
        if domain is None:
            return
        metadata = await self.connection.metadata(domain, METADATA_URI)
        if owner_of(metadata) is None or await self.connection.run(domain.isActive):
            return
        imported = claim_of(await self.connection.metadata(domain, IMPORT_URI)) is not None
        flags = libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
        try:
            if imported:
                await self.connection.run(domain.managedSaveRemove, 0)
                return
            await undefine(self.connection, domain, flags)
        except libvirt.libvirtError as e:
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None

    async def _handle(
        self, run_dir: Path, domain: Any, uuid: str, started: float, *, imported: bool = False
    ) -> LibvirtMachine:
        domain_id = await self.connection.run(domain.ID)
        record = {"uri": self.connection.uri, "uuid": uuid, "id": domain_id, "started": started}
        if imported:
            record["imported"] = True
        write_atomic(run_dir / DOMAIN_FILE, json.dumps(record) + "\n")
        machine = LibvirtMachine(
            self.connection, run_dir, uuid, domain_id, started, imported=imported,
            staging=self.backup_staging, copies=self._copies if imported else None,
        )  # fmt: skip
        await machine.open_console(domain)
        return machine

    async def adopt(self, run_dir: Path) -> MachineHandle | None:
        """The domain `domain.json` names, if it still runs; one that shut off while no agent
        ran has its outcome recorded (the provider reads it) and its definition removed. While
        the daemon cannot be reached this waits and asks again: a VM that may be running is
        never taken for ended (the node is NotReady meanwhile, saying why)."""
        try:
            record = json.loads((run_dir / DOMAIN_FILE).read_text())
            uuid = str(record["uuid"])
        except (OSError, ValueError, KeyError):
            return self._incoming_of(run_dir)
        libvirt = _libvirt()
        retry = Backoff(initial=1.0, cap=30.0)
        while True:
            try:
                domain = await self.connection.domain(uuid)
                break
            except MachineError as e:
                log.warning("%s: cannot adopt its domain yet: %s", run_dir.parent.name, e)
                await asyncio.sleep(retry.next_delay())
        if domain is None:
            return None
        state, reason = await self.connection.run(domain.state)
        if (state, reason) == (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED):
            return None  # it left for another host a moment ago (libvirt undefines it here)
        machine = LibvirtMachine(
            self.connection,
            run_dir,
            uuid,
            int(record.get("id", -1)),
            float(record["started"]),
            imported=bool(record.get("imported")),
            staging=self.backup_staging,
            copies=self._copies if record.get("imported") else None,
        )
        if (outcome := _outcome(libvirt, state, reason)) is not None:
            machine._record(outcome)
            await machine._remove()
            return None
        await machine.open_console(domain)
        return machine

    def _incoming_of(self, run_dir: Path) -> IncomingLibvirtMachine | None:
        """The migration target a previous agent left waiting in `run_dir` (None: not one):
        libvirt's daemon receives the domain without the agent, so this one waits again."""
        try:
            target = DomainTarget.from_data(json.loads((run_dir / INCOMING_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        imported = bool(target.directory)
        copies = self._copies if imported else None
        return IncomingLibvirtMachine(
            self.connection, run_dir, target, imported=imported, copies=copies
        )

    # -- imported domains (`_domainimport`): started and stopped, never defined or undefined --
    async def check_import(self, request: DomainImport) -> str:
        domain = await self._importable(request)
        return str(await self.connection.run(domain.UUIDString))

    async def _importable(self, request: DomainImport) -> Any:
        """The domain `request` names, if it can be the machine's (reads only); else
        MachineRefused with `_domainimport.refusal`'s reason, or DomainNotFound."""
        libvirt = _libvirt()
        conn = await self.connection.get()
        where = f"libvirt {self.connection.uri}: domain {request.name!r}"
        try:
            domain = await self.connection.run(conn.lookupByName, request.name)
            xml = await self.connection.run(domain.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE)
            persistent = await self.connection.run(domain.isPersistent)
        except libvirt.libvirtError as e:
            if _code(e) == libvirt.VIR_ERR_NO_DOMAIN:
                raise MachineRefused(
                    "DomainNotFound",
                    f"{where} does not exist: a domain is imported on the node whose libvirt "
                    "host defines it",
                ) from None
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        if not persistent:
            raise MachineRefused(
                "DomainUnsupported", f"{where} is transient: virsh define it to import it"
            )
        claim = claim_of(await self.connection.metadata(domain, IMPORT_URI))
        pod_owner = owner_of(await self.connection.metadata(domain, METADATA_URI))
        if (refused := refusal(where, request, xml, claim, pod_owner)) is not None:
            raise MachineRefused(*refused)
        return domain

    async def _launch_imported(
        self, spec: LaunchSpec, request: DomainImport, owner: Owner
    ) -> MachineHandle:
        """The imported domain, claimed in its metadata (the machine's import element and the
        pod's element) and started as it is defined, paused until the console stream is open
        as a boot of ours (a hibernated one, `spec.restore`, is restored by that start; its
        image gone, RestoreFailed: it boots cold); one that runs already is taken as it runs.
        Its definition is otherwise untouched."""
        libvirt = _libvirt()
        domain = await self._importable(request)
        if spec.restore is not None:  # its hibernation: libvirt's start restores the image
            where = f"libvirt {self.connection.uri}: the hibernated domain {request.name!r}"
            try:
                if await self.connection.run(domain.isActive):
                    raise RestoreFailed(f"{where} runs (started by someone else)")
                if not await self.connection.run(domain.hasManagedSaveImage, 0):
                    raise RestoreFailed(f"{where} has no managed save image any more")
            except libvirt.libvirtError as e:
                raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("console.sock", "exit.json"):
            (spec.run_dir / stale).unlink(missing_ok=True)
        started_here = False
        try:
            uuid = await self.connection.run(domain.UUIDString)
            active = await self.connection.run(domain.isActive)
            await self._drop_backup_checkpoints(domain)
            flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
            if active:
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
            element = libvirt.VIR_DOMAIN_METADATA_ELEMENT
            claim = ImportClaim.of(request, self.node_name).xml()
            pod = ET.tostring(owner.element(), encoding="unicode")
            await self.connection.run(
                domain.setMetadata, element, claim, "vkubelet-import", IMPORT_URI, flags
            )
            await self.connection.run(
                domain.setMetadata, element, pod, "vkubelet", METADATA_URI, flags
            )
            if active:
                log.info("imported domain %s runs already: taken as it is", request.name)
                started = _known_start(spec.run_dir, uuid)
                return await self._handle(spec.run_dir, domain, uuid, started, imported=True)
            await self.connection.run(domain.createWithFlags, libvirt.VIR_DOMAIN_START_PAUSED)
            started_here = True
            machine = await self._handle(spec.run_dir, domain, uuid, time.time(), imported=True)
            await self.connection.run(domain.resume)
        except (libvirt.libvirtError, OSError) as e:
            with contextlib.suppress(Exception):  # started here, then lost: off, still defined
                if started_here:
                    await self.connection.run(domain.destroy)
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None
        return machine

    async def release_import(self, uuid: str, machine: str, *, delete: bool) -> None:
        libvirt = _libvirt()
        domain = await self.connection.domain(uuid)
        if domain is None:
            return
        claim = claim_of(await self.connection.metadata(domain, IMPORT_URI))
        if claim is None or claim.machine != machine:
            return  # not (or no longer) this machine's: someone else's now
        try:
            active = await self.connection.run(domain.isActive)
            if delete:
                if active:
                    await self.connection.run(domain.destroy)
                flags = (
                    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                    | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                )
                more = (  # what a site's domain may have that plain undefine refuses to drop
                    libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
                    | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
                )
                await undefine(self.connection, domain, flags, optional=more)
                log.info("imported domain %s undefined (deletion policy Delete)", uuid)
                return
            await self._drop_backup_checkpoints(domain)
            flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
            if active:
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
            element = libvirt.VIR_DOMAIN_METADATA_ELEMENT
            for uri in (METADATA_URI, IMPORT_URI):
                await self.connection.run(domain.setMetadata, element, None, None, uri, flags)
        except libvirt.libvirtError as e:
            raise MachineError(f"libvirt {self.connection.uri}: {message_of(e)}") from None

    async def _drop_backup_checkpoints(self, domain: Any) -> None:
        """A retained domain goes back without vkubelet's backup checkpoints (`virsh undefine`
        refuses a domain with any). libvirt 9 deletes a shut-off domain's checkpoint only as
        metadata: the disk keeps its small bitmap (16 KiB per GiB), which the site can drop
        with `qemu-img bitmap --remove`."""
        libvirt = _libvirt()
        try:
            checkpoints = await self.connection.run(domain.listAllCheckpoints, 0)
        except libvirt.libvirtError:  # a driver without checkpoints has none of ours
            return
        for checkpoint in checkpoints:
            name = str(checkpoint.getName())
            if not name.startswith(CHAIN_PREFIX):
                continue  # the site's own
            try:
                try:
                    await self.connection.run(checkpoint.delete, 0)
                except libvirt.libvirtError as e:
                    if e.get_error_code() != libvirt.VIR_ERR_OPERATION_UNSUPPORTED:
                        raise
                    only = libvirt.VIR_DOMAIN_CHECKPOINT_DELETE_METADATA_ONLY
                    await self.connection.run(checkpoint.delete, only)
                    log.info("backup checkpoint %s dropped; its bitmap stays in the disk", name)
            except libvirt.libvirtError as e:  # kept: the domain is released all the same
                log.warning("could not delete backup checkpoint %s: %s", name, message_of(e))

    async def probe_accel(self, mode: str) -> tuple[str, str]:
        """KVM when the config says so, or (auto) when the host's libvirt offers it; else TCG."""
        if mode in ("tcg", "kvm"):
            return mode, f"accel: {mode} in the config"
        conn = await self.connection.get()
        capabilities = await self.connection.run(conn.getCapabilities)
        if "<domain type='kvm'" in capabilities or '<domain type="kvm"' in capabilities:
            return "kvm", f"libvirt {self.connection.uri} offers KVM"
        return "tcg", f"libvirt {self.connection.uri} offers no KVM: TCG"


def _record_incoming(run_dir: Path, target: DomainTarget) -> None:
    """A migration target's `DomainTarget`, for an agent restarted before the domain came
    (`LibvirtRuntime._incoming_of`)."""
    write_atomic(run_dir / INCOMING_FILE, json.dumps(target.to_data()) + "\n")


def _known_start(run_dir: Path, uuid: str) -> float:
    """When the running domain started, as recorded (now, if not recorded for this domain)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        record = json.loads((run_dir / DOMAIN_FILE).read_text())
        if record["uuid"] == uuid:
            return float(record["started"])
    return time.time()


def _running_xml(libvirt: Any, conn: Any) -> list[str]:
    """Each running domain's XML (one that ended meanwhile is skipped)."""
    found = []
    for domain in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
        with contextlib.suppress(libvirt.libvirtError):
            found.append(domain.XMLDesc(0))
    return found
