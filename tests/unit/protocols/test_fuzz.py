"""Property-based fuzzing of the decoders: valid traffic, mutated traffic and plain noise.

The contract under test: hostile input yields only the documented error (an event for the
SPDY connection, a named exception for the stateless decoders), never another exception, and
never buffers more than the configured limits. ``bench/fuzz_protocols.py`` runs the same idea
for millions of inputs; this keeps a few hundred in CI.
"""

from __future__ import annotations

import contextlib
from itertools import pairwise

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vkubelet.protocols.channel import (
    ChannelClose,
    ChannelData,
    ChannelError,
    ChannelFraming,
)
from vkubelet.protocols.portforward import PairComplete, PairPending, StreamPairer, StreamRejected
from vkubelet.protocols.remotecommand import ResizeDecoder, ResizeError, TerminalSize, encode_resize
from vkubelet.protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReset,
)
from vkubelet.protocols.spdy.frames import (
    GoAwayFrame,
    HeadersFrame,
    Setting,
    SettingsFrame,
    SynReplyFrame,
    WindowUpdateFrame,
)
from vkubelet.protocols.spdy.headers import HeaderBlockError, HeaderDecoder

from .spdy_peer import Peer, data, ping, rst

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

LIMITS = SpdyLimits(
    max_frame_payload=4096, max_header_block=2048, max_concurrent_streams=4, send_chunk=512
)
EVENT_TYPES = (
    StreamOpened,
    DataReceived,
    StreamReset,
    PingReceived,
    PingAcknowledged,
    GoAwayReceived,
    ConnectionFailed,
)

stream_ids = st.integers(1, 40)
small_bytes = st.binary(max_size=600)
header_dicts = st.dictionaries(
    st.sampled_from(["streamtype", "port", "requestid", "x"]),
    st.text(st.characters(max_codepoint=255), max_size=20),
    max_size=4,
)


@st.composite
def client_sessions(draw: st.DrawFn) -> bytes:
    """A run of well-formed client frames; header blocks share one compression context, so
    without mutation the connection must accept all of it."""
    peer = Peer()
    wire = bytearray()
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.integers(0, 9))
        sid = draw(stream_ids)
        if kind <= 2:
            wire += peer.syn_stream(
                sid, draw(header_dicts), fin=draw(st.booleans()), unidirectional=draw(st.booleans())
            )
        elif kind <= 4:
            wire += data(sid, draw(small_bytes), fin=draw(st.booleans()))
        elif kind == 5:
            wire += ping(draw(st.integers(1, 2**32 - 1)))
        elif kind == 6:
            wire += rst(sid, draw(st.integers(1, 11)))
        elif kind == 7:
            block = peer.encoder.encode(draw(header_dicts))
            fin = draw(st.booleans())
            if draw(st.booleans()):
                wire += HeadersFrame(sid, block, fin).serialize()
            else:
                wire += SynReplyFrame(sid, block, fin).serialize()
        elif kind == 8:
            wire += SettingsFrame((Setting(0, 7, 65536),)).serialize()
            wire += WindowUpdateFrame(sid, 1024).serialize()
        else:
            wire += GoAwayFrame(sid, draw(st.integers(0, 2))).serialize()
    return bytes(wire)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """Valid traffic with a few byte flips, insertions, deletions and truncations: noise that
    still looks enough like SPDY to get past the first checks."""
    wire = bytearray(draw(base))
    for _ in range(draw(st.integers(0, 4))):
        if not wire:
            break
        pos = draw(st.integers(0, len(wire) - 1))
        op = draw(st.integers(0, 3))
        if op == 0:
            wire[pos] ^= draw(st.integers(1, 255))
        elif op == 1:
            wire[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == 2:
            del wire[pos : pos + draw(st.integers(1, 16))]
        else:
            del wire[pos:]
    return bytes(wire)


def chunked(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(wire) + 1) for c in cuts})
    return [wire[a:b] for a, b in pairwise([0, *points, len(wire)])]


def drive(wire: bytes, cuts: list[int], respond: bool = True) -> list[object]:
    """Feed ``wire`` in pieces, answering streams the way an adapter would (if ``respond``),
    and check the invariants after every step."""
    conn = SpdyConnection(LIMITS)
    events: list[object] = []
    sent = received = 0
    for piece in chunked(wire, cuts):
        received += len(piece)
        new = conn.receive_data(piece)
        for event in new:
            assert isinstance(event, EVENT_TYPES)
            if respond and isinstance(event, StreamOpened):
                conn.reply(event.stream_id)
                if not event.unidirectional:
                    conn.send_data(event.stream_id, b"ok", fin=True)
        events += new
        assert conn.buffered_input <= 8 + LIMITS.max_frame_payload
        assert len(conn.open_streams) <= LIMITS.max_concurrent_streams
        sent += len(conn.data_to_send())
    # Our own replies cost a bounded amount per accepted stream; everything else we send
    # (ping echoes, resets, GOAWAY) is at most 2 bytes per byte received, plus one GOAWAY.
    opened = sum(isinstance(e, StreamOpened) for e in events)
    assert sent <= 2 * received + 16 + opened * 256
    failures = [i for i, e in enumerate(events) if isinstance(e, ConnectionFailed)]
    assert failures in ([], [len(events) - 1])
    return events


@FUZZ
@given(client_sessions(), st.lists(st.integers(0, 10_000), max_size=8))
def test_valid_sessions_never_fail_and_chunking_does_not_change_the_events(
    wire: bytes, cuts: list[int]
) -> None:
    # Without our answers interleaving (their timing depends on the chunking), the events
    # are a function of the bytes alone.
    whole = drive(wire, [], respond=False)
    assert drive(wire, cuts, respond=False) == whole
    drive(wire, cuts)
    # Stream-id ordering is the one rule random sessions break on purpose; nothing else may.
    for event in whole:
        if isinstance(event, ConnectionFailed):
            assert "stream id" in event.reason


@FUZZ
@given(mutated(client_sessions()), st.lists(st.integers(0, 10_000), max_size=8))
def test_mutated_sessions_yield_only_documented_events(wire: bytes, cuts: list[int]) -> None:
    drive(wire, cuts)


@FUZZ
@given(st.binary(max_size=2000), st.lists(st.integers(0, 10_000), max_size=8))
def test_random_bytes_yield_only_documented_events(wire: bytes, cuts: list[int]) -> None:
    drive(wire, cuts)


@FUZZ
@given(st.binary(max_size=300))
def test_header_decoder_raises_only_header_block_error(block: bytes) -> None:
    decoder = HeaderDecoder(max_size=1024)
    with contextlib.suppress(HeaderBlockError):
        decoder.decode(block)


@FUZZ
@given(
    st.sampled_from(
        [ChannelFraming(), ChannelFraming(base64=True), ChannelFraming(stream_close=True)]
    ),
    st.one_of(st.binary(max_size=64), st.text(max_size=64)),
)
def test_channel_decoders_raise_only_channel_error(
    framing: ChannelFraming, message: bytes | str
) -> None:
    try:
        result = framing.decode(message)
    except ChannelError:
        return
    assert result is None or isinstance(result, ChannelData | ChannelClose)


@FUZZ
@given(
    st.sampled_from([ChannelFraming(), ChannelFraming(base64=True)]),
    st.integers(0, 79),
    st.binary(max_size=256),
)
def test_channel_messages_round_trip(framing: ChannelFraming, channel: int, payload: bytes) -> None:
    assert framing.decode(framing.encode(channel, payload)) == ChannelData(channel, payload)


@st.composite
def resize_streams(draw: st.DrawFn) -> bytes:
    sizes = draw(st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)), max_size=5))
    return b"".join(encode_resize(TerminalSize(w, h)) for w, h in sizes)


@FUZZ
@given(
    st.one_of(mutated(resize_streams()), st.binary(max_size=200)),
    st.lists(st.integers(0, 1000), max_size=6),
)
def test_resize_decoder_raises_only_resize_error_and_stays_bounded(
    wire: bytes, cuts: list[int]
) -> None:
    decoder = ResizeDecoder(max_buffer=128)
    try:
        for piece in chunked(wire, cuts):
            for size in decoder.feed(piece):
                assert 0 <= size.width <= 0xFFFF and 0 <= size.height <= 0xFFFF
    except ResizeError:
        pass


@FUZZ
@given(resize_streams(), st.lists(st.integers(0, 1000), max_size=6))
def test_resize_streams_decode_whatever_the_chunking(wire: bytes, cuts: list[int]) -> None:
    decoder = ResizeDecoder()
    sizes = [s for piece in chunked(wire, cuts) for s in decoder.feed(piece)]
    assert b"".join(encode_resize(s) for s in sizes) == wire


@FUZZ
@given(st.lists(st.tuples(stream_ids, header_dicts), max_size=20))
def test_stream_pairer_answers_every_stream_without_raising(
    streams: list[tuple[int, dict[str, str]]],
) -> None:
    pairer = StreamPairer()
    for sid, headers in streams:
        result = pairer.add_stream(sid, headers)
        assert isinstance(result, PairPending | PairComplete | StreamRejected)
        if isinstance(result, PairComplete):
            assert 0 < result.port <= 0xFFFF
    for request_id in pairer.pending:
        assert pairer.expire(request_id) is not None
    assert pairer.pending == frozenset()
