"""SPDY/3.1 frame codec: frames as values, bytes in and out, no compression and no state.

Header blocks stay compressed here. Decompressing them needs the connection-wide zlib context,
which belongs to the connection, so keeping it out of the codec lets the codec be tested alone.

Layouts (big-endian), as the kubelet's peers write them (moby/spdystream):

- control frame: ``1 | version(15) | type(16)``, then ``flags(8) | length(24)``, then payload;
- data frame: ``0 | stream-id(31)``, then ``flags(8) | length(24)``, then payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

VERSION = 3
FRAME_HEADER_SIZE = 8
MAX_PAYLOAD = (1 << 24) - 1
MAX_STREAM_ID = (1 << 31) - 1

FLAG_FIN = 0x01
FLAG_UNIDIRECTIONAL = 0x02

_U32 = struct.Struct(">I")
_U32X2 = struct.Struct(">II")
_SYN_STREAM_FIXED = struct.Struct(">IIBB")
_STREAM_ID_MASK = 0x7FFFFFFF


class FrameType(IntEnum):
    SYN_STREAM = 1
    SYN_REPLY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PING = 6
    GOAWAY = 7
    HEADERS = 8
    WINDOW_UPDATE = 9


class RstStatus(IntEnum):
    PROTOCOL_ERROR = 1
    INVALID_STREAM = 2
    REFUSED_STREAM = 3
    UNSUPPORTED_VERSION = 4
    CANCEL = 5
    INTERNAL_ERROR = 6
    FLOW_CONTROL_ERROR = 7
    STREAM_IN_USE = 8
    STREAM_ALREADY_CLOSED = 9
    INVALID_CREDENTIALS = 10
    FRAME_TOO_LARGE = 11


class GoAwayStatus(IntEnum):
    OK = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2


class FrameError(Exception):
    """The byte stream is not valid SPDY/3; the connection cannot continue after this."""


def _control_header(frame_type: int, flags: int, length: int) -> bytes:
    if not 0 <= length <= MAX_PAYLOAD:
        raise ValueError(f"control frame payload of {length} bytes does not fit 24 bits")
    return _U32X2.pack(0x80000000 | (VERSION << 16) | frame_type, (flags << 24) | length)


def _check_stream_id(stream_id: int) -> None:
    if not 0 < stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id} is outside 1..2^31-1")


@dataclass(frozen=True, slots=True)
class DataFrame:
    stream_id: int
    data: bytes
    fin: bool = False

    def serialize(self) -> bytes:
        _check_stream_id(self.stream_id)
        if len(self.data) > MAX_PAYLOAD:
            raise ValueError("DATA payload does not fit 24 bits; split it first")
        flags = FLAG_FIN if self.fin else 0
        return _U32X2.pack(self.stream_id, (flags << 24) | len(self.data)) + self.data


@dataclass(frozen=True, slots=True)
class SynStreamFrame:
    stream_id: int
    header_block: bytes
    associated_stream_id: int = 0
    priority: int = 0
    slot: int = 0
    fin: bool = False
    unidirectional: bool = False

    def serialize(self) -> bytes:
        _check_stream_id(self.stream_id)
        flags = (FLAG_FIN if self.fin else 0) | (FLAG_UNIDIRECTIONAL if self.unidirectional else 0)
        fixed = _SYN_STREAM_FIXED.pack(
            self.stream_id,
            self.associated_stream_id & _STREAM_ID_MASK,
            (self.priority & 0x07) << 5,
            self.slot & 0xFF,
        )
        payload = fixed + self.header_block
        return _control_header(FrameType.SYN_STREAM, flags, len(payload)) + payload


def _stream_header_frame(kind: FrameType, stream_id: int, block: bytes, fin: bool) -> bytes:
    """SYN_REPLY and HEADERS share a layout: stream id, then a header block."""
    _check_stream_id(stream_id)
    payload = _U32.pack(stream_id) + block
    return _control_header(kind, FLAG_FIN if fin else 0, len(payload)) + payload


@dataclass(frozen=True, slots=True)
class SynReplyFrame:
    stream_id: int
    header_block: bytes
    fin: bool = False

    def serialize(self) -> bytes:
        return _stream_header_frame(
            FrameType.SYN_REPLY, self.stream_id, self.header_block, self.fin
        )


@dataclass(frozen=True, slots=True)
class RstStreamFrame:
    stream_id: int
    status: int

    def serialize(self) -> bytes:
        _check_stream_id(self.stream_id)
        return _control_header(FrameType.RST_STREAM, 0, 8) + _U32X2.pack(
            self.stream_id, self.status
        )


@dataclass(frozen=True, slots=True)
class Setting:
    flags: int
    id: int
    value: int


@dataclass(frozen=True, slots=True)
class SettingsFrame:
    settings: tuple[Setting, ...] = ()
    clear_persisted: bool = False

    def serialize(self) -> bytes:
        body = bytearray(_U32.pack(len(self.settings)))
        for s in self.settings:
            body += _U32X2.pack(((s.flags & 0xFF) << 24) | (s.id & 0xFFFFFF), s.value)
        flags = 0x01 if self.clear_persisted else 0
        return _control_header(FrameType.SETTINGS, flags, len(body)) + bytes(body)


@dataclass(frozen=True, slots=True)
class PingFrame:
    ping_id: int

    def serialize(self) -> bytes:
        return _control_header(FrameType.PING, 0, 4) + _U32.pack(self.ping_id)


@dataclass(frozen=True, slots=True)
class GoAwayFrame:
    last_good_stream_id: int
    status: int = GoAwayStatus.OK

    def serialize(self) -> bytes:
        return _control_header(FrameType.GOAWAY, 0, 8) + _U32X2.pack(
            self.last_good_stream_id & _STREAM_ID_MASK, self.status
        )


@dataclass(frozen=True, slots=True)
class HeadersFrame:
    stream_id: int
    header_block: bytes
    fin: bool = False

    def serialize(self) -> bytes:
        return _stream_header_frame(FrameType.HEADERS, self.stream_id, self.header_block, self.fin)


@dataclass(frozen=True, slots=True)
class WindowUpdateFrame:
    stream_id: int
    delta: int

    def serialize(self) -> bytes:
        return _control_header(FrameType.WINDOW_UPDATE, 0, 8) + _U32X2.pack(
            self.stream_id & _STREAM_ID_MASK, self.delta & 0x7FFFFFFF
        )


@dataclass(frozen=True, slots=True)
class UnknownControlFrame:
    """A control frame of a type SPDY/3 does not define. The spec says to ignore these rather
    than fail, so the parser hands them up instead of raising."""

    frame_type: int
    flags: int
    payload: bytes

    def serialize(self) -> bytes:
        return _control_header(self.frame_type, self.flags, len(self.payload)) + self.payload


Frame = (
    DataFrame
    | SynStreamFrame
    | SynReplyFrame
    | RstStreamFrame
    | SettingsFrame
    | PingFrame
    | GoAwayFrame
    | HeadersFrame
    | WindowUpdateFrame
    | UnknownControlFrame
)


class FrameParser:
    """Incremental parser: feed any chunking of the byte stream, pull whole frames out.

    A frame whose declared length exceeds ``max_payload`` is refused as soon as its 8-byte header
    is seen, so a hostile length never makes us buffer more than ``8 + max_payload`` bytes of it.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        if not 0 < max_payload <= MAX_PAYLOAD:
            raise ValueError(f"max_payload must be in 1..{MAX_PAYLOAD}")
        self.max_payload = max_payload
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def receive(self, data: bytes) -> None:
        self._buf += data

    def discard(self) -> None:
        """Drop buffered input, e.g. once the connection has failed and will read no more."""
        self._buf.clear()
        self._pos = 0

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None until more bytes arrive.

        Raises FrameError on bytes that cannot be SPDY/3; the parser is unusable afterwards.
        """
        available = len(self._buf) - self._pos
        if available < FRAME_HEADER_SIZE:
            self._compact()
            return None
        word0, word1 = _U32X2.unpack_from(self._buf, self._pos)
        flags = word1 >> 24
        length = word1 & 0xFFFFFF
        if length > self.max_payload:
            raise FrameError(f"frame payload of {length} bytes exceeds limit {self.max_payload}")
        if available < FRAME_HEADER_SIZE + length:
            self._compact()
            return None
        start = self._pos + FRAME_HEADER_SIZE
        payload = bytes(self._buf[start : start + length])
        self._pos = start + length
        if word0 & 0x80000000:
            version = (word0 >> 16) & 0x7FFF
            if version != VERSION:
                raise FrameError(f"unsupported SPDY version {version}")
            return _parse_control(word0 & 0xFFFF, flags, payload)
        stream_id = word0 & _STREAM_ID_MASK
        if stream_id == 0:
            raise FrameError("DATA frame on stream 0")
        return DataFrame(stream_id, payload, bool(flags & FLAG_FIN))

    def _compact(self) -> None:
        # One deletion per exhausted batch keeps long byte streams linear, not quadratic.
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0


def _need(frame_type: FrameType, payload: bytes, exact: int | None = None, least: int = 0) -> None:
    n = len(payload)
    if exact is not None and n != exact:
        raise FrameError(f"{frame_type.name} payload must be {exact} bytes, got {n}")
    if n < least:
        raise FrameError(f"{frame_type.name} payload must be at least {least} bytes, got {n}")


def _nonzero_stream(frame_type: FrameType, stream_id: int) -> int:
    if stream_id == 0:
        raise FrameError(f"{frame_type.name} on stream 0")
    return stream_id


def _parse_control(type_code: int, flags: int, payload: bytes) -> Frame:
    try:
        frame_type = FrameType(type_code)
    except ValueError:
        return UnknownControlFrame(type_code, flags, payload)

    if frame_type is FrameType.SYN_STREAM:
        _need(frame_type, payload, least=10)
        sid, assoc, pri, slot = _SYN_STREAM_FIXED.unpack_from(payload)
        return SynStreamFrame(
            stream_id=_nonzero_stream(frame_type, sid & _STREAM_ID_MASK),
            header_block=payload[10:],
            associated_stream_id=assoc & _STREAM_ID_MASK,
            priority=pri >> 5,
            slot=slot,
            fin=bool(flags & FLAG_FIN),
            unidirectional=bool(flags & FLAG_UNIDIRECTIONAL),
        )
    if frame_type is FrameType.SYN_REPLY or frame_type is FrameType.HEADERS:
        _need(frame_type, payload, least=4)
        sid = _nonzero_stream(frame_type, _U32.unpack_from(payload)[0] & _STREAM_ID_MASK)
        cls = SynReplyFrame if frame_type is FrameType.SYN_REPLY else HeadersFrame
        return cls(sid, payload[4:], bool(flags & FLAG_FIN))
    if frame_type is FrameType.RST_STREAM:
        _need(frame_type, payload, exact=8)
        sid, status = _U32X2.unpack(payload)
        if status == 0:
            raise FrameError("RST_STREAM with status 0")
        return RstStreamFrame(_nonzero_stream(frame_type, sid & _STREAM_ID_MASK), status)
    if frame_type is FrameType.SETTINGS:
        _need(frame_type, payload, least=4)
        (count,) = _U32.unpack_from(payload)
        if len(payload) != 4 + 8 * count:
            raise FrameError(f"SETTINGS declares {count} entries but carries {len(payload)} bytes")
        entries = []
        for offset in range(4, len(payload), 8):
            flag_id, value = _U32X2.unpack_from(payload, offset)
            entries.append(Setting(flag_id >> 24, flag_id & 0xFFFFFF, value))
        return SettingsFrame(tuple(entries), bool(flags & 0x01))
    if frame_type is FrameType.PING:
        _need(frame_type, payload, exact=4)
        (ping_id,) = _U32.unpack(payload)
        if ping_id == 0:
            raise FrameError("PING with id 0")
        return PingFrame(ping_id)
    if frame_type is FrameType.GOAWAY:
        _need(frame_type, payload, exact=8)
        last, status = _U32X2.unpack(payload)
        return GoAwayFrame(last & _STREAM_ID_MASK, status)
    # Only WINDOW_UPDATE is left.
    _need(frame_type, payload, exact=8)
    sid, delta = _U32X2.unpack(payload)
    return WindowUpdateFrame(sid & _STREAM_ID_MASK, delta & 0x7FFFFFFF)
