"""The client role of `SpdyConnection`, played against the server role over in-memory bytes.

The server role is checked byte for byte against Go's blocks in test_spdy_connection.py, and
the client role against the real apiserver in the integration tests; here the two roles must
agree with each other on every rule they share.
"""

from __future__ import annotations

import pytest

from vkubelet.protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    RstStatus,
    SpdyConnection,
    StreamOpened,
    StreamReplied,
    StreamReset,
    StreamStateError,
)
from vkubelet.protocols.spdy.connection import Event
from vkubelet.protocols.spdy.frames import DataFrame, FrameParser, RstStreamFrame

from .spdy_peer import Peer


def pair() -> tuple[SpdyConnection, SpdyConnection]:
    return SpdyConnection(client=True), SpdyConnection()


def carry(source: SpdyConnection, target: SpdyConnection) -> list[Event]:
    return target.receive_data(source.data_to_send())


def test_client_streams_get_odd_increasing_ids_and_arrive_with_their_headers() -> None:
    client, server = pair()
    ids = [client.open_stream({"streamType": kind}) for kind in ("error", "stdin", "stdout")]
    assert ids == [1, 3, 5]
    assert carry(client, server) == [
        StreamOpened(1, {"streamtype": "error"}, False, False),
        StreamOpened(3, {"streamtype": "stdin"}, False, False),
        StreamOpened(5, {"streamtype": "stdout"}, False, False),
    ]


def test_a_reply_is_reported_once_per_stream_we_opened() -> None:
    client, server = pair()
    sid = client.open_stream({"streamType": "data"})
    carry(client, server)
    server.reply(sid, {"x-answer": "yes"})
    assert carry(server, client) == [StreamReplied(sid, {"x-answer": "yes"})]


def test_data_flows_both_ways_and_half_closes_end_the_stream() -> None:
    client, server = pair()
    sid = client.open_stream({"streamType": "data"})
    carry(client, server)
    server.reply(sid)
    carry(server, client)
    client.send_data(sid, b"ping", fin=True)
    assert carry(client, server) == [DataReceived(sid, b"ping", True)]
    server.send_data(sid, b"pong", fin=True)
    assert carry(server, client) == [DataReceived(sid, b"pong", True)]
    assert client.open_streams == frozenset() == server.open_streams


def test_the_client_may_send_before_the_reply_arrives() -> None:
    client, server = pair()
    sid = client.open_stream({"streamType": "stdin"})
    client.send_data(sid, b"early")
    events = carry(client, server)
    assert events[-1] == DataReceived(sid, b"early", False)


def test_client_pings_are_odd_and_echoed_and_server_pings_are_echoed_by_the_client() -> None:
    client, server = pair()
    ping_id = client.ping()
    assert ping_id % 2 == 1
    assert carry(client, server) == [PingReceived(ping_id)]
    assert carry(server, client) == [PingAcknowledged(ping_id)]
    server_ping = server.ping()
    assert carry(server, client) == [PingReceived(server_ping)]
    assert carry(client, server) == [PingAcknowledged(server_ping)]


def test_a_reset_before_the_reply_refuses_the_stream() -> None:
    client, server = pair()
    sid = client.open_stream({"streamType": "bogus"})
    carry(client, server)
    server.reset(sid, RstStatus.REFUSED_STREAM)
    assert carry(server, client) == [StreamReset(sid, RstStatus.REFUSED_STREAM)]
    assert client.open_streams == frozenset()


def test_no_new_streams_after_a_goaway_either_way() -> None:
    client, server = pair()
    server.goaway()
    assert isinstance(carry(server, client)[0], GoAwayReceived)
    with pytest.raises(StreamStateError):
        client.open_stream({"streamType": "error"})
    other = SpdyConnection(client=True)
    other.goaway()
    with pytest.raises(StreamStateError):
        other.open_stream({"streamType": "error"})


def test_an_odd_stream_opened_by_the_server_fails_the_connection() -> None:
    client, peer = SpdyConnection(client=True), Peer()
    events = client.receive_data(peer.syn_stream(1, {"streamType": "error"}))
    assert len(events) == 1 and isinstance(events[0], ConnectionFailed)
    assert "server opened odd stream id 1" in events[0].reason


def test_data_for_a_stream_never_opened_is_refused_and_for_a_closed_one_dropped() -> None:
    client, server = pair()
    sid = client.open_stream({"streamType": "data"})
    carry(client, server)
    server.reply(sid)
    carry(server, client)
    client.reset(sid)
    assert client.receive_data(DataFrame(sid, b"late").serialize()) == []
    assert client.data_to_send() == RstStreamFrame(sid, RstStatus.CANCEL).serialize()
    assert client.receive_data(DataFrame(sid + 2, b"never").serialize()) == []
    frame = FrameParser()
    frame.receive(client.data_to_send())
    assert frame.next_frame() == RstStreamFrame(sid + 2, RstStatus.INVALID_STREAM)


def test_replies_to_streams_that_are_gone_keep_the_compression_context_in_step() -> None:
    client, server = pair()
    first = client.open_stream({"streamType": "error"})
    second = client.open_stream({"streamType": "data"})
    carry(client, server)
    client.reset(first)
    server.reply(first, {"n": "1"})
    server.reply(second, {"n": "2"})
    client.data_to_send()
    assert carry(server, client) == [StreamReplied(second, {"n": "2"})]


def test_replying_to_our_own_stream_is_local_misuse() -> None:
    client = SpdyConnection(client=True)
    sid = client.open_stream({})
    with pytest.raises(StreamStateError):
        client.reply(sid)
