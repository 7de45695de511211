import json

import pytest

from vkubelet.protocols.channel import ChannelFraming
from vkubelet.protocols.remotecommand import (
    SPDY_EXEC_PROTOCOLS,
    WEBSOCKET_EXEC_PROTOCOLS,
    ExecProtocol,
    ExitStatus,
    ResizeDecoder,
    ResizeError,
    StreamOptions,
    StreamType,
    TerminalSize,
    choose_protocol,
    decode_exit_status,
    encode_exit_status,
    encode_internal_error,
    encode_resize,
    expected_stream_count,
    negotiate_spdy_exec,
    negotiate_websocket_exec,
    split_protocol_header,
    stream_type,
)

V1 = SPDY_EXEC_PROTOCOLS["channel.k8s.io"]
V2 = SPDY_EXEC_PROTOCOLS["v2.channel.k8s.io"]
V3 = SPDY_EXEC_PROTOCOLS["v3.channel.k8s.io"]
V4 = SPDY_EXEC_PROTOCOLS["v4.channel.k8s.io"]
V5 = SPDY_EXEC_PROTOCOLS["v5.channel.k8s.io"]
V4_WS = WEBSOCKET_EXEC_PROTOCOLS["v4.channel.k8s.io"]


def test_client_go_offer_over_spdy_gets_v5_which_behaves_as_v4() -> None:
    # client-go sends the versions newest first, in one comma-separated header value.
    offer = ["v5.channel.k8s.io, v4.channel.k8s.io,v3.channel.k8s.io,v2.channel.k8s.io", "x"]
    chosen = negotiate_spdy_exec(offer)
    assert chosen == V5
    assert chosen.json_status and chosen.supports_resize and not chosen.websocket
    assert chosen.framing == ChannelFraming()  # no stream-close signal over SPDY


def test_spdy_negotiation_follows_the_clients_order() -> None:
    assert negotiate_spdy_exec(["v2.channel.k8s.io,v4.channel.k8s.io"]) == V2
    assert negotiate_spdy_exec(["channel.k8s.io"]) == V1


def test_spdy_negotiation_fails_without_a_common_or_any_protocol() -> None:
    assert negotiate_spdy_exec([]) is None
    assert negotiate_spdy_exec([" , "]) is None
    assert negotiate_spdy_exec(["v9.channel.k8s.io"]) is None
    # WebSocket-only names are not SPDY protocols.
    assert negotiate_spdy_exec(["v4.base64.channel.k8s.io"]) is None


def test_websocket_negotiation_covers_every_kubelet_subprotocol() -> None:
    expectations = {
        "channel.k8s.io": (1, False, False),
        "base64.channel.k8s.io": (1, True, False),
        "v4.channel.k8s.io": (4, False, False),
        "v4.base64.channel.k8s.io": (4, True, False),
        "v5.channel.k8s.io": (5, False, True),
    }
    for name, (version, b64, close) in expectations.items():
        chosen = negotiate_websocket_exec([name])
        assert chosen is not None
        assert (chosen.name, chosen.version, chosen.base64) == (name, version, b64)
        assert chosen.framing == ChannelFraming(base64=b64, stream_close=close)
        assert chosen.supports_resize  # the WebSocket server always opens the resize channel


def test_websocket_without_subprotocol_speaks_unversioned_binary() -> None:
    chosen = negotiate_websocket_exec([])
    assert chosen == WEBSOCKET_EXEC_PROTOCOLS[""]
    assert (chosen.version, chosen.base64, chosen.json_status) == (1, False, False)


def test_websocket_negotiation_refuses_unknown_and_spdy_only_names() -> None:
    assert negotiate_websocket_exec(["v3.channel.k8s.io"]) is None
    assert negotiate_websocket_exec(["v5.base64.channel.k8s.io"]) is None
    assert negotiate_websocket_exec(["v9", "v4.channel.k8s.io"]) == V4_WS


def test_protocol_header_helpers() -> None:
    assert split_protocol_header(["a, b", "", " c ,,"]) == ["a", "b", "c"]
    assert choose_protocol(["b", "a"], ["a", "b"]) == "b"
    assert choose_protocol([], ["a"]) is None


def test_stream_options_from_query() -> None:
    opts = StreamOptions.from_query({"input": ["1"], "output": ["1"], "tty": ["0"]})
    assert opts == StreamOptions(stdin=True, stdout=True, stderr=False, tty=False)
    assert StreamOptions.from_query({"error": ["1", "0"]}).stderr  # first value wins
    assert not StreamOptions.from_query({"error": ["true"], "output": ["1"]}).stderr


def test_tty_drops_stderr_because_the_terminal_merges_it() -> None:
    opts = StreamOptions.from_query({"output": ["1"], "error": ["1"], "tty": ["1"]})
    assert opts == StreamOptions(stdin=False, stdout=True, stderr=False, tty=True)


def test_a_request_without_stdio_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 of stdin, stdout, stderr"):
        StreamOptions.from_query({"tty": ["1"], "error": ["1"]})


@pytest.mark.parametrize(
    ("opts", "protocol", "count"),
    [
        (StreamOptions(True, True, True, False), V4, 4),
        (StreamOptions(False, True, False, False), V4, 2),
        (StreamOptions(True, True, False, True), V4, 4),  # + resize
        (StreamOptions(True, True, False, True), V3, 4),
        (StreamOptions(True, True, False, True), V2, 3),  # no resize before v3
        (StreamOptions(True, True, False, True), V1, 3),
    ],
)
def test_expected_stream_count(opts: StreamOptions, protocol: ExecProtocol, count: int) -> None:
    assert expected_stream_count(opts, protocol) == count


def test_stream_type_reads_the_lower_cased_header() -> None:
    assert stream_type({"streamtype": "stdin"}) is StreamType.STDIN
    assert stream_type({"streamtype": "bogus"}) is None
    assert stream_type({}) is None


def test_v4_success_status_is_the_metav1_status_json_go_writes() -> None:
    assert encode_exit_status(V4, 0) == b'{"metadata":{},"status":"Success"}'
    assert encode_exit_status(V5, 0) == encode_exit_status(V4, 0)


def test_v4_non_zero_exit_status_carries_the_code_as_a_cause() -> None:
    wire = encode_exit_status(V4, 3)
    assert wire == (
        b'{"metadata":{},"status":"Failure",'
        b'"message":"command terminated with non-zero exit code: exit status 3",'
        b'"reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"3"}]}}'
    )
    custom = json.loads(encode_exit_status(V4, 255, detail="killed"))
    assert custom["message"] == "command terminated with non-zero exit code: killed"
    assert custom["details"]["causes"] == [{"reason": "ExitCode", "message": "255"}]


@pytest.mark.parametrize("protocol", [V1, V2, V3])
def test_pre_v4_status_is_plain_text_and_empty_on_success(protocol: ExecProtocol) -> None:
    assert encode_exit_status(protocol, 0) == b""
    assert encode_exit_status(protocol, 2) == (
        b"command terminated with non-zero exit code: exit status 2"
    )


def test_exit_codes_outside_a_byte_are_refused_because_client_go_parses_uint8() -> None:
    for code in (-1, 256):
        with pytest.raises(ValueError, match=r"0\.\.255"):
            encode_exit_status(V4, code)


def test_internal_error_status() -> None:
    status = json.loads(encode_internal_error(V4, "no such container"))
    assert status == {
        "metadata": {},
        "status": "Failure",
        "message": "Internal error occurred: no such container",
        "reason": "InternalError",
        "details": {"causes": [{"message": "no such container"}]},
        "code": 500,
    }
    assert encode_internal_error(V2, "boom") == b"Internal error occurred: boom"


def test_resize_messages_round_trip_in_client_go_format() -> None:
    wire = encode_resize(TerminalSize(80, 24))
    assert wire == b'{"Width":80,"Height":24}\n'
    assert ResizeDecoder().feed(wire) == [TerminalSize(80, 24)]


def test_resize_stream_survives_chunking_at_every_byte_boundary() -> None:
    wire = b"".join(encode_resize(TerminalSize(w, h)) for w, h in ((80, 24), (120, 40), (1, 1)))
    wire += b' {"height": 7, "WIDTH": 9, "Extra": {"}": "{"}} '
    expected = [TerminalSize(80, 24), TerminalSize(120, 40), TerminalSize(1, 1), TerminalSize(9, 7)]
    for cut in range(len(wire) + 1):
        decoder = ResizeDecoder()
        assert decoder.feed(wire[:cut]) + decoder.feed(wire[cut:]) == expected, cut


def test_resize_missing_or_null_fields_are_zero_like_go() -> None:
    assert ResizeDecoder().feed(b'{"Width":5}{"Height":null}') == [
        TerminalSize(5, 0),
        TerminalSize(0, 0),
    ]


@pytest.mark.parametrize(
    "wire",
    [
        b"[80, 24]",
        b"80",
        b'{"Width": -1}',
        b'{"Width": 65536}',
        b'{"Width": 80.0}',
        b'{"Width": "80"}',
        b'{"Width": true}',
        b'{"Width": 80,}',
        b"\xff\xfe",
        b'{"Width":' + b"[" * 3000 + b"]" * 3000 + b"}",  # nesting deep enough to recurse
    ],
)
def test_malformed_resize_messages_raise_resize_error(wire: bytes) -> None:
    with pytest.raises(ResizeError):
        ResizeDecoder(max_buffer=1 << 16).feed(wire)


def test_resize_decoder_holds_at_most_its_buffer_limit() -> None:
    decoder = ResizeDecoder(max_buffer=64)
    decoder.feed(b'{"Width": 1' + b" " * 40)
    with pytest.raises(ResizeError, match="longer than 64"):
        decoder.feed(b" " * 40)


# --- the client's reading of the status ------------------------------------------------------


@pytest.mark.parametrize("protocol", [V4, V5, V4_WS])
@pytest.mark.parametrize("code", [0, 1, 3, 255])
def test_a_client_reads_back_every_exit_code_a_server_writes(
    protocol: ExecProtocol, code: int
) -> None:
    assert decode_exit_status(protocol, encode_exit_status(protocol, code)).exit_code == code


def test_a_failure_without_exit_code_is_reported_with_its_message() -> None:
    status = decode_exit_status(V4, encode_internal_error(V4, "no such binary"))
    assert status == ExitStatus(None, "Internal error occurred: no such binary")


def test_an_empty_v4_status_means_the_session_was_cut_short_not_success() -> None:
    status = decode_exit_status(V4, b"")
    assert status.exit_code is None and "ended before" in status.message


@pytest.mark.parametrize("payload", [b"not json", b"[1]", b'{"status": "Failure"}'])
def test_an_unreadable_v4_status_is_a_failure_that_shows_the_payload(payload: bytes) -> None:
    status = decode_exit_status(V4, payload)
    assert status.exit_code is None and status.message


def test_pre_v4_status_text_is_a_failure_without_code_and_silence_is_success() -> None:
    assert decode_exit_status(V2, b"") == ExitStatus(0)
    failed = decode_exit_status(V2, encode_exit_status(V2, 3))
    assert failed.exit_code is None
    assert "non-zero exit code" in failed.message
