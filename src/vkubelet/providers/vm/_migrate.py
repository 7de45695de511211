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
  history goes to the target's console port, and the source QEMU quits.
- Failure at any point before the switchover (target gone, a mirror error, QEMU's migration
  failing): the migration is cancelled, the mirror jobs are dropped, and the guest runs on at
  the source (QEMU resumes it itself when the migration fails after stopping it).

QEMU runs inside the VM's network namespace, which has no route to other nodes, so it never
opens a TCP socket itself: the agent does, in the host namespace, and hands QEMU the descriptor
(`getfd`): the migration stream on both sides (`fd:` URIs) and the NBD server's listening socket
on the target. QEMU's NBD client cannot take a descriptor in QEMU 7.2, so on the source it dials
a unix socket in the VM's directory and the agent relays that to the target's NBD port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._backend import MachineHandle
from ._console import ConsoleTailer
from ._qmp import ExecuteError, Monitor, MonitorUnavailable

if TYPE_CHECKING:
    from ...sdk import PodRunner
    from ._provider import _VM, VMProvider

__all__ = [
    "MIGRATE_TO",
    "MIGRATION_CONDITION",
    "MIGRATION_SOURCE",
    "TARGET_CONDITION",
    "Endpoint",
    "IncomingMigration",
    "MigrationError",
    "Migrations",
    "Outcome",
    "migrate_out",
    "send_history",
]

log = logging.getLogger(__name__)

MIGRATION_SOURCE = "vm.vkubelet.io/migration-source"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_CONDITION = "vm.vkubelet.io/MigrationTarget"
MIGRATION_CONDITION = "vm.vkubelet.io/Migration"

DEFAULT_BANDWIDTH = 128 * 2**20
DOWNTIME_LIMIT_MS = 50  # issue 13's target; QEMU measured 15-26 ms here
# The migration stream's socket buffers (each side). Left to the kernel, loopback's autotuning
# grows the receive buffer to megabytes: the source then measures the speed at which it fills
# that buffer, not the speed at which the target loads, sizes its last round by it, and stops the
# guest while the target still has megabytes to read; the guest waits for the target to catch
# up, a wait QEMU's downtime figure does not even count. Small buffers make the source feel
# the target's pace. 256 KiB still carries more than the default 128 MiB/s at a 1 ms RTT.
STREAM_BUFFER = 256 * 1024
_POLL = 0.05


class MigrationError(RuntimeError):
    """The migration failed; the message says why (it goes into the pod condition)."""


@dataclass(frozen=True)
class Endpoint:
    """Where the target listens. The controller copies it from the target's condition into the
    source's `migrate-to` annotation; `maxBandwidth` (bytes/s) may be added there."""

    host: str
    migration_port: int
    nbd_port: int
    console_port: int
    disks: tuple[str, ...]  # NBD export names, in the machine's disk order
    max_bandwidth: int | None = None

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
        if self.max_bandwidth is not None:
            data["maxBandwidth"] = self.max_bandwidth
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Endpoint:
        try:
            data = json.loads(text)
            bandwidth = data.get("maxBandwidth")
            return cls(
                host=str(data["host"]),
                migration_port=_port(data["migrationPort"]),
                nbd_port=_port(data["nbdPort"]),
                console_port=_port(data["consolePort"]),
                disks=tuple(str(d) for d in data["disks"]),
                max_bandwidth=int(bandwidth) if bandwidth is not None else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MigrationError(f"{MIGRATE_TO}: not a migration endpoint ({e})") from None


def _port(value: object) -> int:
    port = int(str(value))
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


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
class IncomingMigration:
    """The target's side: QEMU waits (`-incoming defer`) for the state, its disks exported."""

    def __init__(self, monitor: Monitor, host: str, *, stream_buffer: int = STREAM_BUFFER) -> None:
        self.monitor, self.host = monitor, host
        self.stream_buffer = stream_buffer  # 0: the kernel's autotuning
        self._servers: list[asyncio.Server] = []
        self._sockets: list[socket.socket] = []
        self._accepting: asyncio.Task[None] | None = None
        self._history: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def open(self) -> Endpoint:
        devices = await _disk_devices(self.monitor)
        nbd = socket.create_server((self.host, 0))
        self._sockets.append(nbd)
        await self.monitor.pass_fd("migration-nbd", nbd.fileno())
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
        console = await asyncio.start_server(self._console, self.host, 0)
        self._servers.append(console)
        return Endpoint(
            host=self.host,
            migration_port=migration.getsockname()[1],
            nbd_port=nbd.getsockname()[1],
            console_port=console.sockets[0].getsockname()[1],
            disks=tuple(devices),
        )

    async def _incoming(self, listener: socket.socket) -> None:
        """The first connection is the migration stream: QEMU reads it, we never do."""
        connection, _ = await asyncio.get_running_loop().sock_accept(listener)
        listener.close()  # one migration per target
        try:
            await self.monitor.pass_fd("migration-in", connection.fileno())
            await self.monitor.execute("migrate-incoming", {"uri": "fd:migration-in"})
        except (MonitorUnavailable, ExecuteError):
            pass  # QEMU gone: wait() says so
        finally:
            connection.close()  # QEMU holds its own copy of the descriptor

    async def _console(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await reader.read()
            if not self._history.done():
                self._history.set_result(data)
        finally:
            writer.close()

    async def wait(self) -> None:
        """Until the guest runs here; MigrationError when QEMU went away (its incoming side
        failed: it exits) first."""
        while True:
            try:
                status = await self.monitor.status()
            except MonitorUnavailable:
                raise MigrationError("the incoming migration failed (QEMU exited)") from None
            if status == "running":
                return
            await asyncio.sleep(_POLL)

    async def history(self, timeout: float) -> bytes:  # noqa: ASYNC109
        """The source's console history (CRI log lines), b"" when none came in time."""
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(self._history), timeout)
        return b""

    async def stop_exports(self) -> None:
        with contextlib.suppress(MonitorUnavailable, ExecuteError):
            await self.monitor.execute("nbd-server-stop")

    async def close(self) -> None:
        if self._accepting is not None and not self._accepting.done():
            self._accepting.cancel()
        for server in self._servers:
            server.close()
        self._servers.clear()
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


# -- source --------------------------------------------------------------------------------------
async def _relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
) -> None:
    """QEMU's NBD client (unix socket) <-> the target's NBD port (TCP)."""
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(256 * 1024):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


async def _jobs(monitor: Monitor) -> dict[str, dict[str, Any]]:
    return {job["id"]: job for job in await monitor.execute("query-jobs")}


async def _drop_jobs(monitor: Monitor, ids: Sequence[str]) -> None:
    """Cancel what runs, dismiss what ended (best effort: used on the failure path)."""
    with contextlib.suppress(MonitorUnavailable):
        for job_id in ids:
            with contextlib.suppress(ExecuteError):
                await monitor.execute("block-job-cancel", {"device": job_id, "force": True})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            jobs = await _jobs(monitor)
            pending = [j for j in ids if j in jobs]
            for job_id in pending:
                if jobs[job_id]["status"] == "concluded":
                    with contextlib.suppress(ExecuteError):
                        await monitor.execute("job-dismiss", {"id": job_id})
            if not pending:
                return
            await asyncio.sleep(_POLL)


async def migrate_out(
    monitor: Monitor,
    endpoint: Endpoint,
    relay_socket: Path,
    report: Callable[[Progress], None],
    *,
    downtime_limit_ms: int = DOWNTIME_LIMIT_MS,
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
        lambda r, w: _relay(r, w, endpoint.host, endpoint.nbd_port), path=str(relay_socket)
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
                "downtime-limit": downtime_limit_ms,
                # Always set: parameters outlive a migration (QEMU's default: 128 MiB/s).
                "max-bandwidth": endpoint.max_bandwidth or DEFAULT_BANDWIDTH,
            }
            await monitor.execute("migrate-set-parameters", parameters)
            stream = socket.create_connection((endpoint.host, endpoint.migration_port), 10)
            try:
                if stream_buffer:
                    stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, stream_buffer)
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
        await _drop_jobs(monitor, jobs)
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
        await _drop_jobs(monitor, jobs)
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
        found = await _jobs(monitor)
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
        await asyncio.sleep(_POLL)


async def _until_migrated(
    monitor: Monitor, jobs: Sequence[str], progress: Progress, report: Callable[[Progress], None]
) -> dict[str, Any]:
    last = 0.0
    while True:
        info: dict[str, Any] = await monitor.execute("query-migrate")
        status = info.get("status")
        if status == "completed":
            return info
        if status in ("failed", "cancelled"):
            why = info.get("error-desc") or f"the migration was {status}"
            raise MigrationError(f"migration {status}: {why}")
        found = await _jobs(monitor)
        for job in jobs:
            if found.get(job, {}).get("status") not in ("ready", "running"):
                raise MigrationError(f"the mirror of {job.removeprefix('migrate-')} stopped")
        ram = info.get("ram", {})
        progress.ram_done = int(ram.get("transferred", 0))
        progress.ram_total = max(progress.ram_total, int(ram.get("total", 0)))
        if time.monotonic() - last >= 1:
            last = time.monotonic()
            report(progress)
        await asyncio.sleep(_POLL)


async def send_history(endpoint: Endpoint, history: bytes) -> None:
    """The source's console history (its CRI log) to the target, which puts it first in its
    own log."""
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(endpoint.host, endpoint.console_port), 10
    )
    try:
        writer.write(history)
        await writer.drain()
        writer.write_eof()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def outcome_message(outcome: Outcome) -> str:
    data = asdict(outcome)
    return json.dumps(
        {
            "progress": 100,
            "downtimeMilliseconds": data["downtime_ms"],
            "totalMilliseconds": data["total_ms"],
            "wallMilliseconds": data["wall_ms"],
            "ramBytes": data["ram_bytes"],
            "diskBytes": data["disk_bytes"],
        }
    )


# -- the provider's side: pods and their conditions ------------------------------------------------
def _monitor(machine: MachineHandle) -> Monitor:
    monitor = getattr(machine, "monitor", None)
    if not isinstance(monitor, Monitor):
        raise MigrationError("this runtime cannot migrate VMs (no QMP monitor)")
    return monitor


# The guest's new address after it arrived (each node has its own pod CIDR): the first interface
# but lo gets it, and the default route. Addresses are arguments, never part of the script.
_READDRESS = (
    'for d in /sys/class/net/*; do n="${d##*/}"; [ "$n" = lo ] && continue; '
    'ip addr flush dev "$n" && ip addr add "$1" dev "$n" && ip link set "$n" up && '
    'ip route replace default via "$2" dev "$n"; exit $?; done'
)
HISTORY_TIMEOUT = 30.0


class Migrations:
    """Live migration for `VMProvider`: the target pod's incoming side (`receive`, from its
    run) and the source pod's `migrate-to` (`update`, from `update_pod`)."""

    def __init__(self, provider: VMProvider) -> None:
        self.provider = provider
        self._sending: set[str] = set()
        self._tried: dict[str, str] = {}  # pod key -> the endpoint that failed (needs a new one)

    @staticmethod
    def is_target(vm: _VM) -> bool:
        """A target that has not received its VM yet (afterwards it boots like any VM)."""
        meta = vm.pod.metadata
        annotations = (meta.annotations if meta else None) or {}
        return bool(annotations.get(MIGRATION_SOURCE)) and not vm.launch.get("migratedIn")

    async def receive(self, vm: _VM, machine: MachineHandle, runner: PodRunner, run: int) -> None:
        """Export the disks, publish the endpoint, wait for the VM; then its console history
        goes first into this run's log (before the console tailer starts)."""
        provider = self.provider
        incoming: IncomingMigration | None = None
        try:
            incoming = IncomingMigration(_monitor(machine), provider.host_ip)
            try:
                endpoint = await incoming.open()
            except (MonitorUnavailable, ExecuteError, OSError) as e:
                raise MigrationError(f"could not prepare the target: {e}") from None
            runner.set_condition(TARGET_CONDITION, "True", "Ready", endpoint.to_json())
            provider._event(vm, "Normal", "MigrationTargetReady", endpoint.to_json())
            await incoming.wait()
            vm.launch["migratedIn"] = True
            vm.save()
            runner.set_condition(TARGET_CONDITION, "False", "Completed", "the VM runs here")
            provider._event(vm, "Normal", "Migrated", "the VM arrived and runs here")
            history = await incoming.history(HISTORY_TIMEOUT)
            cri_log = provider.log_path(vm.uid, vm.container, run)
            cri_log.parent.mkdir(parents=True, exist_ok=True)
            with cri_log.open("ab") as out:
                out.write(history)
            await incoming.stop_exports()
        except MigrationError as e:
            runner.set_condition(TARGET_CONDITION, "False", "Failed", str(e))
            provider._event(vm, "Warning", "MigrationFailed", str(e))
            raise
        finally:
            if incoming is not None:
                await incoming.close()
        provider._tasks.spawn(self._readdress(vm, machine), name=f"readdress {vm.uid}")

    async def _readdress(self, vm: _VM, machine: MachineHandle) -> None:
        """The guest still has the source's address: give it this node's."""
        import ipaddress

        network = ipaddress.IPv4Network(self.provider.config.pod_cidr)
        if vm.address is None:
            return
        try:
            await machine.wait_guest_agent(120)
            result = await machine.exec(
                [
                    "sh",
                    "-c",
                    _READDRESS,
                    "sh",
                    f"{vm.address}/{network.prefixlen}",
                    str(network.network_address + 1),
                ]
            )
            if result.exit_code != 0:
                raise MigrationError(result.stderr.decode(errors="replace")[:200])
        except Exception as e:
            message = f"could not give the guest its new address {vm.address}: {e}"
            self.provider._event(vm, "Warning", "MigrationReaddressFailed", message)

    def update(self, key: str, vm: _VM, annotations: dict[str, str]) -> None:
        """`migrate-to` on a running VM: migrate it (once per endpoint)."""
        value = annotations.get(MIGRATE_TO)
        if not value or key in self._sending or vm.migrated is not None:
            return
        if self._tried.get(key) == value:
            return  # failed with this endpoint: the controller makes a new target
        runner = self.provider.runners.get(key)
        if runner is None:
            return
        self._tried[key] = value
        try:
            endpoint = Endpoint.from_json(value)
        except MigrationError as e:
            message = json.dumps({"error": str(e)})
            runner.set_condition(MIGRATION_CONDITION, "False", "Failed", message)
            return
        if vm.machine is None or vm.booted_at is None:
            log.warning("%s: migrate-to, but the VM is not running", vm.uid)
            message = json.dumps({"error": "the VM is not running", "target": endpoint.target})
            runner.set_condition(MIGRATION_CONDITION, "False", "Failed", message)
            return
        self._sending.add(key)
        task = self.provider._tasks.spawn(
            self._send(vm, vm.machine, runner, endpoint), name=f"migrate {key}"
        )
        task.add_done_callback(lambda _: self._sending.discard(key))

    async def _send(
        self, vm: _VM, machine: MachineHandle, runner: PodRunner, endpoint: Endpoint
    ) -> None:
        provider = self.provider

        def report(progress: Progress) -> None:
            message = {**json.loads(progress.message()), "target": endpoint.target}
            runner.set_condition(MIGRATION_CONDITION, "True", "Running", json.dumps(message))

        report(Progress())
        log.info("%s: migrating to %s", vm.uid, endpoint.to_json())
        provider._event(vm, "Normal", "Migrating", f"to {endpoint.host}")
        try:
            outcome = await migrate_out(_monitor(machine), endpoint, vm.dir / "nbd.sock", report)
        except MigrationError as e:
            log.warning("%s: migration failed, the VM stays here: %s", vm.uid, e)
            message = json.dumps({"error": str(e), "target": endpoint.target})
            runner.set_condition(MIGRATION_CONDITION, "False", "Failed", message)
            provider._event(vm, "Warning", "MigrationFailed", f"the VM stays here: {e}")
            return
        # Switched over: the guest is paused here for good. Its console history (this run's
        # log, with what the console printed last) goes to the target.
        cri_log = provider.log_path(vm.uid, vm.container, vm.run)
        tailer = ConsoleTailer(machine.console_log, cri_log, vm.dir / "console.offset")
        with contextlib.suppress(OSError):
            while tailer.copy(final=True):
                pass
        try:
            await send_history(endpoint, cri_log.read_bytes() if cri_log.exists() else b"")
        except (OSError, TimeoutError) as e:
            provider._event(vm, "Warning", "MigrationHistoryLost", f"console history: {e}")
        message = json.dumps({**json.loads(outcome_message(outcome)), "target": endpoint.target})
        log.info("%s: migrated: %s", vm.uid, message)
        vm.migrated = message
        runner.set_condition(MIGRATION_CONDITION, "True", "Completed", message)
        provider._event(vm, "Normal", "Migrated", message)
        runner.finish()  # the run's end is the pod's end: it never boots here again
        with contextlib.suppress(MigrationError):
            await _monitor(machine).quit()
