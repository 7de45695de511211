"""One QEMU process per VM, detached from the agent and driven through its sockets.

Design, and why:
- QEMU runs with `-daemonize` (its own session, reparented to init, stdio on /dev/null) and a
  pidfile, so it outlives the agent; the parent returns only once QEMU is initialised, so on
  success every socket exists. Everything the agent needs later lives in `run_dir`: qmp.sock,
  qga.sock, console.sock (serial, server; attach) with console.log (the same bytes, appended: logs),
  pid, spec.json, and exit.json (why the machine ended, when the agent ended it).
- `-no-shutdown`: a guest that powers off leaves QEMU alive in state `shutdown` instead of exiting,
  so the outcome stays observable through QMP (`query-status`) even by an agent that was down when
  it happened; `wait()` reads it, records it, then quits QEMU. A crash reaches QEMU through pvpanic
  and pauses the guest (`guest-panicked`), observable the same way.
- An agent that ends a machine (kill, forced quit) writes exit.json first, so whoever waits learns
  it was killed (137) and not a crash.
- The process is watched with a pidfd: it works for a process we did not start (adopted).
- Under systemd (the host install, docs/host-install.md) each QEMU starts in a transient scope
  of its own in `vkubelet-vms.slice` (`systemd-run --scope`): its memory is not accounted to the
  agent's service, and a stop of that service never reaches it, whatever its KillMode.
- Network: QEMU is started inside the VM's netns (`ip netns exec NS qemu ...`, argv only) on the
  tap the pod network made there; userspace virtio-net (no vhost-net on our hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from ...sdk.tasks import SharedWatch
from ._backupqmp import QmpDiskBackup
from ._hotplug import QmpHotplug
from ._net import TAP_NAME, GuestNetwork
from ._qga import ExecOutput, GuestAgent, GuestAgentError, GuestAgentUnavailable
from ._qmp import ExecuteError, Monitor, MonitorUnavailable
from ._stats import process_start

QEMU = "qemu-system-x86_64"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL


@dataclass(frozen=True)
class Disk:
    path: Path
    format: str = "qcow2"
    bus: Literal["virtio", "scsi"] = "virtio"
    readonly: bool = False
    share_rw: bool = False  # others may write it too (a migration target's NBD export)


@dataclass(frozen=True)
class MachineSpec:
    name: str
    run_dir: Path
    vcpus: int
    memory_mib: int
    disks: tuple[Disk, ...]
    seed: Path | None = None
    network: GuestNetwork | None = None
    netns: str | None = None
    accel: str = "tcg"
    extra_args: tuple[str, ...] = field(default=())  # appended to QEMU's argv (tests, tuning)
    # Live-resize headroom (`_resize`): hotpluggable vCPUs up to max_vcpus, DIMMs up to
    # max_memory_mib in memory_slots slots. None/0: a fixed-size machine.
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    memory_slots: int = 0


@dataclass(frozen=True)
class MachineExit:
    code: int
    reason: str  # "Completed" | "Error" | "Killed"
    message: str = ""


@dataclass(frozen=True)
class Usage:
    """What the node's stats report of a machine."""

    cpu_ns: int  # cumulative CPU time used by the machine
    memory_bytes: int  # host memory it holds


@dataclass(frozen=True)
class MachineStats:
    cpu_ns: int  # QEMU's user + system CPU time
    memory_bytes: int  # QEMU's resident set
    balloon_bytes: int | None  # the guest's memory as the balloon reports it, if present
    disk_bytes: int  # allocated bytes of the writable disks


class MachineError(RuntimeError):
    """QEMU refused to start; the message carries its stderr."""


def _opt(value: object) -> str:
    """A value inside a QEMU option list: commas are doubled, so a pod field cannot add options."""
    return str(value).replace(",", ",,")


# The slice of the VMs' scopes under systemd (the host install writes its unit).
VM_SLICE = "vkubelet-vms.slice"
# Present when the host booted with systemd (sd_booted()).
SYSTEMD_RUNTIME = Path("/run/systemd/system")


def scope_argv(name: str) -> list[str]:
    """What QEMU's argv starts with: `systemd-run --scope` into `VM_SLICE` when the agent runs
    as a systemd service (systemd sets INVOCATION_ID for those) on a host booted with systemd;
    else nothing (a dev machine, a container)."""
    booted = SYSTEMD_RUNTIME.is_dir()
    systemd_run = shutil.which("systemd-run")
    if not (os.environ.get("INVOCATION_ID") and booted and systemd_run):
        return []
    return [
        systemd_run, "--scope", "--quiet", "--collect", f"--slice={VM_SLICE}",
        f"--description=vkubelet VM {name}", "--",
    ]  # fmt: skip


def qemu_argv(spec: MachineSpec) -> list[str]:
    run = spec.run_dir.resolve()
    argv = [QEMU] if spec.netns is None else ["ip", "netns", "exec", spec.netns, QEMU]
    argv += [
        "-name", f"guest={_opt(spec.name)}",
        "-machine", f"q35,accel={_opt(spec.accel)}",
        "-smp", _smp(spec),
        "-m", _memory(spec),
        "-nodefaults", "-no-user-config", "-display", "none",
        "-no-shutdown",
        "-daemonize", "-pidfile", str(run / "pid"),
        "-chardev", f"socket,id=qmp,path={_opt(run / 'qmp.sock')},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-chardev", f"socket,id=console,path={_opt(run / 'console.sock')},server=on,wait=off,"
        f"logfile={_opt(run / 'console.log')},logappend=on",
        "-serial", "chardev:console",
        "-device", "virtio-serial-pci,id=vser",
        "-chardev", f"socket,id=qga,path={_opt(run / 'qga.sock')},server=on,wait=off",
        "-device", "virtserialport,bus=vser.0,chardev=qga,name=org.qemu.guest_agent.0",
        "-device", "pvpanic-pci",
        "-device", "virtio-balloon-pci,id=balloon",
    ]  # fmt: skip
    if any(d.bus == "scsi" for d in spec.disks):
        argv += ["-device", "virtio-scsi-pci,id=scsi"]
    for index, disk in enumerate(spec.disks):
        drive = (
            f"file={_opt(disk.path.resolve())},if=none,id=disk{index},format={_opt(disk.format)}"
        )
        argv += ["-drive", drive + (",readonly=on" if disk.readonly else "")]
        device = "virtio-blk-pci" if disk.bus == "virtio" else "scsi-hd,bus=scsi.0"
        device += f",drive=disk{index}" + (",share-rw=on" if disk.share_rw else "")
        argv += ["-device", device + (",bootindex=0" if index == 0 else "")]
    if spec.seed is not None:
        argv += [
            "-drive", f"file={_opt(spec.seed.resolve())},if=none,id=seed,format=raw,readonly=on",
            "-device", "virtio-blk-pci,drive=seed",
        ]  # fmt: skip
    if spec.network is not None:
        argv += [
            "-netdev", f"tap,id=net0,ifname={TAP_NAME},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=net0,mac={_opt(spec.network.mac)},romfile=",
        ]  # fmt: skip
    argv += list(spec.extra_args)
    return argv


def _smp(spec: MachineSpec) -> str:
    smp = str(int(spec.vcpus))
    if spec.max_vcpus is not None and spec.max_vcpus > spec.vcpus:
        smp += f",maxcpus={int(spec.max_vcpus)}"
    return smp


def _memory(spec: MachineSpec) -> str:
    memory = f"{int(spec.memory_mib)}M"
    if spec.memory_slots > 0 and spec.max_memory_mib and spec.max_memory_mib > spec.memory_mib:
        memory += f",slots={int(spec.memory_slots)},maxmem={int(spec.max_memory_mib)}M"
    return memory


def _alive(pid: int, run_dir: Path) -> bool:
    """Whether pid is still our QEMU (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(run_dir.resolve() / "qmp.sock").encode() in cmdline


class Machine:
    runtime = "qemu"

    def __init__(self, run_dir: Path, pid: int, spec: MachineSpec | None = None) -> None:
        self.run_dir = run_dir
        self.pid = pid
        self.started = process_start(pid)
        self.spec = spec
        self.console_socket = run_dir / "console.sock"
        self.console_log = run_dir / "console.log"
        self.monitor = Monitor(run_dir / "qmp.sock")
        self.agent = GuestAgent(run_dir / "qga.sock")
        self.hotplug = QmpHotplug(self.monitor)
        self._watcher = SharedWatch(self._watch, name=f"watch {self.run_dir.name}")

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    async def launch(cls, spec: MachineSpec) -> Machine:
        """Start QEMU detached; returns once its sockets exist."""
        run = spec.run_dir
        longest = len(str(run.resolve() / "console.sock"))
        if longest > _SUN_PATH_MAX:
            raise MachineError(
                f"run directory {run} is too deep: its sockets' paths would be {longest} bytes, "
                f"unix sockets allow {_SUN_PATH_MAX}"
            )
        run.mkdir(parents=True, exist_ok=True)
        for stale in ("qmp.sock", "qga.sock", "console.sock", "pid", "exit.json"):
            (run / stale).unlink(missing_ok=True)
        (run / "spec.json").write_text(json.dumps(_spec_to_json(spec), indent=2) + "\n")
        process = await asyncio.create_subprocess_exec(
            *scope_argv(spec.name),
            *qemu_argv(spec),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await process.communicate()
        if process.returncode != 0:
            message = err.decode(errors="replace").strip()
            raise MachineError(f"QEMU for {spec.name} exited {process.returncode}: {message}")
        pid = int((run / "pid").read_text().strip())
        return cls(run, pid, spec)

    @classmethod
    async def adopt(cls, run_dir: Path) -> Machine | None:
        """The machine of run_dir if its QEMU is still running (after an agent restart)."""
        try:
            pid = int((run_dir / "pid").read_text().strip())
        except (OSError, ValueError):
            return None
        if not _alive(pid, run_dir):
            return None
        spec = None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            spec = _spec_from_json(json.loads((run_dir / "spec.json").read_text()))
        return cls(run_dir, pid, spec)

    def running(self) -> bool:
        return _alive(self.pid, self.run_dir)

    async def wait(self) -> MachineExit:
        """Until the guest is off (or QEMU gone); then QEMU is ended and the outcome returned.
        Waiters share one watcher (`SharedWatch`): QEMU runs on for the next agent when the
        last of them is cancelled."""
        return await self._watcher.wait()

    def disk_backup(self) -> QmpDiskBackup:
        """Backups through QMP's block jobs and dirty bitmaps (`_backupqmp`)."""
        return QmpDiskBackup(self.monitor, self.agent)

    async def wait_guest_agent(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until the guest agent answers; GuestAgentUnavailable on timeout or when QEMU is gone."""
        await self.agent.wait_ready_unless(
            self._process_gone(),
            timeout,
            f"QEMU of {self.run_dir.name} exited before its guest agent",
        )

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ExecOutput:
        return await self.agent.exec(argv, stdin=stdin, timeout=timeout)

    async def stop(self, grace: float) -> MachineExit:
        """Graceful: guest agent shutdown, then ACPI power button, then `quit` at the deadline."""
        waiting = asyncio.ensure_future(self.wait())
        try:
            return await self._stop(grace, waiting)
        finally:
            waiting.cancel()  # when cancelled itself: its wait is not left behind

    async def _stop(self, grace: float, waiting: asyncio.Future[MachineExit]) -> MachineExit:
        deadline = time.monotonic() + grace

        async def ended(by: float) -> bool:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting), max(0.0, by - time.monotonic()))
                return True
            return False

        try:
            await asyncio.wait_for(self.agent.shutdown(), max(0.1, min(2.0, grace / 2)))
            asked_agent = True
        except (GuestAgentUnavailable, GuestAgentError, TimeoutError, OSError):
            asked_agent = False
        # Without an agent, or when it did not act within half the grace, press the power button.
        if not await ended(time.monotonic() + (grace / 2 if asked_agent else 0.0)):
            with contextlib.suppress(MonitorUnavailable, ExecuteError):
                await self.monitor.execute("system_powerdown")
            if not await ended(deadline):
                self._record(MachineExit(137, "Killed", f"not off after the {grace:g} s grace"))
                await self.monitor.quit()
        return await waiting

    async def end(self, outcome: MachineExit) -> MachineExit:
        """End QEMU with `outcome` as the run's (its state was saved elsewhere: hibernation)."""
        waiting = asyncio.ensure_future(self.wait())
        try:
            self._record(outcome)
            await self.monitor.quit()
            return await waiting
        finally:
            waiting.cancel()  # when cancelled itself: its wait is not left behind

    async def kill(self) -> None:
        """End QEMU now (SIGKILL); waiters see exit code 137."""
        self._record(MachineExit(137, "Killed", "killed"))
        with contextlib.suppress(ProcessLookupError):
            if self.running():
                os.kill(self.pid, signal.SIGKILL)
        await self._process_gone()
        await self.close()

    async def close(self) -> None:
        """Drop our connections (QEMU keeps running)."""
        await self.agent.close()
        await self.monitor.close()

    async def usage(self) -> Usage:
        stats = await self.stats()
        return Usage(stats.cpu_ns, stats.memory_bytes)

    async def stats(self) -> MachineStats:
        cpu_ns, rss = _proc_usage(self.pid)
        balloon = None
        with contextlib.suppress(MonitorUnavailable, ExecuteError):
            balloon = int((await self.monitor.execute("query-balloon"))["actual"])
        disk_bytes = 0
        for disk in self.spec.disks if self.spec else ():
            if not disk.readonly:
                with contextlib.suppress(OSError):
                    disk_bytes += disk.path.stat().st_blocks * 512
        return MachineStats(
            cpu_ns=cpu_ns,
            memory_bytes=rss,
            balloon_bytes=balloon,
            disk_bytes=disk_bytes,
        )

    # -- watching -------------------------------------------------------------------------

    def _record(self, outcome: MachineExit) -> None:
        if not (self.run_dir / "exit.json").exists():
            (self.run_dir / "exit.json").write_text(json.dumps(asdict(outcome)) + "\n")

    def _recorded(self) -> MachineExit | None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            return MachineExit(**json.loads((self.run_dir / "exit.json").read_text()))
        return None

    async def _process_gone(self) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return
        try:
            if not self.running():
                return
            loop = asyncio.get_running_loop()
            gone: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(fd, readable)
            try:
                await gone
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)

    async def _watch(self) -> MachineExit:
        gone = asyncio.create_task(self._process_gone(), name=f"pidfd {self.run_dir.name}")
        try:
            outcome = await self._guest_outcome(gone)
        except asyncio.CancelledError:
            # Nobody waits any more (the agent stops): QEMU runs on for the next agent, which
            # reads the guest's outcome from QMP. Quitting it here would end a running VM.
            gone.cancel()
            raise
        except Exception:
            await self._end_qemu(gone, None)
            raise
        await self._end_qemu(gone, outcome)
        return self._recorded() or outcome or MachineExit(1, "Error", "QEMU exited")

    async def _end_qemu(self, gone: asyncio.Task[None], outcome: MachineExit | None) -> None:
        """The guest is off (or its outcome unreadable): record why, end QEMU, drop our
        connections."""
        if not gone.done():
            if outcome is not None:
                self._record(outcome)
            await self.monitor.quit()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(gone), 10)
            if not gone.done() and self.running():
                os.kill(self.pid, signal.SIGKILL)
                await gone
        await self.close()

    async def _guest_outcome(self, gone: asyncio.Task[None]) -> MachineExit | None:
        """What ended the guest, from QMP; None when QEMU went away without telling."""
        try:
            listener = None
            await self.monitor.connect()
            listener = self.monitor.listen(("SHUTDOWN", "GUEST_PANICKED"))
            status = await self.monitor.status()
        except MonitorUnavailable:
            await gone
            return None
        try:
            if status == "shutdown":
                return MachineExit(0, "Completed", "guest powered off")
            if status == "guest-panicked":
                return MachineExit(1, "Error", "guest kernel panic")
            event = asyncio.create_task(listener.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                return None
            message = event.result()
            data = message.get("data")
            return _outcome_of(
                str(message.get("event", "")), data if isinstance(data, dict) else {}
            )
        finally:
            self.monitor.forget(listener)


def _proc_usage(pid: int) -> tuple[int, int]:
    """CPU time (ns, user + system) and resident bytes of a process, from procfs (no blocking)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        raise MachineError(f"QEMU {pid} is not running") from None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks * 1_000_000_000 // _CLOCK_TICKS, int(statm[1]) * _PAGE


def _outcome_of(event: str, data: dict[str, Any]) -> MachineExit | None:
    if event == "GUEST_PANICKED":
        return MachineExit(1, "Error", "guest kernel panic")
    reason = str(data.get("reason", ""))
    if reason == "guest-shutdown":
        return MachineExit(0, "Completed", "guest powered off")
    if reason == "guest-panic":
        return MachineExit(1, "Error", "guest kernel panic")
    if reason in ("guest-reset", "guest-triple-fault"):
        return MachineExit(1, "Error", f"guest {reason.removeprefix('guest-')}")
    return None  # host-initiated (quit, signal): whoever did it recorded why


def _spec_to_json(spec: MachineSpec) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(spec, enc_hook=str)  # paths as text
    return data


def _spec_from_json(data: dict[str, Any]) -> MachineSpec:
    return msgspec.convert(data, MachineSpec, dec_hook=_path)


def _path(kind: type, value: Any) -> Path:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(kind)
