"""A SPDY/3.1 connection as the kubelet and its clients use it: bytes in, events out.

As a server (the kubelet's role) it accepts the peer's streams (odd ids, strictly increasing),
replies to them, moves data both ways, echoes the peer's pings and closes with GOAWAY. As a
client (``client=True``: a relay calling another apiserver or kubelet) it opens the streams
itself with ``open_stream`` (odd ids), learns of each acceptance from a ``StreamReplied`` event,
and pings with odd ids. The rules are otherwise shared. Like spdystream, it does no flow
control: neither peer sends WINDOW_UPDATE or waits for one.

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
    MAX_STREAM_ID,
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
class StreamReplied:
    """The peer accepted a stream we opened (client-go waits for this before it writes)."""

    stream_id: int
    headers: dict[str, str]


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
    | StreamReplied
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
    replied: bool = False  # we may send data: we replied to the peer's stream, or opened it
    local_closed: bool = False
    remote_closed: bool = False
    awaiting_reply: bool = False  # a stream we opened that the peer has not answered yet


class SpdyConnection:
    def __init__(self, limits: SpdyLimits | None = None, *, client: bool = False) -> None:
        self.limits = limits or SpdyLimits()
        self.client = client
        # Clients open odd stream ids and ping with odd ids; servers use even ones for both.
        self._own_parity = 1 if client else 0
        self._next_stream_id = 1 if client else 2
        self._parser = FrameParser(self.limits.max_frame_payload)
        # Created on first use: a connection that never carries headers (most fuzz inputs,
        # and every connection that fails early) skips zlib's ~300 KiB of state.
        self._encoder: HeaderEncoder | None = None
        self._decoder: HeaderDecoder | None = None
        self._streams: dict[int, _Stream] = {}
        self._last_peer_stream_id = 0  # highest id the peer used; ids must keep increasing
        self._last_accepted_stream_id = 0  # what GOAWAY reports: refused streams do not count
        self._next_ping_id = 1 if client else 2
        self._outbox = bytearray()
        self._goaway_sent = False
        self._goaway_received = False
        self._failed = False

    # --- state the adapter may want --------------------------------------------------

    @property
    def failed(self) -> bool:
        return self._failed

    @property
    def goaway_sent(self) -> bool:
        return self._goaway_sent

    @property
    def goaway_received(self) -> bool:
        return self._goaway_received

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
                self._on_syn_reply(frame, events)
            case HeadersFrame():
                self._header_decoder().decompress(frame.header_block)
                if frame.fin:
                    self._on_remote_fin(frame.stream_id, b"", events)
            case RstStreamFrame():
                if self._streams.pop(frame.stream_id, None) is not None:
                    events.append(StreamReset(frame.stream_id, frame.status))
            case PingFrame():
                if frame.ping_id % 2 != self._own_parity:
                    self._outbox += frame.serialize()
                    events.append(PingReceived(frame.ping_id))
                else:
                    events.append(PingAcknowledged(frame.ping_id))
            case GoAwayFrame():
                self._goaway_received = True
                events.append(GoAwayReceived(frame.last_good_stream_id, frame.status))
            case _:
                pass  # SETTINGS, WINDOW_UPDATE and unknown types: nothing for us to do

    def _on_syn_stream(self, frame: SynStreamFrame, events: list[Event]) -> None:
        # Inflate first, whatever becomes of the stream: the context must see every block.
        headers = self._header_decoder().decode(frame.header_block)
        sid = frame.stream_id
        if sid % 2 == self._own_parity:
            side, parity = ("server", "odd") if self.client else ("client", "even")
            raise FrameError(f"{side} opened {parity} stream id {sid}")
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

    def _on_syn_reply(self, frame: SynReplyFrame, events: list[Event]) -> None:
        # Inflate first, whatever the reply answers: the context must see every block.
        headers = self._header_decoder().decode(frame.header_block)
        stream = self._streams.get(frame.stream_id)
        if stream is None or not stream.awaiting_reply:
            return  # a reply to a stream that is gone, or not ours to be answered: drop it
        stream.awaiting_reply = False
        events.append(StreamReplied(frame.stream_id, headers))
        if frame.fin:
            self._on_remote_fin(frame.stream_id, b"", events)

    def _never_opened(self, sid: int) -> bool:
        if sid % 2 == self._own_parity:
            return sid >= self._next_stream_id
        return sid > self._last_peer_stream_id

    def _on_data(self, frame: DataFrame, events: list[Event]) -> None:
        sid = frame.stream_id
        stream = self._streams.get(sid)
        if stream is None:
            if self._never_opened(sid):
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

    def open_stream(self, headers: dict[str, str], *, fin: bool = False) -> int:
        """Open a stream with SYN_STREAM and return its id. Data may follow at once, though
        client-go's habit, which peers may rely on, is to wait for ``StreamReplied``."""
        if self._failed or self._goaway_sent or self._goaway_received:
            raise StreamStateError("the connection accepts no new streams")
        if len(self._streams) >= self.limits.max_concurrent_streams:
            raise StreamStateError("too many open streams")
        sid = self._next_stream_id
        if sid > MAX_STREAM_ID:
            raise StreamStateError("stream ids are exhausted; open a new connection")
        self._next_stream_id = sid + 2
        self._outbox += SynStreamFrame(
            sid, self._header_encoder().encode(headers), fin=fin
        ).serialize()
        self._streams[sid] = _Stream(replied=True, local_closed=fin, awaiting_reply=True)
        return sid

    def _header_encoder(self) -> HeaderEncoder:
        if self._encoder is None:
            self._encoder = HeaderEncoder()
        return self._encoder

    def reply(self, stream_id: int, headers: dict[str, str] | None = None) -> bool:
        """Accept a stream with SYN_REPLY. Returns False if the stream is already gone."""
        stream = self._writable(stream_id)
        if stream is None:
            return False
        if stream.replied:
            raise StreamStateError(f"stream {stream_id} was already replied to (or is ours)")
        stream.replied = True
        self._outbox += SynReplyFrame(
            stream_id, self._header_encoder().encode(headers or {})
        ).serialize()
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
        self._next_ping_id = ping_id + 2 if ping_id < 0x7FFFFFFE else 2 - self._own_parity
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
