import struct

import pytest

from vkubelet.protocols.spdy.frames import (
    DataFrame,
    Frame,
    FrameError,
    FrameParser,
    GoAwayFrame,
    GoAwayStatus,
    HeadersFrame,
    PingFrame,
    RstStatus,
    RstStreamFrame,
    Setting,
    SettingsFrame,
    SynReplyFrame,
    SynStreamFrame,
    UnknownControlFrame,
    WindowUpdateFrame,
)

EVERY_KIND: list[Frame] = [
    DataFrame(1, b"hello"),
    DataFrame(0x7FFFFFFF, b"", fin=True),
    SynStreamFrame(3, b"\x01\x02", associated_stream_id=1, priority=7, slot=9, fin=True),
    SynStreamFrame(5, b"", unidirectional=True),
    SynReplyFrame(3, b"block", fin=True),
    RstStreamFrame(3, RstStatus.CANCEL),
    SettingsFrame((Setting(1, 4, 100), Setting(0, 7, 65536)), clear_persisted=True),
    SettingsFrame(),
    PingFrame(1),
    PingFrame(0xFFFFFFFF),
    GoAwayFrame(7, GoAwayStatus.INTERNAL_ERROR),
    HeadersFrame(9, b"hb", fin=True),
    WindowUpdateFrame(0, 65536),
    WindowUpdateFrame(3, 0x7FFFFFFF),
    UnknownControlFrame(5, 3, b"abc"),
]


def parse_all(data: bytes, max_payload: int = (1 << 24) - 1) -> list[Frame]:
    parser = FrameParser(max_payload)
    parser.receive(data)
    frames = []
    while (frame := parser.next_frame()) is not None:
        frames.append(frame)
    return frames


@pytest.mark.parametrize("frame", EVERY_KIND, ids=lambda f: type(f).__name__)
def test_every_frame_kind_round_trips(frame: Frame) -> None:
    assert parse_all(frame.serialize()) == [frame]


def test_control_frame_header_has_control_bit_version_3_type_flags_and_length() -> None:
    wire = RstStreamFrame(5, RstStatus.CANCEL).serialize()
    assert wire == bytes.fromhex("80030003000000080000000500000005")


def test_data_frame_header_is_stream_id_then_flags_and_length() -> None:
    assert DataFrame(3, b"ab", fin=True).serialize() == bytes.fromhex("0000000301000002") + b"ab"


def test_syn_stream_packs_priority_into_the_top_three_bits() -> None:
    wire = SynStreamFrame(1, b"", priority=5, slot=2).serialize()
    assert wire[16] == 5 << 5
    assert wire[17] == 2


def test_stream_of_frames_survives_chunking_at_every_byte_boundary() -> None:
    wire = b"".join(f.serialize() for f in EVERY_KIND)
    for cut in range(len(wire) + 1):
        parser = FrameParser()
        got = []
        for part in (wire[:cut], wire[cut:]):
            parser.receive(part)
            while (frame := parser.next_frame()) is not None:
                got.append(frame)
        assert got == EVERY_KIND, f"split at {cut}"
        assert parser.buffered == 0


def test_stream_of_frames_survives_byte_at_a_time_delivery() -> None:
    wire = b"".join(f.serialize() for f in EVERY_KIND)
    parser = FrameParser()
    got = []
    for i in range(len(wire)):
        parser.receive(wire[i : i + 1])
        while (frame := parser.next_frame()) is not None:
            got.append(frame)
    assert got == EVERY_KIND


def test_oversized_frame_is_refused_from_its_header_alone() -> None:
    parser = FrameParser(max_payload=100)
    parser.receive(struct.pack(">II", 1, 101))  # 8 bytes: a DATA header announcing 101 bytes
    with pytest.raises(FrameError, match="exceeds limit"):
        parser.next_frame()


def test_frame_at_exactly_the_limit_is_accepted() -> None:
    assert parse_all(DataFrame(1, b"x" * 100).serialize(), max_payload=100) == [
        DataFrame(1, b"x" * 100)
    ]


def test_partial_frame_buffer_never_exceeds_header_plus_limit() -> None:
    parser = FrameParser(max_payload=1000)
    wire = DataFrame(1, b"y" * 1000).serialize()
    parser.receive(wire[:-1])
    assert parser.next_frame() is None
    assert parser.buffered == 8 + 999


def control(frame_type: int, payload: bytes, flags: int = 0, version: int = 3) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, (flags << 24) | len(payload)) + payload


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (control(3, struct.pack(">II", 1, 0)), "status 0"),
        (control(3, struct.pack(">II", 0, 5)), "stream 0"),
        (control(3, b"\x00" * 7), "must be 8"),
        (control(6, b"\x00\x00\x00\x00"), "id 0"),
        (control(6, b"\x00\x00\x00\x01\x00"), "must be 4"),
        (control(7, b"\x00" * 4), "must be 8"),
        (control(9, b"\x00" * 12), "must be 8"),
        (control(1, b"\x00" * 9), "at least 10"),
        (control(1, b"\x00" * 10), "stream 0"),
        (control(2, b"\x00" * 3), "at least 4"),
        (control(8, b"\x00" * 4), "stream 0"),
        (control(4, struct.pack(">I", 2) + b"\x00" * 8), "declares 2"),
        (control(4, b""), "at least 4"),
        (control(3, struct.pack(">II", 1, 5), version=2), "version 2"),
        (struct.pack(">II", 0, 0), "stream 0"),
    ],
)
def test_malformed_frames_raise_frame_error(wire: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        parse_all(wire)


def test_unknown_control_types_are_handed_up_not_rejected() -> None:
    # NOOP (5) existed in SPDY/2; the spec says to ignore types we do not understand.
    assert parse_all(control(5, b"abc", flags=3)) == [UnknownControlFrame(5, 3, b"abc")]


def test_reserved_high_bit_of_stream_ids_is_ignored() -> None:
    wire = control(3, struct.pack(">II", 0x80000005, 5))
    assert parse_all(wire) == [RstStreamFrame(5, 5)]


def test_serializers_refuse_values_the_wire_cannot_carry() -> None:
    with pytest.raises(ValueError, match="stream id"):
        DataFrame(0, b"").serialize()
    with pytest.raises(ValueError, match="stream id"):
        SynReplyFrame(1 << 31, b"").serialize()
    with pytest.raises(ValueError, match="24 bits"):
        DataFrame(1, bytes(1 << 24)).serialize()


def test_parser_limit_must_fit_the_24_bit_length_field() -> None:
    with pytest.raises(ValueError):
        FrameParser(1 << 24)
    with pytest.raises(ValueError):
        FrameParser(0)
