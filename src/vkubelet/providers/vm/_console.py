"""The serial console as container logs: QEMU's raw console file turned into CRI log lines.

QEMU writes every byte the guest sends to its serial port into the machine's console log, with
or without anyone attached. A tailer copies that file, line by line, into the run's CRI log
(`kubectl logs`, `-f`, `--tail`, `-p` come from the SDK's reader). The position reached is kept
next to the console file, so a restarted agent resumes where the previous one stopped: no line
twice, none lost (a line is copied whole, so a half-copied line cannot be repeated either).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import UTC, datetime
from pathlib import Path

from ..._files import write_atomic
from ...sdk.logs import MAX_LINE_BYTES, LogEncoder

__all__ = ["ConsoleTailer"]

_BLOCK = 64 * 1024


class ConsoleTailer:
    """Copies `console` (raw serial bytes) into the CRI log `log`, from the offset in `mark`."""

    def __init__(self, console: Path, log: Path, mark: Path, *, poll: float = 0.2) -> None:
        self.console, self.log, self.mark, self.poll = console, log, mark, poll
        self._encoder = LogEncoder("stdout")

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
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if records:
                os.write(fd, records)
        finally:
            os.close(fd)
        self._save(offset + len(data))
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
