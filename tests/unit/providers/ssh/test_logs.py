"""CRI log lines: parsed from chunks cut anywhere, selected as `--tail` and `--since` say, and
printed as `kubectl logs` prints them."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from vkubelet.providers.ssh._logs import (
    LogLine,
    LogParser,
    format_rfc3339_nano,
    parse_rfc3339,
    render,
    select_lines,
)

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
