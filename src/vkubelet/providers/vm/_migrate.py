"""Live migration between two vm nodes: QEMU's migration over TCP, disks mirrored over NBD.

No shared storage is assumed, so the disks travel too, the way libvirt moves them:
- Target (a pod annotated `vm.vkubelet.io/migration-source`): QEMU starts with the same machine
  shape and `-incoming defer`, its disks made as for any pod and exported writable over NBD
  (`nbd-server-start` + `block-export-add`, one export per disk, named `disk<N>`). The agent
  listens on the node's address for three things and reports them as the pod condition
  `vm.vkubelet.io/MigrationTarget` (message: the endpoint JSON): the NBD port, the migration
  port and the console port.
- Source (`vm.vkubelet.io/migrate-to: <that JSON>`): `blockdev-mirror` (sync full, copy-mode
  write-blocking) of every disk onto the target's exports until every job is ready (in sync,
  and from then on each guest write reaches both sides before it completes), then `migrate` with
  a small downtime limit. At the switchover QEMU stops the guest, so the mirrors hold the last
  write; the jobs are then cancelled (a ready mirror's cancel completes it without pivoting: the
  source keeps its own disks, the target's are a consistent copy). Then the source's console
  history goes to the target's console port, whose answer says whether the guest runs there:
  only then does the source QEMU quit; if the target could not load the state, the source
  resumes the guest (`cont`: its RAM and disks are still whole here).
- The console port (`ConsolePort`) is the libvirt runtime's too: there the daemons move the
  domain (`_lvmigrate`), then the source's agent sends its history the same way.
- Failure at any point before the switchover (target gone, a mirror error, QEMU's migration
  failing): the migration is cancelled, the mirror jobs are dropped, and the guest runs on at
  the source (QEMU resumes it itself when the migration fails after stopping it).

Every connection to the target's three ports must start with the migration's token (the pod
annotation `vm.vkubelet.io/migration-token`, made by the controller): the agent checks it before
QEMU sees a byte, so nobody else on the network can feed the target a machine or its disks.
The switchover waits for the source agent's `migrate-continue` (pause-before-switchover), and
the source records its migration's state on disk: a restarted agent on either side finishes the
migration or rolls it back from that record and QEMU's own state (`_migrations`).

This module is the engine and knows no pod; `_migrations` is the pods' side.

QEMU runs inside the VM's network namespace, which has no route to other nodes, so it never
opens a TCP socket itself: the agent does, in the host namespace, and hands QEMU the descriptor
(`getfd`): the migration stream on both sides (`fd:` URIs) and the NBD server's listening socket
on the target. QEMU's NBD client cannot take a descriptor in QEMU 7.2, so on the source it dials
a unix socket in the VM's directory and the agent relays that to the target's NBD port.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._qmp import EventListener, ExecuteError, Monitor, MonitorUnavailable

__all__ = [
    "MIGRATE_TO",
    "MIGRATION_CONDITION",
    "MIGRATION_SOURCE",
    "TARGET_CONDITION",
    "ConsolePort",
    "DomainNetwork",
    "DomainTarget",
    "Endpoint",
    "IncomingMigration",
    "MigrationError",
    "Outcome",
    "block_jobs",
    "drop_jobs",
    "hand_over",
    "migrate_out",
    "until_running",
]

log = logging.getLogger(__name__)

MIGRATION_SOURCE = "vm.vkubelet.io/migration-source"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_CONDITION = "vm.vkubelet.io/MigrationTarget"
MIGRATION_CONDITION = "vm.vkubelet.io/Migration"
# The per-migration secret (on both pods, set by the controller): every connection to the
# target's ports must start with it (see `_authenticated`). Never logged, never in a condition.
MIGRATION_TOKEN = "vm.vkubelet.io/migration-token"  # noqa: S105 - its name, not its value
_TOKEN_TIMEOUT = 10.0
_TOKEN_MAX = 256
# How long the target keeps the source's console connection open for its verdict (the guest
# runs here, or the state could not be loaded); the source then asks the API instead.
VERDICT_TIMEOUT = 60.0
RUNNING = "running"  # the target's verdict when the guest runs there; else "failed: <why>"

DEFAULT_BANDWIDTH = 128 * 2**20
DOWNTIME_LIMIT_MS = 50  # issue 13's target; QEMU measured 15-26 ms here
# The migration stream's socket buffers (each side). Left to the kernel, loopback's autotuning
# grows the receive buffer to megabytes: the source then measures the speed at which it fills
# that buffer, not the speed at which the target loads, sizes its last round by it, and stops the
# guest while the target still has megabytes to read; the guest waits for the target to catch
# up, a wait QEMU's downtime figure does not even count. Small buffers make the source feel
# the target's pace. 256 KiB still carries more than the default 128 MiB/s at a 1 ms RTT.
STREAM_BUFFER = 256 * 1024
POLL = 0.05


class MigrationError(RuntimeError):
    """The migration failed; the message says why (it goes into the pod condition)."""


def _preamble(token: str) -> bytes:
    return token.encode() + b"\n"


def _token_ok(line: bytes, token: str) -> bool:
    return hmac.compare_digest(line.rstrip(b"\n"), token.encode())


async def _read_line(loop: asyncio.AbstractEventLoop, connection: socket.socket) -> bytes:
    """The preamble of a raw socket, byte by byte: not one byte of what follows (QEMU's
    stream) may be consumed."""
    line = b""
    while not line.endswith(b"\n") and len(line) < _TOKEN_MAX:
        byte = await loop.sock_recv(connection, 1)
        if not byte:
            break
        line += byte
    return line


def _refused(port: str, peer: object) -> None:
    log.warning("refused a connection to the migration %s port from %s: wrong token", port, peer)


@dataclass(frozen=True)
class DomainNetwork:
    """The target pod's network, for the domain's interface there (`_lvnet`): the tap's name
    and host side (routed) or the bridge (bridged), and the metadata's record."""

    key: str  # the target pod's UID
    link: str
    address: str
    prefix: int
    gateway: str
    bridge: str = ""

    @classmethod
    def from_data(cls, data: Any) -> DomainNetwork:
        return cls(
            key=str(data["key"]),
            link=str(data["link"]),
            address=str(data["address"]),
            prefix=int(data["prefix"]),
            gateway=str(data["gateway"]),
            bridge=str(data.get("bridge") or ""),
        )


@dataclass(frozen=True)
class DomainTarget:
    """A libvirt target (`_lvmigrate`): the target host's daemon as the source host's daemon
    reaches it, the domain's name there, the target pod's file for each disk (vda: ...) and
    the target pod (`<metadata>`: uid, namespace, name, node). An imported domain's target
    (`_lvimportmig`) names no files: `directory` is where its disks are copied, whole, into
    files the target's daemon creates (a storage pool's)."""

    uri: str
    domain: str
    files: tuple[tuple[str, str], ...]  # (target dev, file), sorted
    owner: tuple[str, str, str, str]  # pod uid, namespace, name, node
    network: DomainNetwork | None = None
    directory: str = ""  # an imported domain's target only

    def to_data(self) -> dict[str, Any]:
        uid, namespace, name, node = self.owner
        data: dict[str, Any] = {
            "uri": self.uri,
            "domain": self.domain,
            "files": dict(self.files),
            "pod": {"uid": uid, "namespace": namespace, "name": name, "node": node},
        }
        if self.network is not None:
            data["network"] = asdict(self.network)
        if self.directory:
            data["directory"] = self.directory
        return data

    @classmethod
    def from_data(cls, data: Any) -> DomainTarget:
        pod = data["pod"]
        return cls(
            uri=str(data["uri"]),
            domain=str(data["domain"]),
            files=tuple(sorted((str(k), str(v)) for k, v in dict(data["files"]).items())),
            owner=(str(pod["uid"]), str(pod["namespace"]), str(pod["name"]), str(pod["node"])),
            network=DomainNetwork.from_data(data["network"]) if data.get("network") else None,
            directory=str(data.get("directory") or ""),
        )


@dataclass(frozen=True)
class Endpoint:
    """Where the target listens. The controller copies it from the target's condition into the
    source's `migrate-to` annotation; `maxBandwidth` (bytes/s) may be added there. A libvirt
    target (`libvirt`) has no migration or NBD port of the agent's: the source's daemon reaches
    the target's (those ports are 0); its console port takes the history as on QEMU (0: it
    takes none), `disks` are the target devices the migration copies."""

    host: str
    migration_port: int
    nbd_port: int
    console_port: int
    disks: tuple[str, ...]  # NBD export names, in the machine's disk order
    max_bandwidth: int | None = None
    pod: str = ""  # the target pod (same namespace): the source checks the endpoint against it
    libvirt: DomainTarget | None = None

    @property
    def target(self) -> str:
        """Which target a Migration condition speaks of (its messages carry it)."""
        return f"{self.host}:{self.migration_port}"

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "host": self.host,
            "migrationPort": self.migration_port,
            "nbdPort": self.nbd_port,
            "consolePort": self.console_port,
            "disks": list(self.disks),
        }
        if self.pod:
            data["pod"] = self.pod
        if self.max_bandwidth is not None:
            data["maxBandwidth"] = self.max_bandwidth
        if self.libvirt is not None:
            data["libvirt"] = self.libvirt.to_data()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Endpoint:
        try:
            data = json.loads(text)
            bandwidth = data.get("maxBandwidth")
            target = DomainTarget.from_data(data["libvirt"]) if "libvirt" in data else None
            port = _port if target is None else _no_port
            console = _port if target is None else _console_port
            return cls(
                host=str(data["host"]),
                migration_port=port(data["migrationPort"]),
                nbd_port=port(data["nbdPort"]),
                console_port=console(data["consolePort"]),
                disks=tuple(str(d) for d in data["disks"]),
                max_bandwidth=int(bandwidth) if bandwidth is not None else None,
                pod=str(data.get("pod") or ""),
                libvirt=target,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MigrationError(f"{MIGRATE_TO}: not a migration endpoint ({e})") from None


def _port(value: object) -> int:
    port = int(str(value))
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def _no_port(value: object) -> int:
    if int(str(value)) != 0:
        raise ValueError("a libvirt target has no ports of the agent's but its console port (0)")
    return 0


def _console_port(value: object) -> int:
    """A libvirt target's console port: 0 when it takes no console history (an imported
    domain's target)."""
    return 0 if int(str(value)) == 0 else _port(value)


@dataclass(frozen=True)
class Outcome:
    downtime_ms: int
    total_ms: int  # QEMU's total-time of the RAM migration
    wall_ms: int  # mirror + migration, as the agent saw it
    ram_bytes: int
    disk_bytes: int


@dataclass
class Progress:
    phase: str = "mirroring"  # mirroring | migrating
    disk_done: int = 0
    disk_total: int = 0
    ram_done: int = 0
    ram_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def percent(self) -> int:
        total = self.disk_total + self.ram_total
        return min(99, (self.disk_done + self.ram_done) * 100 // total) if total else 0

    def message(self) -> str:
        return json.dumps({"phase": self.phase, "progress": self.percent, **self.extra})


async def _disk_devices(monitor: Monitor) -> dict[str, str]:
    """The machine's writable disks (`disk<N>` block backends) -> their node names."""
    devices = {}
    for block in await monitor.execute("query-block"):
        name, inserted = block.get("device", ""), block.get("inserted")
        if name.startswith("disk") and inserted and not inserted.get("ro"):
            devices[name] = inserted["node-name"]
    return dict(sorted(devices.items(), key=lambda item: int(item[0][4:] or 0)))


# -- target --------------------------------------------------------------------------------------
async def _authenticated(reader: asyncio.StreamReader, token: str, port: str, peer: object) -> bool:
    """Whether a connection to one of the target's ports starts with the migration's token."""
    try:
        line = await asyncio.wait_for(reader.readline(), _TOKEN_TIMEOUT)
    except (TimeoutError, OSError, ValueError):
        line = b""
    if _token_ok(line, token):
        return True
    _refused(port, peer)
    return False


class ConsolePort:
    """The target's console port, on either runtime: after the switchover the source sends its
    console history here (the migration's token first, then its CRI log to EOF), and reads back
    one line, the target's verdict: `RUNNING` or `failed: <why>`. On QEMU the verdict decides
    whether the source quits its QEMU or resumes the guest (`_migrations`); on libvirt the
    daemons decided already and the verdict only tells the source that the history was taken.
    One port, one token check and one verdict for both, so a history is never taken from
    anyone but the migration's source."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._server: asyncio.Server | None = None
        self._history: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._verdict: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._answered = asyncio.Event()

    async def open(self, host: str, port: int = 0) -> int:
        """Listen on `host` (on `port` if it is free: the one an earlier agent published);
        the port. MigrationError without a token: a port anybody could feed a history would
        put their lines in the pod's log."""
        if not self.token:
            raise MigrationError(f"the target pod has no {MIGRATION_TOKEN}")
        try:
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError:
            if not port:
                raise
            self._server = await asyncio.start_server(self._serve, host, 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The source's console history in; our verdict out (`confirm`/`fail`)."""
        try:
            peer = writer.get_extra_info("peername")
            if not await _authenticated(reader, self.token, "console", peer):
                return
            data = await reader.read()
            if not self._history.done():
                self._history.set_result(data)
            with contextlib.suppress(TimeoutError, OSError):
                verdict = await asyncio.wait_for(asyncio.shield(self._verdict), VERDICT_TIMEOUT)
                writer.write(verdict.encode() + b"\n")
                await writer.drain()
                self._answered.set()
        finally:
            writer.close()

    def confirm(self) -> None:
        """The guest runs here."""
        if not self._verdict.done():
            self._verdict.set_result(RUNNING)

    def fail(self, why: str) -> None:
        """The guest does not run here and never will."""
        if not self._verdict.done():
            self._verdict.set_result(f"failed: {why}"[:_TOKEN_MAX])

    async def answered(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until a source got the verdict, or `timeout`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), timeout)

    async def history(self, timeout: float) -> bytes:  # noqa: ASYNC109
        """The source's console history (CRI log lines), b"" when none came in time."""
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(self._history), timeout)
        return b""

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


class IncomingMigration:
    """The target's side: QEMU waits (`-incoming defer`) for the state, its disks exported."""

    def __init__(
        self,
        monitor: Monitor,
        host: str,
        token: str,
        nbd_socket: Path,
        *,
        stream_buffer: int = STREAM_BUFFER,
    ) -> None:
        self.monitor, self.host, self.token, self.nbd_socket = monitor, host, token, nbd_socket
        self.stream_buffer = stream_buffer  # 0: the kernel's autotuning
        self._servers: list[asyncio.Server] = []
        self._sockets: list[socket.socket] = []
        self._accepting: asyncio.Task[None] | None = None
        self.console = ConsolePort(token)
        self.streaming = False  # QEMU has the incoming stream

    async def open(self) -> Endpoint:
        if not self.token:
            raise MigrationError(f"the target pod has no {MIGRATION_TOKEN}")
        devices = await _disk_devices(self.monitor)
        # QEMU's NBD server listens on a unix socket only the agent reaches; the agent's TCP
        # port checks the token, then relays (QEMU 7.2's NBD server has no such check but TLS).
        self.nbd_socket.unlink(missing_ok=True)
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        local.bind(str(self.nbd_socket))
        local.listen()
        self._sockets.append(local)
        await self.monitor.pass_fd("migration-nbd", local.fileno())
        address = {"type": "fd", "data": {"str": "migration-nbd"}}  # SocketAddressLegacy
        await self.monitor.execute("nbd-server-start", {"addr": address})
        for device, node in devices.items():
            arguments = {"type": "nbd", "id": device, "node-name": node, "writable": True}
            await self.monitor.execute("block-export-add", {**arguments, "name": device})
        # Not an asyncio server: the loop would read the stream's first bytes before QEMU.
        migration = socket.create_server((self.host, 0))
        if self.stream_buffer:  # before any connection: accepted sockets inherit it
            migration.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.stream_buffer)
        migration.setblocking(False)
        self._sockets.append(migration)
        self._accepting = asyncio.create_task(self._incoming(migration))
        console_port = await self.console.open(self.host)
        nbd = await asyncio.start_server(self._nbd, self.host, 0)
        self._servers.append(nbd)
        return Endpoint(
            host=self.host,
            migration_port=migration.getsockname()[1],
            nbd_port=nbd.sockets[0].getsockname()[1],
            console_port=console_port,
            disks=tuple(devices),
        )

    async def _incoming(self, listener: socket.socket) -> None:
        """The first connection with the token is the migration stream: QEMU reads it, we
        never do (past the token's line)."""
        loop = asyncio.get_running_loop()
        while True:
            connection, peer = await loop.sock_accept(listener)
            try:
                line = await asyncio.wait_for(_read_line(loop, connection), _TOKEN_TIMEOUT)
            except (TimeoutError, OSError):
                line = b""
            if _token_ok(line, self.token):
                break
            _refused("stream", peer)
            connection.close()
        listener.close()  # one migration per target
        try:
            await self.monitor.pass_fd("migration-in", connection.fileno())
            await self.monitor.execute("migrate-incoming", {"uri": "fd:migration-in"})
            self.streaming = True
        except (MonitorUnavailable, ExecuteError):
            pass  # QEMU gone: wait() says so
        finally:
            connection.close()  # QEMU holds its own copy of the descriptor

    async def _nbd(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The source's NBD client (through its agent's relay) -> QEMU's NBD server."""
        if not await _authenticated(reader, self.token, "NBD", writer.get_extra_info("peername")):
            writer.close()
            return
        try:
            local_reader, local_writer = await asyncio.open_unix_connection(str(self.nbd_socket))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, local_writer), _pipe(local_reader, writer))

    def confirm(self) -> None:
        """The guest runs here: the source may quit its QEMU."""
        self.console.confirm()

    def fail(self, why: str) -> None:
        """The guest does not run here and never will (QEMU is gone): the source resumes it."""
        self.console.fail(why)

    async def answered(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until a source got the verdict, or `timeout`."""
        await self.console.answered(timeout)

    async def wait(self) -> None:
        """Until the guest runs here; MigrationError when QEMU went away (its incoming side
        failed: it exits) first."""
        await until_running(self.monitor)

    async def history(self, timeout: float) -> bytes:  # noqa: ASYNC109
        """The source's console history (CRI log lines), b"" when none came in time."""
        return await self.console.history(timeout)

    async def stop_exports(self) -> None:
        with contextlib.suppress(MonitorUnavailable, ExecuteError):
            await self.monitor.execute("nbd-server-stop")

    async def close(self) -> None:
        if self._accepting is not None and not self._accepting.done():
            self._accepting.cancel()
        self.console.close()
        for server in self._servers:
            server.close()
        self._servers.clear()
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        self.nbd_socket.unlink(missing_ok=True)


# -- source --------------------------------------------------------------------------------------
async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(256 * 1024):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()


async def _relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    host: str,
    port: int,
    token: str,
) -> None:
    """QEMU's NBD client (unix socket) <-> the target's NBD port (TCP), the token first."""
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        upstream_writer.write(_preamble(token))
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def block_jobs(monitor: Monitor) -> dict[str, dict[str, Any]]:
    return {job["id"]: job for job in await monitor.execute("query-jobs")}


async def drop_jobs(monitor: Monitor, ids: Sequence[str]) -> None:
    """Cancel what runs, dismiss what ended (best effort: used on the failure path)."""
    with contextlib.suppress(MonitorUnavailable):
        for job_id in ids:
            with contextlib.suppress(ExecuteError):
                await monitor.execute("block-job-cancel", {"device": job_id, "force": True})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            jobs = await block_jobs(monitor)
            pending = [j for j in ids if j in jobs]
            for job_id in pending:
                if jobs[job_id]["status"] == "concluded":
                    with contextlib.suppress(ExecuteError):
                        await monitor.execute("job-dismiss", {"id": job_id})
            if not pending:
                return
            await asyncio.sleep(POLL)


async def migrate_out(
    monitor: Monitor,
    endpoint: Endpoint,
    relay_socket: Path,
    report: Callable[[Progress], None],
    *,
    token: str,
    stream_buffer: int = STREAM_BUFFER,
) -> Outcome:
    """Mirror every disk to the target, migrate, complete the mirrors; MigrationError (the
    guest still running here) when anything fails before the switchover. `stream_buffer` 0
    leaves the stream's buffers to the kernel (the former tuning; bench/vm_resource.py compares
    the two)."""
    started = time.monotonic()
    devices = list(await _disk_devices(monitor))
    if len(devices) != len(endpoint.disks):
        raise MigrationError(
            f"the target exports {len(endpoint.disks)} disk(s), this VM has {len(devices)}"
        )
    relay_socket.unlink(missing_ok=True)  # noqa: ASYNC240 - a local unlink
    relay = await asyncio.start_unix_server(
        lambda r, w: _relay(r, w, endpoint.host, endpoint.nbd_port, token),
        path=str(relay_socket),
    )
    jobs = [f"migrate-{device}" for device in devices]
    nodes = [f"migrate-nbd-{device}" for device in devices]
    progress = Progress()
    migrating = False
    try:
        try:
            memory = await monitor.execute("query-memory-size-summary")
            progress.ram_total = int(memory.get("base-memory", 0))
            for device, export, job, node in zip(devices, endpoint.disks, jobs, nodes, strict=True):
                server = {"type": "unix", "path": str(relay_socket)}
                nbd = {"driver": "nbd", "node-name": node, "server": server, "export": export}
                await monitor.execute("blockdev-add", nbd)
                await monitor.execute(
                    "blockdev-mirror",
                    {
                        "job-id": job,
                        "device": device,
                        "target": node,
                        "sync": "full",
                        "copy-mode": "write-blocking",
                        "auto-dismiss": False,
                    },
                )
            await _until_mirrored(monitor, jobs, progress, report)
            parameters: dict[str, Any] = {
                "downtime-limit": DOWNTIME_LIMIT_MS,
                # Always set: parameters outlive a migration (QEMU's default: 128 MiB/s).
                "max-bandwidth": endpoint.max_bandwidth or DEFAULT_BANDWIDTH,
            }
            await monitor.execute("migrate-set-parameters", parameters)
            # The switchover waits for this agent's word (`_until_migrated`): an agent that died
            # meanwhile (its NBD relay with it) can never let a guest run on with stale disks.
            capabilities = [
                {"capability": "pause-before-switchover", "state": True},
                {"capability": "events", "state": True},
            ]
            await monitor.execute("migrate-set-capabilities", {"capabilities": capabilities})
            stream = socket.create_connection((endpoint.host, endpoint.migration_port), 10)
            try:
                if stream_buffer:
                    stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, stream_buffer)
                stream.sendall(_preamble(token))
                await monitor.pass_fd("migration-out", stream.fileno())
            finally:
                stream.close()  # QEMU has its own copy
            progress.phase = "migrating"
            migrating = True
            await monitor.execute("migrate", {"uri": "fd:migration-out"})
            info = await _until_migrated(monitor, jobs, progress, report)
        except (ExecuteError, OSError) as e:
            raise MigrationError(str(e)) from None
        except MonitorUnavailable as e:
            raise MigrationError(f"the source QEMU went away: {e}") from None
        # Switched over: the guest is stopped here, the mirrors hold its last write.
        for job in jobs:
            with contextlib.suppress(ExecuteError):
                await monitor.execute("block-job-cancel", {"device": job})
        await drop_jobs(monitor, jobs)
        ram = info.get("ram", {})
        return Outcome(
            downtime_ms=int(info.get("downtime", 0)),
            total_ms=int(info.get("total-time", 0)),
            wall_ms=int((time.monotonic() - started) * 1000),
            ram_bytes=int(ram.get("transferred", 0)),
            disk_bytes=progress.disk_total,
        )
    except BaseException:
        if migrating:
            with contextlib.suppress(MonitorUnavailable, ExecuteError):
                await monitor.execute("migrate_cancel")
        await drop_jobs(monitor, jobs)
        raise
    finally:
        relay.close()
        relay_socket.unlink(missing_ok=True)  # noqa: ASYNC240
        with contextlib.suppress(MonitorUnavailable):
            for node in nodes:
                with contextlib.suppress(ExecuteError):
                    await monitor.execute("blockdev-del", {"node-name": node})


async def _until_mirrored(
    monitor: Monitor, jobs: Sequence[str], progress: Progress, report: Callable[[Progress], None]
) -> None:
    last = 0.0
    while True:
        found = await block_jobs(monitor)
        for job in jobs:
            info = found.get(job)
            if info is None or info["status"] in ("concluded", "null", "aborting"):
                why = (info or {}).get("error") or "the job ended"
                raise MigrationError(f"mirroring {job.removeprefix('migrate-')} failed: {why}")
        progress.disk_done = sum(int(found[j]["current-progress"]) for j in jobs)
        progress.disk_total = sum(int(found[j]["total-progress"]) for j in jobs)
        if all(found[j]["status"] == "ready" for j in jobs):
            return
        if time.monotonic() - last >= 1:
            last = time.monotonic()
            report(progress)
        await asyncio.sleep(POLL)


async def _until_migrated(
    monitor: Monitor, jobs: Sequence[str], progress: Progress, report: Callable[[Progress], None]
) -> dict[str, Any]:
    last = 0.0
    continued = False
    listener = monitor.listen(("MIGRATION",))  # wakes the loop at once on a state change
    try:
        while True:
            info: dict[str, Any] = await monitor.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return await _completed(monitor, info)
            if status in ("failed", "cancelled"):
                why = info.get("error-desc") or f"the migration was {status}"
                raise MigrationError(f"migration {status}: {why}")
            if continued:
                # Past the switchover: QEMU leaves pre-switchover in its own thread, so the
                # state may still say so for a moment. Never continue twice — a second
                # `migrate-continue` landing after completion fails, and reading that as a
                # failed migration would resume a guest that already runs at the target.
                await _nap(listener)
                continue
            found = await block_jobs(monitor)
            for job in jobs:
                if found.get(job, {}).get("status") not in ("ready", "running"):
                    raise MigrationError(f"the mirror of {job.removeprefix('migrate-')} stopped")
            if status == "pre-switchover":
                # The guest is stopped and its I/O drained: the mirrors (checked just now) hold
                # every write. Only now may the target take over.
                await monitor.execute("migrate-continue", {"state": "pre-switchover"})
                continued = True
                continue
            ram = info.get("ram", {})
            progress.ram_done = int(ram.get("transferred", 0))
            progress.ram_total = max(progress.ram_total, int(ram.get("total", 0)))
            if time.monotonic() - last >= 1:
                last = time.monotonic()
                report(progress)
            await _nap(listener)
    finally:
        monitor.forget(listener)


async def _completed(monitor: Monitor, info: dict[str, Any]) -> dict[str, Any]:
    """QEMU says `completed` a moment before it has computed the times (woken by the event,
    we can ask in between): ask again until they are there."""
    for _ in range(100):
        if info.get("total-time"):
            break
        await asyncio.sleep(0.01)
        info = await monitor.execute("query-migrate")
    return info


async def _nap(listener: EventListener) -> None:
    """POLL, or less when QEMU says the migration's state changed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(listener.get(), POLL)


async def hand_over(endpoint: Endpoint, history: bytes, token: str) -> str | None:
    """The source's console history (its CRI log) to the target, which puts it first in its
    own log; the target's verdict back: `RUNNING`, `failed: <why>`, or None when it did not
    say (unreachable, gone, or no answer within `VERDICT_TIMEOUT`)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(endpoint.host, endpoint.console_port), 10
        )
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(_preamble(token))
        writer.write(history)
        await writer.drain()
        writer.write_eof()
        line = await asyncio.wait_for(reader.readline(), VERDICT_TIMEOUT + 10)
        verdict = line.decode(errors="replace").strip()
        return verdict if verdict == RUNNING or verdict.startswith("failed: ") else None
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def outcome_message(outcome: Outcome) -> str:
    return json.dumps(
        {
            "progress": 100,
            "downtimeMilliseconds": outcome.downtime_ms,
            "totalMilliseconds": outcome.total_ms,
            "wallMilliseconds": outcome.wall_ms,
            "ramBytes": outcome.ram_bytes,
            "diskBytes": outcome.disk_bytes,
        }
    )


# Run states a target never leaves for `running` by itself: the state loaded but the guest not
# started (QEMU could not take its disks back: paused), or stopped by the guest or an error.
_NEVER_RUNS = ("paused", "guest-panicked", "internal-error", "io-error", "shutdown")


async def until_running(monitor: Monitor) -> None:
    """Until the guest runs here (the state arrived); MigrationError when QEMU exits first, or
    stops in a state it never leaves by itself (it would wait for ever, and its source with
    it; the caller kills it, so its source may resume the guest)."""
    while True:
        try:
            status = await monitor.status()
        except MonitorUnavailable:
            raise MigrationError("the incoming migration failed (QEMU exited)") from None
        if status == "running":
            return
        if status in _NEVER_RUNS:
            raise MigrationError(f"the guest did not start here (QEMU: {status})")
        await asyncio.sleep(POLL)
