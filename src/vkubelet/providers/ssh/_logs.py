"""Container logs as the kubelet keeps them (the CRI log format) and as `kubectl logs` shows them.

A device's supervisor writes one line per output line, `<RFC3339 time> <stream> <tags> <line>`
(stream `stdout` or `stderr`; tag `F` for a full line, `P` for a part of a longer one), the
format containerd and CRI-O write and the kubelet reads. This module only turns those bytes into
lines and lines into what kubectl prints; reading files and following them is the caller's job,
and so is `limitBytes`, which cuts the rendered bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["LogLine", "LogParser", "format_rfc3339_nano", "parse_rfc3339", "render", "select_lines"]

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
