import pytest

from vkubelet.protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    GoAwayReceived,
    GoAwayStatus,
    PingAcknowledged,
    PingReceived,
    RstStatus,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReset,
    StreamStateError,
)
from vkubelet.protocols.spdy.connection import Event
from vkubelet.protocols.spdy.frames import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    Setting,
    SettingsFrame,
    SynReplyFrame,
    SynStreamFrame,
    WindowUpdateFrame,
)

from .spdy_peer import GO_BLOCKS, Peer, data, goaway, ping, rst


def opened(conn: SpdyConnection, peer: Peer, sid: int, stream_type: str = "stdout") -> None:
    assert conn.receive_data(peer.syn_stream(sid, {"streamType": stream_type})) == [
        StreamOpened(sid, {"streamtype": stream_type}, fin=False, unidirectional=False)
    ]


def test_syn_stream_opens_a_stream_with_lower_cased_headers() -> None:
    conn, peer = SpdyConnection(), Peer()
    events = conn.receive_data(peer.syn_stream(1, {"streamType": "error", "Port": "80"}))
    assert events == [StreamOpened(1, {"streamtype": "error", "port": "80"}, False, False)]
    assert conn.open_streams == {1}


def test_reply_sends_syn_reply_with_an_empty_header_block() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    assert conn.reply(1)
    frames = peer.read(conn.data_to_send())
    assert [type(f) for f in frames] == [SynReplyFrame]
    assert peer.replies == {1: {}}
    assert conn.data_to_send() == b""


def test_replies_to_many_streams_share_one_compression_context() -> None:
    conn, peer = SpdyConnection(), Peer()
    for sid in (1, 3, 5, 7):
        opened(conn, peer, sid)
        conn.reply(sid, {"x-reply": str(sid)})
    peer.read(conn.data_to_send())
    assert peer.replies == {sid: {"x-reply": str(sid)} for sid in (1, 3, 5, 7)}


def test_go_compressed_syn_streams_open_streams() -> None:
    conn = SpdyConnection()
    wire = b"".join(
        SynStreamFrame(sid, block).serialize()
        for sid, block in zip((1, 3, 5, 7), GO_BLOCKS, strict=True)
    )
    events = conn.receive_data(wire)
    assert [e.headers for e in events if isinstance(e, StreamOpened)] == [
        {"streamtype": "error"},
        {"streamtype": "stdout"},
        {"port": "8080", "requestid": "0", "streamtype": "data"},
        {},
    ]


def test_data_in_both_directions_and_half_close() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1, "stdin")
    conn.reply(1)
    assert conn.receive_data(data(1, b"input")) == [DataReceived(1, b"input", False)]
    assert conn.receive_data(data(1, b"", fin=True)) == [DataReceived(1, b"", True)]
    assert conn.open_streams == {1}  # our side is still open
    conn.send_data(1, b"output", fin=True)
    frames = peer.read(conn.data_to_send())
    assert frames[1:] == [DataFrame(1, b"output", fin=True)]
    assert conn.open_streams == frozenset()


def test_outgoing_data_is_split_into_chunks_of_at_most_32_kib_with_fin_on_the_last() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    conn.reply(1)
    payload = bytes(range(256)) * 400  # 102400 bytes
    conn.send_data(1, payload, fin=True)
    frames = [f for f in peer.read(conn.data_to_send()) if isinstance(f, DataFrame)]
    assert [len(f.data) for f in frames] == [32768, 32768, 32768, 4096]
    assert [f.fin for f in frames] == [False, False, False, True]
    assert b"".join(f.data for f in frames) == payload


def test_empty_send_with_fin_writes_one_empty_fin_frame() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    conn.reply(1)
    conn.send_data(1, b"", fin=True)
    assert peer.read(conn.data_to_send())[1:] == [DataFrame(1, b"", fin=True)]


def test_send_chunk_size_is_configurable() -> None:
    conn, peer = SpdyConnection(SpdyLimits(send_chunk=3)), Peer()
    opened(conn, peer, 1)
    conn.reply(1)
    conn.send_data(1, b"abcdefg")
    frames = peer.read(conn.data_to_send())[1:]
    assert frames == [DataFrame(1, b"abc"), DataFrame(1, b"def"), DataFrame(1, b"g")]


def test_client_pings_are_echoed_at_once() -> None:
    conn = SpdyConnection()
    assert conn.receive_data(ping(1) + ping(3)) == [PingReceived(1), PingReceived(3)]
    assert Peer().read(conn.data_to_send()) == [PingFrame(1), PingFrame(3)]


def test_server_pings_use_even_ids_and_their_echo_is_reported() -> None:
    conn = SpdyConnection()
    first, second = conn.ping(), conn.ping()
    assert (first, second) == (2, 4)
    assert Peer().read(conn.data_to_send()) == [PingFrame(2), PingFrame(4)]
    assert conn.receive_data(ping(2)) == [PingAcknowledged(2)]
    assert conn.data_to_send() == b""  # an echo is not echoed back


def test_peer_reset_closes_the_stream_and_later_calls_are_quiet_no_ops() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    assert conn.receive_data(rst(1, RstStatus.CANCEL)) == [StreamReset(1, RstStatus.CANCEL)]
    assert conn.open_streams == frozenset()
    # The adapter may answer an event it saw before the reset; that must not blow up.
    assert conn.reply(1) is False
    assert conn.send_data(1, b"late") is False
    assert conn.reset(1) is False
    assert conn.data_to_send() == b""


def test_reset_of_an_unknown_stream_by_the_peer_is_ignored() -> None:
    conn = SpdyConnection()
    assert conn.receive_data(rst(9, RstStatus.CANCEL)) == []


def test_local_reset_sends_rst_cancel_by_default() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    assert conn.reset(1)
    assert peer.read(conn.data_to_send()) == [RstStreamFrame(1, RstStatus.CANCEL)]
    assert conn.open_streams == frozenset()
    # Data the peer had in flight for the reset stream is dropped quietly.
    assert conn.receive_data(data(1, b"in flight")) == []
    assert conn.data_to_send() == b""


def test_streams_beyond_the_concurrency_limit_are_refused() -> None:
    conn, peer = SpdyConnection(SpdyLimits(max_concurrent_streams=2)), Peer()
    opened(conn, peer, 1)
    opened(conn, peer, 3)
    assert conn.receive_data(peer.syn_stream(5, {"streamtype": "x"})) == []
    assert peer.read(conn.data_to_send()) == [RstStreamFrame(5, RstStatus.REFUSED_STREAM)]
    # Closing one frees a slot, and the refused block kept the compression context in step.
    conn.reset(1)
    opened(conn, peer, 7)
    # GOAWAY names the last stream we accepted, not the refused one.
    conn.receive_data(peer.syn_stream(9, {}))
    conn.goaway()
    assert peer.read(conn.data_to_send())[-2:] == [
        RstStreamFrame(9, RstStatus.REFUSED_STREAM),
        GoAwayFrame(7, GoAwayStatus.OK),
    ]


def test_goaway_from_the_peer_is_reported_and_streams_carry_on() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    assert conn.receive_data(goaway(1, GoAwayStatus.OK)) == [GoAwayReceived(1, 0)]
    conn.reply(1)
    assert conn.send_data(1, b"still here")


def test_our_goaway_names_the_last_stream_and_refuses_new_ones() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    opened(conn, peer, 3)
    conn.goaway()
    conn.goaway()  # idempotent
    assert peer.read(conn.data_to_send()) == [GoAwayFrame(3, GoAwayStatus.OK)]
    assert conn.goaway_sent
    assert conn.receive_data(peer.syn_stream(5, {})) == []
    assert peer.read(conn.data_to_send()) == [RstStreamFrame(5, RstStatus.REFUSED_STREAM)]
    conn.reply(3)
    assert conn.send_data(3, b"open streams finish their work")


def assert_failed(conn: SpdyConnection, events: list[Event], reason: str) -> None:
    assert len(events) == 1
    assert isinstance(events[-1], ConnectionFailed)
    assert reason in events[-1].reason
    assert conn.failed
    frames = Peer().read(conn.data_to_send())
    assert isinstance(frames[-1], GoAwayFrame)
    assert frames[-1].status == GoAwayStatus.PROTOCOL_ERROR
    # A failed connection reads nothing more and holds nothing.
    assert conn.receive_data(ping(1)) == []
    assert conn.buffered_input == 0
    assert conn.data_to_send() == b""


def test_oversized_frame_fails_the_connection_before_its_payload_arrives() -> None:
    conn = SpdyConnection(SpdyLimits(max_frame_payload=1024))
    header_only = DataFrame(1, bytes(1025)).serialize()[:8]
    assert_failed(conn, conn.receive_data(header_only), "exceeds limit")


def test_oversized_header_block_fails_the_connection() -> None:
    conn, peer = SpdyConnection(SpdyLimits(max_header_block=1024)), Peer()
    events = conn.receive_data(peer.syn_stream(1, {"big": "z" * 100_000}))
    assert_failed(conn, events, "beyond 1024")


def test_corrupt_header_block_fails_the_connection() -> None:
    conn = SpdyConnection()
    events = conn.receive_data(SynStreamFrame(1, b"not zlib at all").serialize())
    assert_failed(conn, events, "does not inflate")


def test_even_stream_ids_from_the_client_fail_the_connection() -> None:
    conn, peer = SpdyConnection(), Peer()
    assert_failed(conn, conn.receive_data(peer.syn_stream(2, {})), "even stream id")


def test_stream_ids_must_increase() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 5)
    assert_failed(conn, conn.receive_data(peer.syn_stream(3, {})), "does not exceed")


def test_frames_before_a_violation_are_still_delivered() -> None:
    conn, peer = SpdyConnection(), Peer()
    zero_ping = bytes.fromhex("800300060000000400000000")
    wire = peer.syn_stream(1, {"streamtype": "error"}) + ping(1) + zero_ping
    events = conn.receive_data(wire)
    assert events[:2] == [
        StreamOpened(1, {"streamtype": "error"}, False, False),
        PingReceived(1),
    ]
    assert isinstance(events[2], ConnectionFailed)


def test_data_for_a_never_opened_stream_is_answered_with_invalid_stream() -> None:
    conn = SpdyConnection()
    assert conn.receive_data(data(9, b"?")) == []
    assert Peer().read(conn.data_to_send()) == [RstStreamFrame(9, RstStatus.INVALID_STREAM)]


def test_data_after_the_peers_fin_resets_the_stream() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    conn.receive_data(data(1, b"", fin=True))
    events = conn.receive_data(data(1, b"more"))
    assert events == [StreamReset(1, RstStatus.STREAM_ALREADY_CLOSED, remote=False)]
    assert Peer().read(conn.data_to_send()) == [RstStreamFrame(1, RstStatus.STREAM_ALREADY_CLOSED)]


def test_syn_stream_with_fin_opens_a_half_closed_stream() -> None:
    conn, peer = SpdyConnection(), Peer()
    events = conn.receive_data(peer.syn_stream(1, {}, fin=True))
    assert events == [StreamOpened(1, {}, fin=True, unidirectional=False)]
    conn.reply(1)
    conn.send_data(1, b"bye", fin=True)
    assert conn.open_streams == frozenset()


def test_unidirectional_stream_cannot_be_written() -> None:
    conn, peer = SpdyConnection(), Peer()
    conn.receive_data(peer.syn_stream(1, {}, unidirectional=True))
    conn.reply(1)
    with pytest.raises(StreamStateError):
        conn.send_data(1, b"x")


def test_headers_frame_with_fin_half_closes_and_keeps_the_context_in_step() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    wire = HeadersFrame(1, peer.encoder.encode({"extra": "1"}), fin=True).serialize()
    assert conn.receive_data(wire) == [DataReceived(1, b"", True)]
    opened(conn, peer, 3)


def test_syn_reply_from_the_client_is_inflated_and_ignored() -> None:
    conn, peer = SpdyConnection(), Peer()
    wire = SynReplyFrame(1, peer.encoder.encode({"odd": "reply"})).serialize()
    assert conn.receive_data(wire) == []
    opened(conn, peer, 1)


def test_settings_and_window_updates_are_accepted_and_ignored() -> None:
    conn = SpdyConnection()
    wire = SettingsFrame((Setting(0, 7, 1 << 20),)).serialize()
    wire += WindowUpdateFrame(0, 1000).serialize()
    assert conn.receive_data(wire) == []
    assert conn.data_to_send() == b""


def test_local_misuse_raises() -> None:
    conn, peer = SpdyConnection(), Peer()
    opened(conn, peer, 1)
    with pytest.raises(StreamStateError, match="replied to before data"):
        conn.send_data(1, b"early")
    conn.reply(1)
    with pytest.raises(StreamStateError, match="already replied"):
        conn.reply(1)
    conn.send_data(1, b"", fin=True)
    with pytest.raises(StreamStateError, match="closed for sending"):
        conn.send_data(1, b"late")


def exec_session(peer: Peer) -> bytes:
    """A v4 exec as client-go opens it: error, stdin, stdout, stderr; ping; stdin and FIN."""
    wire = b"".join(
        peer.syn_stream(sid, {"streamType": kind})
        for sid, kind in ((1, "error"), (3, "stdin"), (5, "stdout"), (7, "stderr"))
    )
    return wire + ping(1) + data(3, b"echo hi\n") + data(3, b"", fin=True) + rst(5, 5)


def test_a_whole_session_gives_the_same_events_however_it_is_chunked() -> None:
    wire = exec_session(Peer())
    expected = SpdyConnection().receive_data(wire)
    assert len(expected) == 8
    for cut in range(1, len(wire)):
        conn = SpdyConnection()
        events = conn.receive_data(wire[:cut]) + conn.receive_data(wire[cut:])
        assert events == expected, f"split at {cut}"
    conn = SpdyConnection()
    events = []
    for i in range(len(wire)):
        events += conn.receive_data(wire[i : i + 1])
    assert events == expected


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        SpdyLimits(max_frame_payload=1 << 24)
    with pytest.raises(ValueError):
        SpdyLimits(max_concurrent_streams=0)
    with pytest.raises(ValueError):
        SpdyLimits(send_chunk=0)
    with pytest.raises(ValueError):
        SpdyLimits(max_header_block=3)
