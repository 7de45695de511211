"""Container logs as the kubelet keeps them (the CRI log format) and as `kubectl logs` shows them.

A runtime writes one record per output line, `<RFC3339Nano time> <stream> <tag> <line>` (stream
`stdout` or `stderr`; tag `F` for a full line, `P` for a piece of a longer one, or of a last line
that never got its newline), the format containerd and CRI-O write and the kubelet reads. A
provider that keeps logs in files gets both halves here:

- writing: `LogEncoder` (sans I/O) and `LogWriter`/`copy_to_log`, one file per container run;
  `append_log` with a `LogRotation` rotates that file as the kubelet does (`containerLogMaxSize`,
  `containerLogMaxFiles`: `<n>.log` renamed to `<n>.log.<time>`, the oldest removed);
- reading: `read_log` serves a `ContainerLogOptions` from such a file with bounded memory: a tail
  is found by reading backwards from the end, `since` by scanning lines, and `follow` waits for
  appends (and for a rotated file) until the run has ended; `previous` is the caller's choice of
  file (`run_log_path`).

A provider whose files live elsewhere (the ssh provider's, on a device) streams their bytes
through `LogParser`, `select_lines`/`render_chunks` and `render` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO, ClassVar

from .provider import ContainerLogOptions, ProviderError

__all__ = [
    "MAX_LINE_BYTES",
    "LogEncoder",
    "LogLine",
    "LogParser",
    "LogRotation",
    "LogWriter",
    "append_log",
    "copy_to_log",
    "format_rfc3339_nano",
    "parse_rfc3339",
    "previous_not_found",
    "read_log",
    "render",
    "render_chunks",
    "rotated_logs",
    "run_log_path",
    "select_lines",
    "stale_logs",
    "tail_offset",
]

MAX_LINE_BYTES = 16 * 1024  # containerd's default: longer lines are written in P pieces
_BLOCK = 64 * 1024

_TIME = re.compile(
    rb"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d\d):(\d\d))"
)
_STREAMS = (b"stdout", b"stderr")


@dataclass(frozen=True)
class LogLine:
    time: datetime  # aware, UTC
    stream: str  # "stdout" | "stderr"
    partial: bool  # a piece of a longer line: the next piece follows without a newline
    content: bytes  # without the newline


def parse_rfc3339(text: str | bytes) -> datetime | None:
    """An RFC 3339 time as an aware UTC datetime; None unless `text` is exactly one.

    Nanoseconds (which containerd writes) are cut to microseconds, all datetime can hold.
    """
    raw = text.encode() if isinstance(text, str) else text
    match = _TIME.fullmatch(raw)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    micros = int((fraction or b"0")[:6].ljust(6, b"0"))
    try:
        moment = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), micros, UTC
        )
        if zulu is None:
            offset = timedelta(hours=int(off_h), minutes=int(off_m))
            moment = moment - offset if sign == b"+" else moment + offset
    except (ValueError, OverflowError):
        return None
    return moment


def format_rfc3339_nano(moment: datetime) -> str:
    """Go's RFC3339Nano, as the kubelet prints `--timestamps`: no trailing zeros in the fraction."""
    moment = moment.astimezone(UTC) if moment.tzinfo is not None else moment
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        text += f".{moment.microsecond:06d}".rstrip("0")
    return text + "Z"


def _parse_line(raw: bytes) -> LogLine | None:
    parts = raw.split(b" ", 3)
    if len(parts) < 3:
        return None
    stamp, stream, tags = parts[:3]
    time = parse_rfc3339(stamp)
    tag = tags.split(b":", 1)[0]
    if time is None or stream not in _STREAMS or tag not in (b"F", b"P"):
        return None
    content = parts[3] if len(parts) == 4 else b""
    return LogLine(time=time, stream=stream.decode(), partial=tag == b"P", content=content)


class LogParser:
    """Lines out of a log file's bytes as they arrive, in chunks cut anywhere.

    A line that is not in the CRI format is skipped rather than failing the whole stream: a log
    is shown even if a device wrote something odd into it. A last line without its newline waits
    for the next chunk.
    """

    def __init__(self) -> None:
        self._rest = bytearray()

    def feed(self, data: bytes) -> list[LogLine]:
        self._rest += data
        end = self._rest.rfind(b"\n")
        if end < 0:
            return []
        complete = bytes(self._rest[:end])
        del self._rest[: end + 1]
        return [line for raw in complete.split(b"\n") if (line := _parse_line(raw)) is not None]


def select_lines(
    lines: list[LogLine], *, tail_lines: int | None, since: datetime | None
) -> list[LogLine]:
    """What `--tail` and `--since`/`--since-time` keep, in the kubelet's order: tail first.

    A negative tail means all lines, as it does for the kubelet.
    """
    if tail_lines is not None and tail_lines >= 0:
        lines = lines[len(lines) - tail_lines :] if tail_lines else []
    if since is not None:
        since = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        lines = [line for line in lines if line.time >= since]
    return lines


def render(line: LogLine, *, timestamps: bool) -> bytes:
    """One line as kubectl prints it: a partial line gets no newline, so pieces join up."""
    data = line.content if line.partial else line.content + b"\n"
    if timestamps:
        data = format_rfc3339_nano(line.time).encode() + b" " + data
    return data


async def render_chunks(
    chunks: AsyncIterable[bytes],
    *,
    since: datetime | None = None,
    timestamps: bool = False,
    parser: LogParser | None = None,
) -> AsyncIterator[bytes]:
    """A CRI log's bytes, arriving in chunks cut anywhere, as kubectl prints them: one output
    per chunk, lines before `since` left out. Memory is bounded by a chunk and a line."""
    parser = parser or LogParser()
    since = since if since is None or since.tzinfo is not None else since.replace(tzinfo=UTC)
    async for chunk in chunks:
        out = b"".join(
            render(line, timestamps=timestamps)
            for line in parser.feed(chunk)
            if since is None or line.time >= since
        )
        if out:
            yield out


# -- writing -----------------------------------------------------------------------------------
class LogEncoder:
    """One stream's output as CRI log records, sans I/O: a line is written once complete, a
    longer one than `max_line` in `P` pieces, and whatever is left at the end as a `P` record,
    as containerd does."""

    def __init__(self, stream: str, max_line: int = MAX_LINE_BYTES) -> None:
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"unknown stream {stream!r}")
        self._prefix = stream.encode()
        self._max = max_line
        self._rest = bytearray()

    def _record(self, now: datetime, tag: bytes, content: bytes | bytearray) -> bytes:
        return b" ".join((format_rfc3339_nano(now).encode(), self._prefix, tag, content)) + b"\n"

    def feed(self, data: bytes, now: datetime | None = None) -> bytes:
        now = now or datetime.now(UTC)
        self._rest += data
        out: list[bytes] = []
        while True:
            end = self._rest.find(b"\n", 0, self._max + 1)
            if end >= 0:
                out.append(self._record(now, b"F", self._rest[:end]))
                del self._rest[: end + 1]
            elif len(self._rest) >= self._max:
                out.append(self._record(now, b"P", self._rest[: self._max]))
                del self._rest[: self._max]
            else:
                return b"".join(out)

    def flush(self, now: datetime | None = None) -> bytes:
        """The end of the stream: a last line without its newline, as a partial record."""
        if not self._rest:
            return b""
        record = self._record(now or datetime.now(UTC), b"P", self._rest)
        self._rest.clear()
        return record


class LogWriter:
    """Appends a container run's stdout and stderr to one CRI log file.

    Each record is one `write` to a file opened for appending, so the two streams' records never
    interleave within a line. The file is created owner-only: logs may hold secrets.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._encoders = {name: LogEncoder(name) for name in ("stdout", "stderr")}

    def write(self, stream: str, data: bytes, now: datetime | None = None) -> None:
        if records := self._encoders[stream].feed(data, now):
            os.write(self._fd, records)

    def end(self, stream: str, now: datetime | None = None) -> None:
        """`stream` has ended: write what is left of its last line."""
        if records := self._encoders[stream].flush(now):
            os.write(self._fd, records)

    def close(self) -> None:
        for stream in self._encoders:
            self.end(stream)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


async def copy_to_log(source: asyncio.StreamReader, writer: LogWriter, stream: str) -> None:
    """Copy a process's stdout or stderr into its log until it ends."""
    while data := await source.read(_BLOCK):
        writer.write(stream, data)
    writer.end(stream)


@dataclass(frozen=True)
class LogRotation:
    """The kubelet's container log rotation: a run's log file never grows past `max_bytes`, and
    at most `max_files` files (the current one and the newest rotated ones) are kept, so a
    chatty container cannot fill the disk. `kubectl logs` reads the current file (as from the
    kubelet, rotated files are for whoever reads the directory); `-f` goes on into the next."""

    max_bytes: int = 10 * 2**20  # containerLogMaxSize
    max_files: int = 5  # containerLogMaxFiles

    #: The least `max_bytes`: room for a few of the longest records (a line is cut into
    #: `MAX_LINE_BYTES` pieces), so that a file always takes whole records.
    MIN_BYTES: ClassVar[int] = 64 * 1024

    def __post_init__(self) -> None:
        if self.max_bytes < self.MIN_BYTES or self.max_files < 2:
            raise ValueError(f"a log rotation needs at least {self.MIN_BYTES} bytes and 2 files")


def rotated_logs(path: Path) -> list[Path]:
    """The rotated files of the log `path`, oldest first (their suffix is the rotation time)."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.*"))


def append_log(path: Path, records: bytes, rotation: LogRotation) -> None:
    """Append whole CRI records (newline-terminated) to the log `path`, rotating it first
    whenever they would make it larger than `rotation.max_bytes`.

    Rotation renames the file (a reader following it keeps its open file to the end, then
    opens the new one: `read_log`) and removes the oldest rotated files beyond
    `rotation.max_files - 1`. The files are owner-only: logs may hold secrets.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while records:
        size = path.stat().st_size if path.exists() else 0
        room = rotation.max_bytes - size
        cut = records.rfind(b"\n", 0, room) + 1 if len(records) > room else len(records)
        if cut == 0:  # not one more whole record fits: a new file
            if size == 0:  # one record longer than a file (not with a LogEncoder's records)
                cut = records.find(b"\n") + 1 or len(records)
            else:
                _rotate(path, rotation)
                continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, records[:cut])
        finally:
            os.close(fd)
        records = records[cut:]


def _rotate(path: Path, rotation: LogRotation) -> None:
    """`<n>.log` -> `<n>.log.<time>` (the kubelet's name, to the microsecond: several rotations
    may fall in one second, and a name taken twice would overwrite a file)."""
    moment = datetime.now(UTC)
    while (rotated := path.with_name(f"{path.name}.{moment:%Y%m%d-%H%M%S.%f}")).exists():
        moment += timedelta(microseconds=1)
    path.rename(rotated)
    for old in rotated_logs(path)[: -(rotation.max_files - 1)]:
        old.unlink(missing_ok=True)


def run_log_path(directory: Path, container: str, restart_count: int) -> Path:
    """Where a container's run `restart_count` logs: `<directory>/<container>/<n>.log`.

    `kubectl logs -p` reads run n-1; a provider keeps the current and the previous run's files
    and deletes older ones when a run starts.
    """
    return directory / container / f"{int(restart_count)}.log"


def stale_logs(directory: Path, run: int) -> list[Path]:
    """The files of a container's log `directory` no longer needed once run `run` starts: those
    of runs before the previous one, and the previous run's rotated files (`-p` reads only its
    last file, as from the kubelet)."""
    stale = []
    for path in directory.glob("*.log*"):
        number, _, rotated = path.name.partition(".log")
        if number.isdigit() and (int(number) < run - 1 or (rotated and int(number) < run)):
            stale.append(path)
    return sorted(stale)


def previous_not_found(container: str, pod: str) -> ProviderError:
    """The kubelet's error for `kubectl logs -p` of a container that never restarted."""
    return ProviderError(
        "NotFound", f'previous terminated container "{container}" in pod "{pod}" not found'
    )


# -- reading --------------------------------------------------------------------------------------
def tail_offset(file: BinaryIO, lines: int, block: int = _BLOCK) -> int:
    """Where the last `lines` complete lines of `file` begin, read backwards a block at a time:
    the cost is the tail's size, not the file's. A last line without its newline is not yet a
    line and is not counted."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    position, end, found = size, None, 0
    while position > 0:
        start = max(0, position - block)
        file.seek(start)
        data = file.read(position - start)
        index = len(data)
        while (index := data.rfind(b"\n", 0, index)) >= 0:
            if end is None:
                end = start + index + 1  # after the last complete line
                if lines == 0:
                    return end
                continue
            found += 1
            if found == lines:
                return start + index + 1
        position = start
    return 0 if end is not None else size


def _same_file(file: BinaryIO, path: Path) -> bool:
    try:
        now = path.stat()
    except FileNotFoundError:
        return True  # gone, and nothing new yet: keep reading what we have
    then = os.fstat(file.fileno())
    return (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino)


def _next_file(file: BinaryIO, path: Path) -> BinaryIO | None:
    """The file that follows `file`, rotated away from `path`: the oldest rotated file newer
    than it (a writer faster than the reader may have rotated several times meanwhile), else
    the current one. Rotated files are removed oldest first, so when `file` is no longer among
    them every one left is newer (and its inode, held open, cannot have been reused)."""
    then = os.fstat(file.fileno())
    rotated = rotated_logs(path)
    for index, candidate in enumerate(rotated):
        with contextlib.suppress(FileNotFoundError):
            now = candidate.stat()
            if (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino):
                rotated = rotated[index + 1 :]
                break
    for candidate in [*rotated, path]:
        with contextlib.suppress(FileNotFoundError):
            return candidate.open("rb")
    return None


async def read_log(
    path: Path,
    options: ContainerLogOptions,
    *,
    running: Callable[[], bool] | None = None,
    poll_seconds: float = 0.2,
) -> AsyncIterator[bytes]:
    """A CRI log file as `kubectl logs` with `options` shows it (`previous` aside: pass the
    previous run's path), in chunks, with bounded memory.

    With `follow`, appended lines are shown as they come (the file is polled every
    `poll_seconds`; one that is rotated, i.e. replaced by a new file at `path`, is read to its
    end, then the files after it from their start: `append_log`'s rotated ones first) until
    `running()` turns false — the run has ended — and everything it wrote has been shown.
    Without `running`, following lasts until cancelled.
    """
    since = options.earliest()
    remaining = options.limit_bytes
    tail = options.tail_lines
    parser = LogParser()
    file: BinaryIO | None = None
    try:
        while file is None:
            try:
                file = path.open("rb")
            except FileNotFoundError:
                if not options.follow or (running is not None and not running()):
                    return
                await asyncio.sleep(poll_seconds)
        if tail is not None and tail >= 0:
            file.seek(tail_offset(file, tail))
        ending = rotated = False
        while True:
            data = file.read(_BLOCK)
            if data:
                out = b"".join(
                    render(line, timestamps=options.timestamps)
                    for line in parser.feed(data)
                    if since is None or line.time >= since
                )
                if remaining is not None:
                    out = out[:remaining]
                    remaining -= len(out)
                if out:
                    yield out
                if remaining == 0:
                    return
                continue
            if not options.follow or ending:
                return
            if rotated:  # the old file read to its end after the rename: the next one now
                if (following := _next_file(file, path)) is None:
                    await asyncio.sleep(poll_seconds)  # (not there yet)
                    continue
                file.close()
                file, rotated, parser = following, False, LogParser()
                continue
            if not _same_file(file, path):
                # Rotated (renamed, a new file at `path`): what was written to the old file
                # between the last read and the rename is read first.
                rotated = True
                continue
            if file.tell() > os.fstat(file.fileno()).st_size:  # truncated in place
                file.seek(0)
            # One more read after the run has ended: whatever it wrote last.
            ending = running is not None and not running()
            if not ending:
                await asyncio.sleep(poll_seconds)
    finally:
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
