"""The serial console as container logs: QEMU's raw console file turned into CRI log lines.

QEMU writes every byte the guest sends to its serial port into the machine's console log, with
or without anyone attached. A tailer copies that file, line by line, into the run's CRI log
(`kubectl logs`, `-f`, `--tail`, `-p` come from the SDK's reader). The position reached is kept
next to the console file, so a restarted agent resumes where the previous one stopped: no line
twice, none lost (a line is copied whole, so a half-copied line cannot be repeated either).

Neither file grows without bound, so a chatty guest cannot fill the host's disk. The CRI log is
rotated as the kubelet rotates a container's (`sdk.logs.append_log`). The console file stays
QEMU's alone to write (its chardev `logfile=`, which keeps every byte while no agent runs: no
socket for the agent to reconnect to, no pipe whose buffer would stall the guest): once copied,
its bytes' disk blocks are given back by punching a hole (`fallocate`), which leaves every
offset as it was, so QEMU's appends and the saved position need no coordination. The file's
apparent size still grows; what it takes on disk is what has not been copied yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from ..._files import write_atomic
from ...sdk.logs import MAX_LINE_BYTES, LogEncoder, LogRotation, append_log

__all__ = ["ConsoleTailer"]

log = logging.getLogger(__name__)

_BLOCK = 64 * 1024
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _release_copied(console: Path, end: int) -> str | None:
    """Give back the disk blocks of the console file's bytes before `end` (copied already):
    they read as zeros from now on, the file's size and QEMU's appends are untouched. Why not,
    when the file system cannot punch holes (None: done)."""
    end -= end % 4096  # whole blocks only: the rest of a block is punched with the next copy
    if end <= 0:
        return None
    try:
        fd = os.open(console, os.O_WRONLY)
    except FileNotFoundError:
        return None
    try:
        if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, end) == 0:
            return None
        return os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)


class ConsoleTailer:
    """Copies `console` (raw serial bytes) into the CRI log `log`, rotated by `rotation`, from
    the offset in `mark`; the console's copied bytes are released from the disk."""

    def __init__(
        self, console: Path, log: Path, mark: Path, *, rotation: LogRotation, poll: float = 0.2
    ) -> None:
        self.console, self.log, self.mark, self.poll = console, log, mark, poll
        self.rotation = rotation
        self._encoder = LogEncoder("stdout")
        self._punching = True

    def _offset(self) -> int:
        try:
            return int(self.mark.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _save(self, offset: int) -> None:
        write_atomic(self.mark, str(offset))

    def copy(self, *, final: bool = False) -> int:
        """Copy what is new; with `final`, also a last line without its newline. Bytes copied."""
        offset = self._offset()
        try:
            with self.console.open("rb") as source:
                if os.fstat(source.fileno()).st_size < offset:
                    offset = 0  # a new console file: start again at its beginning
                source.seek(offset)
                data = source.read(_BLOCK * 16)
        except FileNotFoundError:
            return 0
        if not final:
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) < MAX_LINE_BYTES:
                return 0  # only part of a line so far
            data = data[: end or len(data)]
        if not data:
            return 0
        text = data.replace(b"\r", b"")
        records = self._encoder.feed(text, datetime.now(UTC))
        if final:
            records += self._encoder.flush()
        append_log(self.log, records, self.rotation)
        self._save(offset + len(data))
        if self._punching and (why := _release_copied(self.console, offset + len(data))):
            self._punching = False  # (warned once per run)
            log.warning("%s: cannot punch holes (%s): the file grows", self.console, why)
        return len(data)

    async def run(self) -> None:
        """Copy until cancelled (then one last copy of complete lines)."""
        try:
            while True:
                while self.copy():
                    pass
                await asyncio.sleep(self.poll)
        finally:
            with contextlib.suppress(OSError):
                self.copy()
