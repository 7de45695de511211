"""Start and stop control-plane processes so that none is ever left behind.

A process is identified by its pid *and* its kernel start time: after a reboot or a long pause a
recorded pid may belong to somebody else, and `down` must never signal a stranger.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    start_time: int  # clock ticks since boot, field 22 of /proc/<pid>/stat

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRef:
        return cls(int(data["pid"]), int(data["start_time"]))


def _stat(pid: int) -> tuple[bool, int, int] | None:
    """(running, process group, start time) of a pid, or None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X"), int(fields[2]), int(fields[19])


def pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def is_alive(ref: ProcessRef) -> bool:
    stat = _stat(ref.pid)
    return stat is not None and stat[0] and stat[2] == ref.start_time


def alive(record: dict[str, Any] | None) -> bool:
    """Whether the process recorded as `record` (`ProcessRef.to_json`) still runs."""
    return record is not None and is_alive(ProcessRef.from_json(record))


def _die_with_parent() -> None:
    """Run in the child: the kernel kills it if the process that started it dies.

    Used for test clusters, so that a test run killed with SIGKILL leaves no apiserver behind.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start(argv: list[str], log_path: Path, *, cwd: Path, tie_to_parent: bool = False) -> ProcessRef:
    """Start `argv` in a new session, so that its whole group can be stopped; log to a file."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if tie_to_parent else None,
        )
    stat = _stat(proc.pid)
    return ProcessRef(proc.pid, stat[2] if stat else 0)


def _reap(pid: int) -> None:
    """Collect our own exited children so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop(ref: ProcessRef, *, grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is still alive after `grace` seconds."""
    if not is_alive(ref):
        _reap(ref.pid)
        return
    _signal_group(ref.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(ref.pid)
        if not is_alive(ref):
            break
        time.sleep(0.05)
    _signal_group(ref.pid, signal.SIGKILL)  # also catches children that outlived their leader
    deadline = time.monotonic() + 5
    # Signals are delivered asynchronously: wait until every member of the group is gone, so
    # that a caller who checks right after `stop` (as `down` and the tests do) finds nothing.
    while (is_alive(ref) or _group_members(ref.pid)) and time.monotonic() < deadline:
        _reap(ref.pid)
        time.sleep(0.05)
    _reap(ref.pid)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    return [pid for pid in pids() if (stat := _stat(pid)) and stat[0] and stat[1] == pgid]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text`: how tests prove that nothing was left behind."""
    found = []
    for pid in pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text in cmdline.decode(errors="replace") and pid != os.getpid():
            stat = _stat(pid)
            if stat and stat[0]:
                found.append(pid)
    return found
