"""CRI log lines: parsed from chunks cut anywhere, selected as `--tail` and `--since` say, and
printed as `kubectl logs` prints them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vkubelet.sdk import logs
from vkubelet.sdk.logs import (
    MAX_LINE_BYTES,
    LogEncoder,
    LogLine,
    LogParser,
    LogRotation,
    LogWriter,
    append_log,
    format_rfc3339_nano,
    parse_rfc3339,
    read_log,
    render,
    render_chunks,
    rotated_logs,
    select_lines,
    stale_logs,
    tail_offset,
)
from vkubelet.sdk.provider import ContainerLogOptions
from vkubelet.testing.harness import eventually

T0 = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC)
LOG = (
    b"2024-05-01T10:00:00Z stdout F hello world\n"
    b"2024-05-01T10:00:01.123456789Z stderr F oops\n"
    b"2024-05-01T10:00:02Z stdout P part one \n"
    b"2024-05-01T10:00:02Z stdout F and two\n"
    b"2024-05-01T10:00:03Z stdout F \n"
    b"2024-05-01T12:00:04+02:00 stdout F  two  spaces \xff\r\n"
)


def test_lines_are_parsed_with_their_time_stream_and_content() -> None:
    lines = LogParser().feed(LOG)
    assert [(line.stream, line.partial, line.content) for line in lines] == [
        ("stdout", False, b"hello world"),
        ("stderr", False, b"oops"),
        ("stdout", True, b"part one "),
        ("stdout", False, b"and two"),
        ("stdout", False, b""),
        ("stdout", False, b" two  spaces \xff\r"),
    ]
    assert lines[1].time == T0 + timedelta(seconds=1, microseconds=123456)
    assert lines[5].time == T0 + timedelta(seconds=4)  # +02:00 is read as such
    assert all(line.time.tzinfo is UTC for line in lines)


@given(st.lists(st.integers(min_value=0, max_value=len(LOG)), max_size=10))
def test_chunks_cut_anywhere_give_the_same_lines(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(LOG)]
    parser = LogParser()
    lines: list[LogLine] = []
    for start, end in itertools.pairwise(bounds):
        lines += parser.feed(LOG[start:end])
    assert lines == LogParser().feed(LOG)


def test_a_line_waits_for_its_newline() -> None:
    parser = LogParser()
    assert parser.feed(b"2024-05-01T10:00:00Z stdout F no newline yet") == []
    [line] = parser.feed(b"\n")
    assert line.content == b"no newline yet"


def test_malformed_lines_are_skipped() -> None:
    garbage = (
        b"not a log line\n"
        b"2024-05-01T10:00:00Z stdin F wrong stream\n"
        b"2024-05-01T10:00:00Z stdout X wrong tag\n"
        b"2024-13-01T10:00:00Z stdout F no such month\n"
        b"2024-05-01 10:00:00 stdout F no T\n"
        b"2024-05-01T10:00:00Z\n"
        b"\n"
        b"2024-05-01T10:00:00Z stdout F:x tags may follow\n"
        b"2024-05-01T10:00:00Z stdout F\n"
    )
    lines = LogParser().feed(garbage)
    assert [line.content for line in lines] == [b"tags may follow", b""]


@given(st.binary(max_size=300))
def test_the_parser_never_fails(data: bytes) -> None:
    parser = LogParser()
    parser.feed(data)
    parser.feed(LOG)


def line_at(seconds: int, content: bytes = b"x") -> LogLine:
    return LogLine(T0 + timedelta(seconds=seconds), "stdout", False, content)


def test_tail_keeps_the_last_lines_and_since_the_recent_ones() -> None:
    lines = [line_at(i, str(i).encode()) for i in range(5)]
    assert select_lines(lines, tail_lines=None, since=None) == lines
    assert select_lines(lines, tail_lines=2, since=None) == lines[3:]
    assert select_lines(lines, tail_lines=0, since=None) == []
    assert select_lines(lines, tail_lines=-1, since=None) == lines
    assert select_lines(lines, tail_lines=10, since=None) == lines
    assert select_lines(lines, tail_lines=None, since=T0 + timedelta(seconds=3)) == lines[3:]
    # The tail is taken first, as the kubelet does: then the time.
    assert select_lines(lines, tail_lines=3, since=T0 + timedelta(seconds=3)) == lines[3:]
    assert select_lines(lines, tail_lines=1, since=T0 + timedelta(seconds=9)) == []
    naive = datetime(2024, 5, 1, 10, 0, 4)
    assert select_lines(lines, tail_lines=None, since=naive) == lines[4:]  # naive is UTC


def test_lines_render_as_kubectl_prints_them() -> None:
    line = LogLine(T0 + timedelta(microseconds=500000), "stdout", False, b"hello")
    assert render(line, timestamps=False) == b"hello\n"
    assert render(line, timestamps=True) == b"2024-05-01T10:00:00.5Z hello\n"
    part = LogLine(T0, "stderr", True, b"to be continued")
    assert render(part, timestamps=False) == b"to be continued"
    assert render(part, timestamps=True) == b"2024-05-01T10:00:00Z to be continued"


def test_times_are_rfc3339() -> None:
    assert parse_rfc3339("2024-05-01T10:00:00Z") == T0
    assert parse_rfc3339("2024-05-01t10:00:00.000000001z") == T0
    assert parse_rfc3339("2024-05-01T08:30:00-01:30") == T0
    for bad in ("", "2024-05-01", "2024-05-01T10:00:00", "2024-02-30T10:00:00Z", "x" * 30):
        assert parse_rfc3339(bad) is None
    assert format_rfc3339_nano(T0) == "2024-05-01T10:00:00Z"
    assert format_rfc3339_nano(T0 + timedelta(microseconds=120)) == "2024-05-01T10:00:00.00012Z"
    plus_two = T0.astimezone(timezone(timedelta(hours=2)))
    assert format_rfc3339_nano(plus_two) == "2024-05-01T10:00:00Z"


# -- writing and reading files ---------------------------------------------------------------------
def test_the_encoder_writes_full_lines_and_long_ones_in_partial_pieces() -> None:
    encoder = LogEncoder("stderr", max_line=4)
    out = encoder.feed(b"ab\ncdefgh", T0) + encoder.feed(b"i\nxy", T0) + encoder.flush(T0)
    assert out == (
        b"2024-05-01T10:00:00Z stderr F ab\n"
        b"2024-05-01T10:00:00Z stderr P cdef\n"
        b"2024-05-01T10:00:00Z stderr F ghi\n"
        b"2024-05-01T10:00:00Z stderr P xy\n"  # a last line without its newline is partial
    )
    lines = LogParser().feed(out)
    assert b"".join(render(line, timestamps=False) for line in lines) == b"ab\ncdefghi\nxy"


def write_log(path: Path, count: int) -> None:
    writer = LogWriter(path)
    for i in range(count):
        writer.write("stdout", f"line {i}\n".encode(), T0 + timedelta(seconds=i))
    writer.close()


async def collect(chunks: object) -> bytes:
    return b"".join([chunk async for chunk in chunks])  # type: ignore[attr-defined]


async def test_a_log_file_reads_back_with_tail_since_timestamps_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "c" / "0.log"
    write_log(path, 5)
    assert path.stat().st_mode & 0o777 == 0o600
    assert await collect(read_log(path, ContainerLogOptions())) == b"".join(
        f"line {i}\n".encode() for i in range(5)
    )
    assert await collect(read_log(path, ContainerLogOptions(tail_lines=2))) == b"line 3\nline 4\n"
    assert await collect(read_log(path, ContainerLogOptions(tail_lines=0))) == b""
    since = ContainerLogOptions(since_time=T0 + timedelta(seconds=3))
    assert await collect(read_log(path, since)) == b"line 3\nline 4\n"
    stamped = ContainerLogOptions(tail_lines=1, timestamps=True)
    assert await collect(read_log(path, stamped)) == b"2024-05-01T10:00:04Z line 4\n"
    assert await collect(read_log(path, ContainerLogOptions(limit_bytes=9))) == b"line 0\nli"
    assert await collect(read_log(tmp_path / "missing.log", ContainerLogOptions())) == b""


def test_a_tail_is_found_from_the_end_without_reading_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    write_log(path, 20000)  # ~1 MB
    reads: list[int] = []
    with path.open("rb") as f:
        real_read = f.read

        def counting_read(n: int | None = -1) -> bytes:
            data = real_read(n)
            reads.append(len(data))
            return data

        f.read = counting_read  # type: ignore[method-assign]
        offset = tail_offset(f, 3, block=4096)
        f.seek(offset)
        assert [line.content for line in LogParser().feed(real_read())] == [
            b"line 19997",
            b"line 19998",
            b"line 19999",
        ]
    assert sum(reads) <= 4096


def test_tail_counts_complete_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(b"a\nb\nincomplete")
    with path.open("rb") as f:
        assert tail_offset(f, 1, block=3) == 2
        assert tail_offset(f, 0) == 4
        assert tail_offset(f, 5) == 0


async def test_following_shows_appended_lines_until_the_run_ends(tmp_path: Path) -> None:
    path = tmp_path / "0.log"
    writer = LogWriter(path)
    writer.write("stdout", b"before\n")
    running = True
    seen: list[bytes] = []

    async def follow() -> None:
        options = ContainerLogOptions(follow=True, tail_lines=0)
        async for chunk in read_log(path, options, running=lambda: running, poll_seconds=0.01):
            seen.append(chunk)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    writer.write("stdout", b"after\n")
    await eventually(lambda: seen == [b"after\n"], what="the appended line")
    writer.write("stderr", b"last words\n")
    running = False
    await asyncio.wait_for(task, 5)  # ends by itself, once the last line is shown
    assert b"".join(seen) == b"after\nlast words\n"
    writer.close()


async def test_following_a_rotated_file_goes_on_with_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "0.log"
    writer = LogWriter(path)
    writer.write("stdout", b"one\n")
    seen: list[bytes] = []

    async def follow() -> None:
        options = ContainerLogOptions(follow=True)
        async for chunk in read_log(path, options, poll_seconds=0.01):
            seen.append(chunk)

    task = asyncio.create_task(follow())
    await eventually(lambda: b"".join(seen) == b"one\n", what="the first line")
    writer.close()
    path.rename(tmp_path / "0.log.1")
    writer = LogWriter(path)
    writer.write("stdout", b"two\n")
    await eventually(lambda: b"".join(seen) == b"one\ntwo\n", what="the new file")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    writer.close()


async def test_a_line_written_to_the_old_file_just_before_its_rotation_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a chatty container hits: the reader has read the old file to its end, then the
    writer appends one more line, renames the file and starts a new one, all before the reader
    looks at the path again."""
    path = tmp_path / "0.log"
    path.write_bytes(b"2024-05-01T10:00:00Z stdout F one\n")
    same_file = logs._same_file
    raced = False

    def rotate_first(file: object, at: Path) -> bool:
        nonlocal raced
        if not raced:
            raced = True
            with path.open("ab") as old:
                old.write(b"2024-05-01T10:00:01Z stdout F two\n")
            path.rename(tmp_path / "0.log.1")
            path.write_bytes(b"2024-05-01T10:00:02Z stdout F three\n")
        return same_file(file, at)  # type: ignore[arg-type]

    monkeypatch.setattr(logs, "_same_file", rotate_first)
    seen: list[bytes] = []

    async def follow() -> None:
        async for chunk in read_log(path, ContainerLogOptions(follow=True), poll_seconds=0.01):
            seen.append(chunk)

    task = asyncio.create_task(follow())
    await eventually(lambda: b"three" in b"".join(seen), what="the new file's line")
    assert b"".join(seen) == b"one\ntwo\nthree\n"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _records(first: int, count: int) -> bytes:
    encoder = LogEncoder("stdout")
    lines = (b"%06d " % i + b"x" * 93 + b"\n" for i in range(first, first + count))
    return b"".join(encoder.feed(line, T0) for line in lines)


def test_a_rotated_log_keeps_whole_records_within_its_size_and_file_count(tmp_path: Path) -> None:
    path = tmp_path / "c" / "0.log"
    rotation = LogRotation(max_bytes=LogRotation.MIN_BYTES, max_files=3)
    written = 0
    for batch in range(40):  # ~1 MB: in batches larger than a file, and small ones
        count = 50 if batch % 2 else 500
        append_log(path, _records(written, count), rotation)
        written += count
    rotated = rotated_logs(path)
    assert len(rotated) == 2  # and the current file: 3
    for file in [*rotated, path]:
        data = file.read_bytes()
        assert 0 < len(data) <= rotation.max_bytes and data.endswith(b"\n")
        assert [line.content[:6] for line in LogParser().feed(data)]  # whole records only
        assert file.stat().st_mode & 0o777 == 0o600
    # Oldest first, and what is kept is the newest output, without a gap between the files.
    numbers = [
        int(line.content[:6]) for f in [*rotated, path] for line in LogParser().feed(f.read_bytes())
    ]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert numbers[-1] == written - 1


def test_a_new_run_leaves_the_previous_run_s_last_file_and_its_own(tmp_path: Path) -> None:
    names = ["0.log", "0.log.20260101-000000.000001", "1.log", "1.log.20260101-000001.000001"]
    names += ["2.log", "2.log.20260101-000002.000001", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    stale = [p.name for p in stale_logs(tmp_path, 2)]
    assert stale == ["0.log", "0.log.20260101-000000.000001", "1.log.20260101-000001.000001"]


def test_a_rotation_needs_room_for_two_of_the_longest_records() -> None:
    assert LogRotation.MIN_BYTES > 3 * MAX_LINE_BYTES
    with pytest.raises(ValueError, match="at least"):
        LogRotation(max_bytes=MAX_LINE_BYTES)
    with pytest.raises(ValueError, match="2 files"):
        LogRotation(max_files=1)


@pytest.mark.parametrize("files", [2, 10])
async def test_following_a_log_across_many_rotations_shows_every_line_once(
    tmp_path: Path, files: int
) -> None:
    """With 2 files the reader keeps up with each rotation; with 10 it sees none of them
    happen: the files rotated meanwhile are read in order, then the current one."""
    path = tmp_path / "0.log"
    rotation = LogRotation(max_bytes=LogRotation.MIN_BYTES, max_files=files)
    seen: list[bytes] = []

    async def follow() -> None:
        options = ContainerLogOptions(follow=True)
        async for chunk in read_log(path, options, poll_seconds=0.001):
            seen.append(chunk)

    encoder = LogEncoder("stdout")
    append_log(path, encoder.feed(b"%06d first\n" % 0, T0), rotation)
    task = asyncio.create_task(follow())
    await eventually(lambda: bool(seen), what="the first line")
    for i in range(1, 3000):  # ~400 KB through 64 KiB files: 5 rotations
        append_log(path, encoder.feed(b"%06d " % i + b"y" * 90 + b"\n", T0), rotation)
        if files == 2 and i % 20 == 0:
            await asyncio.sleep(0)  # the reader keeps up (a file removed unread is lost)
    await eventually(lambda: b"".join(seen).endswith(b"002999 " + b"y" * 90 + b"\n"), what="all")
    numbers = [int(line[:6]) for line in b"".join(seen).splitlines()]
    assert numbers == list(range(3000))
    assert len(rotated_logs(path)) >= min(files - 1, 4)  # rotated, and kept for the reader
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_remote_chunks_render_line_by_line_with_since() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(LOG), 7):
            yield LOG[i : i + 7]

    since = T0 + timedelta(seconds=2)
    out = await collect(render_chunks(chunks(), since=since))
    assert out == b"part one and two\n\n two  spaces \xff\r\n"
