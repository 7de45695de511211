"""Server side of a SPDY/3.1 connection as the kubelet sees it: bytes in, events out.

The apiserver (through client-go and moby/spdystream) opens every stream; we only answer. So
this state machine accepts client streams (odd ids, strictly increasing), replies to them,
moves data both ways, echoes the client's pings and closes with GOAWAY. Like spdystream, it
does no flow control: the peer never sends WINDOW_UPDATE and does not wait for one.

It performs no I/O. An adapter feeds received bytes to ``receive_data``, acts on the returned
events, and writes out ``data_to_send()`` after every call that may have queued frames.

Protocol violations never raise out of ``receive_data``: they become one ``ConnectionFailed``
event, a GOAWAY(PROTOCOL_ERROR) is queued, and the connection ignores all later input. The
adapter should flush and close the transport. Raised exceptions are reserved for local misuse
(replying twice, writing after our own FIN), which is a bug in the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .frames import (
    MAX_PAYLOAD,
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
    SynReplyFrame,
    SynStreamFrame,
)
from .headers import DEFAULT_MAX_HEADER_BLOCK, HeaderBlockError, HeaderDecoder, HeaderEncoder

SEND_CHUNK: Final = 32 * 1024


@dataclass(frozen=True, slots=True)
class SpdyLimits:
    """Resource limits for one connection.

    ``max_frame_payload`` bounds what we buffer for a single incoming frame. Go peers write each
    ``io.Copy`` buffer (32 KiB) as one DATA frame, so 1 MiB leaves wide headroom while keeping a
    hostile length field from costing 16 MiB per connection.
    """

    max_frame_payload: int = 1 << 20
    max_header_block: int = DEFAULT_MAX_HEADER_BLOCK
    max_concurrent_streams: int = 1000
    send_chunk: int = SEND_CHUNK

    def __post_init__(self) -> None:
        if not 0 < self.max_frame_payload <= MAX_PAYLOAD:
            raise ValueError(f"max_frame_payload must be in 1..{MAX_PAYLOAD}")
        if self.max_header_block < 4:
            raise ValueError("max_header_block must be at least 4")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be at least 1")
        if not 0 < self.send_chunk <= MAX_PAYLOAD:
            raise ValueError(f"send_chunk must be in 1..{MAX_PAYLOAD}")


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """The peer opened a stream. Answer with ``reply`` (or ``reset`` to refuse it): client-go
    waits for the reply before it writes, and gives up after 30 s."""

    stream_id: int
    headers: dict[str, str]
    fin: bool
    unidirectional: bool


@dataclass(frozen=True, slots=True)
class DataReceived:
    """Bytes for a stream; ``fin`` means the peer will send no more (data may be empty)."""

    stream_id: int
    data: bytes
    fin: bool


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream is gone. ``remote`` is False when this connection reset it itself because
    the peer broke the stream's rules; the status is then the one we sent."""

    stream_id: int
    status: int
    remote: bool = True


@dataclass(frozen=True, slots=True)
class PingReceived:
    """The peer pinged; the echo is already queued."""

    ping_id: int


@dataclass(frozen=True, slots=True)
class PingAcknowledged:
    """The peer echoed one of our pings."""

    ping_id: int


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer will open no more streams. Existing streams carry on."""

    last_good_stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class ConnectionFailed:
    """The peer broke the protocol. GOAWAY is queued; flush it and close the transport."""

    reason: str


Event = (
    StreamOpened
    | DataReceived
    | StreamReset
    | PingReceived
    | PingAcknowledged
    | GoAwayReceived
    | ConnectionFailed
)


class StreamStateError(Exception):
    """Local misuse of a stream, such as writing after our own FIN. A bug in the caller."""


@dataclass(slots=True)
class _Stream:
    replied: bool = False
    local_closed: bool = False
    remote_closed: bool = False


class SpdyConnection:
    def __init__(self, limits: SpdyLimits | None = None) -> None:
        self.limits = limits or SpdyLimits()
        self._parser = FrameParser(self.limits.max_frame_payload)
        # Created on first use: a connection that never carries headers (most fuzz inputs,
        # and every connection that fails early) skips zlib's ~300 KiB of state.
        self._encoder: HeaderEncoder | None = None
        self._decoder: HeaderDecoder | None = None
        self._streams: dict[int, _Stream] = {}
        self._last_peer_stream_id = 0  # highest id the peer used; ids must keep increasing
        self._last_accepted_stream_id = 0  # what GOAWAY reports: refused streams do not count
        self._next_ping_id = 2  # server pings are even; the client's are odd
        self._outbox = bytearray()
        self._goaway_sent = False
        self._failed = False

    # --- state the adapter may want --------------------------------------------------

    @property
    def failed(self) -> bool:
        return self._failed

    @property
    def goaway_sent(self) -> bool:
        return self._goaway_sent

    @property
    def open_streams(self) -> frozenset[int]:
        return frozenset(self._streams)

    @property
    def buffered_input(self) -> int:
        """Received bytes not yet parsed; bounded by 8 + max_frame_payload after each call."""
        return self._parser.buffered

    # --- input ---------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes as they arrive, in any chunking; returns the events they complete, in
        wire order. Replies to the peer's pings and resets are queued for ``data_to_send``."""
        if self._failed:
            return []
        events: list[Event] = []
        self._parser.receive(data)
        try:
            while (frame := self._parser.next_frame()) is not None:
                self._handle(frame, events)
        except (FrameError, HeaderBlockError) as exc:
            events.append(self._fail(str(exc)))
        return events

    def _handle(self, frame: Frame, events: list[Event]) -> None:
        match frame:
            case DataFrame():
                self._on_data(frame, events)
            case SynStreamFrame():
                self._on_syn_stream(frame, events)
            case SynReplyFrame():
                # We never open streams, so a reply answers nothing. Inflate it anyway to keep
                # the compression context in step, then drop it.
                self._header_decoder().decompress(frame.header_block)
            case HeadersFrame():
                self._header_decoder().decompress(frame.header_block)
                if frame.fin:
                    self._on_remote_fin(frame.stream_id, b"", events)
            case RstStreamFrame():
                if self._streams.pop(frame.stream_id, None) is not None:
                    events.append(StreamReset(frame.stream_id, frame.status))
            case PingFrame():
                if frame.ping_id % 2 == 1:
                    self._outbox += frame.serialize()
                    events.append(PingReceived(frame.ping_id))
                else:
                    events.append(PingAcknowledged(frame.ping_id))
            case GoAwayFrame():
                events.append(GoAwayReceived(frame.last_good_stream_id, frame.status))
            case _:
                pass  # SETTINGS, WINDOW_UPDATE and unknown types: nothing for us to do

    def _on_syn_stream(self, frame: SynStreamFrame, events: list[Event]) -> None:
        # Inflate first, whatever becomes of the stream: the context must see every block.
        headers = self._header_decoder().decode(frame.header_block)
        sid = frame.stream_id
        if sid % 2 == 0:
            raise FrameError(f"client opened even stream id {sid}")
        if sid <= self._last_peer_stream_id:
            raise FrameError(f"stream id {sid} does not exceed {self._last_peer_stream_id}")
        self._last_peer_stream_id = sid
        if self._goaway_sent or len(self._streams) >= self.limits.max_concurrent_streams:
            self._outbox += RstStreamFrame(sid, RstStatus.REFUSED_STREAM).serialize()
            return
        self._last_accepted_stream_id = sid
        stream = _Stream(local_closed=frame.unidirectional, remote_closed=frame.fin)
        if not (stream.local_closed and stream.remote_closed):
            self._streams[sid] = stream
        events.append(StreamOpened(sid, headers, frame.fin, frame.unidirectional))

    def _on_data(self, frame: DataFrame, events: list[Event]) -> None:
        sid = frame.stream_id
        stream = self._streams.get(sid)
        if stream is None:
            if sid > self._last_peer_stream_id:
                # Never opened: tell the peer. Data for streams that closed or were reset is
                # normal in-flight traffic and is dropped quietly.
                self._outbox += RstStreamFrame(sid, RstStatus.INVALID_STREAM).serialize()
            return
        if stream.remote_closed:
            self._reset_locally(sid, RstStatus.STREAM_ALREADY_CLOSED, events)
            return
        if frame.fin:
            self._on_remote_fin(sid, frame.data, events)
        else:
            events.append(DataReceived(sid, frame.data, False))

    def _on_remote_fin(self, sid: int, data: bytes, events: list[Event]) -> None:
        stream = self._streams.get(sid)
        if stream is None or stream.remote_closed:
            return
        stream.remote_closed = True
        if stream.local_closed:
            del self._streams[sid]
        events.append(DataReceived(sid, data, True))

    def _reset_locally(self, sid: int, status: RstStatus, events: list[Event]) -> None:
        del self._streams[sid]
        self._outbox += RstStreamFrame(sid, status).serialize()
        events.append(StreamReset(sid, status, remote=False))

    def _fail(self, reason: str) -> ConnectionFailed:
        self._failed = True
        self._streams.clear()
        self._parser.discard()
        if not self._goaway_sent:
            self._goaway_sent = True
            self._outbox += GoAwayFrame(
                self._last_accepted_stream_id, GoAwayStatus.PROTOCOL_ERROR
            ).serialize()
        return ConnectionFailed(reason)

    def _header_decoder(self) -> HeaderDecoder:
        if self._decoder is None:
            self._decoder = HeaderDecoder(self.limits.max_header_block)
        return self._decoder

    # --- output --------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = bytes(self._outbox)
        self._outbox.clear()
        return out

    def _writable(self, stream_id: int) -> _Stream | None:
        """The stream if we may act on it; None if it is already gone.

        A stream can vanish between the event that announced it and the caller's answer (the
        peer reset it in the same read), so acting on a gone stream is a quiet no-op.
        """
        if self._failed:
            return None
        return self._streams.get(stream_id)

    def reply(self, stream_id: int, headers: dict[str, str] | None = None) -> bool:
        """Accept a stream with SYN_REPLY. Returns False if the stream is already gone."""
        stream = self._writable(stream_id)
        if stream is None:
            return False
        if stream.replied:
            raise StreamStateError(f"stream {stream_id} was already replied to")
        if self._encoder is None:
            self._encoder = HeaderEncoder()
        stream.replied = True
        self._outbox += SynReplyFrame(stream_id, self._encoder.encode(headers or {})).serialize()
        return True

    def send_data(self, stream_id: int, data: bytes, fin: bool = False) -> bool:
        """Queue data in frames of at most ``limits.send_chunk`` bytes; ``fin`` half-closes our
        side after it. Returns False if the stream is already gone."""
        stream = self._writable(stream_id)
        if stream is None:
            return False
        if not stream.replied:
            raise StreamStateError(f"stream {stream_id} must be replied to before data")
        if stream.local_closed:
            raise StreamStateError(f"stream {stream_id} is closed for sending")
        view = memoryview(data)
        chunk = self.limits.send_chunk
        for start in range(0, len(view), chunk):
            piece = bytes(view[start : start + chunk])
            last = start + chunk >= len(view)
            self._outbox += DataFrame(stream_id, piece, fin and last).serialize()
        if fin:
            if not view:
                self._outbox += DataFrame(stream_id, b"", True).serialize()
            stream.local_closed = True
            if stream.remote_closed:
                del self._streams[stream_id]
        return True

    def reset(self, stream_id: int, status: int = RstStatus.CANCEL) -> bool:
        """Abort a stream with RST_STREAM (CANCEL by default, as spdystream's Reset does).
        Returns False if the stream is already gone."""
        if self._writable(stream_id) is None:
            return False
        del self._streams[stream_id]
        self._outbox += RstStreamFrame(stream_id, status).serialize()
        return True

    def ping(self) -> int:
        """Queue a PING and return its id; a ``PingAcknowledged`` with that id answers it."""
        ping_id = self._next_ping_id
        self._next_ping_id = ping_id + 2 if ping_id < 0x7FFFFFFE else 2
        if not self._failed:
            self._outbox += PingFrame(ping_id).serialize()
        return ping_id

    def goaway(self, status: int = GoAwayStatus.OK) -> None:
        """Announce that we accept no more streams; later SYN_STREAMs are refused. Streams
        already open carry on, so close the transport only once they are done."""
        if self._goaway_sent:
            return
        self._goaway_sent = True
        self._outbox += GoAwayFrame(self._last_accepted_stream_id, status).serialize()
