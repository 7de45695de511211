"""Choosing the accelerator: KVM when it really works here, else TCG, and say why.

A KVM device that exists is not a KVM that boots stock guests: on our hosts (`kvm_pvm`, a nested
"PVM" hypervisor) the firmware alone runs ~25x slower under KVM than under TCG and Debian kernels
hang or die with emulation failures (notes/vm.md). So `auto` boots a tiny probe: SeaBIOS with no
disk, its debug port (0x402) to a file, and times how long it takes to give up on booting. A
healthy KVM does that in well under a second; optionally a kernel is booted too (it panics
without a root file system and, with -no-reboot, QEMU exits: proof a kernel runs). The result is
cached per host boot, since it cannot change before a reboot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from ..._files import write_atomic
from ._machine import QEMU

FIRMWARE_BUDGET = 1.5  # seconds; TCG needs ~0.15 s here, healthy KVM less
_FIRMWARE_DONE = b"No bootable device"


@dataclass(frozen=True)
class AccelChoice:
    accel: Literal["kvm", "tcg"]
    reason: str


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "unknown"


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vkubelet" / "accel-probe.json"


def _cache_key(kernel: Path | None) -> str:
    qemu = shutil.which(QEMU) or QEMU
    stamp = Path(qemu).stat().st_mtime_ns if Path(qemu).exists() else 0
    return f"{_boot_id()}|{qemu}|{stamp}|{kernel or ''}"


def _cached(key: str) -> AccelChoice | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(_cache_file().read_text())
        if data["key"] == key:
            return AccelChoice(**data["choice"])
    return None


def _store(key: str, choice: AccelChoice) -> None:
    with contextlib.suppress(OSError):
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "choice": asdict(choice)}) + "\n")


async def probe_accel(
    mode: Literal["auto", "kvm", "tcg"],
    *,
    probe_kernel: Path | None = None,
    use_cache: bool = True,
) -> AccelChoice:
    if mode == "tcg":
        return AccelChoice("tcg", "configured: tcg")
    if mode == "kvm":
        return AccelChoice("kvm", "configured: kvm")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelChoice("tcg", "KVM unavailable: /dev/kvm missing or not accessible")
    key = _cache_key(probe_kernel)
    if use_cache and (hit := _cached(key)) is not None:
        return hit
    choice = await _probe(probe_kernel)
    _store(key, choice)
    return choice


async def _probe(
    kernel: Path | None, accel: Literal["kvm", "tcg"] = "kvm", budget: float = FIRMWARE_BUDGET
) -> AccelChoice:
    """Boot the probe with `accel` (tests run it with TCG, and a budget a loaded machine meets,
    to check the detection itself)."""
    with tempfile.TemporaryDirectory(prefix="vkubelet-accel-") as tmp:
        log = Path(tmp) / "firmware.log"
        qemu = [QEMU, "-machine", f"q35,accel={accel}", "-nodefaults", "-no-user-config",
                "-display", "none", "-no-reboot"]  # fmt: skip
        argv = [*qemu, "-m", "64M", "-chardev", f"file,id=dbg,path={log}",
                "-device", "isa-debugcon,iobase=0x402,chardev=dbg"]  # fmt: skip
        elapsed, ok, detail = await _run_until(argv, budget, lambda: _firmware_done(log))
        if not ok:
            return AccelChoice("tcg", f"KVM unusable, using TCG: firmware probe {detail}")
        if kernel is not None:
            argv = [*qemu, "-m", "256M", "-kernel", str(kernel), "-append", "panic=-1 quiet"]
            kernel_elapsed, ok, detail = await _run_until(argv, 20.0, None)
            if not ok:
                return AccelChoice("tcg", f"KVM unusable, using TCG: kernel probe {detail}")
            return AccelChoice(
                accel,
                f"{accel.upper()} works: firmware {elapsed:.2f} s, "
                f"kernel probe {kernel_elapsed:.1f} s",
            )
        return AccelChoice(accel, f"{accel.upper()} works: firmware probe {elapsed:.2f} s")


def _firmware_done(log: Path) -> bool:
    with contextlib.suppress(OSError):
        return _FIRMWARE_DONE in log.read_bytes()
    return False


async def _run_until(
    argv: list[str], budget: float, done: Callable[[], bool] | None
) -> tuple[float, bool, str]:
    """Run QEMU until `done()` holds (or, with done None, until it exits 0) within budget."""
    start = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        while time.monotonic() - start < budget:
            if process.returncode is not None:
                break
            if done is not None and done():
                return time.monotonic() - start, True, "ok"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 0.05)
        elapsed = time.monotonic() - start
        if process.returncode is None:
            return elapsed, False, f"did not finish within {budget:g} s"
        if done is None and process.returncode == 0:
            return elapsed, True, "ok"
        assert process.stderr is not None
        err = (await process.stderr.read()).decode(errors="replace").strip().splitlines()
        return elapsed, False, f"QEMU exited {process.returncode}: {err[-1] if err else ''}"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
