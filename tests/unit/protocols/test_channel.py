import pytest

from vkubelet.protocols.channel import (
    ChannelClose,
    ChannelData,
    ChannelError,
    ChannelFraming,
    encode_port_prefix,
    framing_for_subprotocol,
    port_channels,
    port_greetings,
    port_index,
)

BINARY = ChannelFraming()
BASE64 = ChannelFraming(base64=True)
V5 = ChannelFraming(stream_close=True)


def test_binary_messages_lead_with_the_channel_byte() -> None:
    assert BINARY.encode(1, b"hi") == b"\x01hi"
    assert BINARY.decode(b"\x02err") == ChannelData(2, b"err")
    assert BINARY.decode(b"\x03") == ChannelData(3, b"")


def test_base64_messages_lead_with_an_ascii_digit_and_carry_base64_text() -> None:
    assert BASE64.encode(1, b"hi\n") == "1aGkK"
    assert BASE64.decode("1aGkK") == ChannelData(1, b"hi\n")
    assert BASE64.decode(b"0") == ChannelData(0, b"")  # a binary message is read the same way


@pytest.mark.parametrize("framing", [BINARY, BASE64, V5], ids=["binary", "base64", "v5"])
def test_every_channel_and_payload_round_trips(framing: ChannelFraming) -> None:
    top = 79 if framing.base64 else (254 if framing.stream_close else 255)
    for channel in (0, 1, 4, top):
        for payload in (b"", b"\x00\xff", bytes(range(256))):
            assert framing.decode(framing.encode(channel, payload)) == ChannelData(channel, payload)


def test_empty_messages_carry_nothing() -> None:
    assert BINARY.decode(b"") is None
    assert BASE64.decode("") is None


def test_v5_close_signal_names_the_channel_to_close() -> None:
    assert V5.encode_close(0) == b"\xff\x00"
    assert V5.decode(b"\xff\x00") == ChannelClose(0)
    with pytest.raises(ChannelError, match="2 bytes"):
        V5.decode(b"\xff\x00\x01")
    with pytest.raises(ChannelError, match="2 bytes"):
        V5.decode(b"\xff")
    # Before v5, 255 is an ordinary channel.
    assert BINARY.decode(b"\xff\x00") == ChannelData(255, b"\x00")
    with pytest.raises(ValueError):
        BINARY.encode_close(0)
    with pytest.raises(ValueError):
        V5.encode(255, b"")


@pytest.mark.parametrize("message", ["/AAAA", "1AA=A", "1!!!!", "1AAA", b"\x80AAAA", "\u00e91"])
def test_malformed_base64_messages_raise_channel_error(message: str | bytes) -> None:
    with pytest.raises(ChannelError):
        BASE64.decode(message)


def test_encoding_refuses_channels_the_framing_cannot_express() -> None:
    with pytest.raises(ValueError):
        BASE64.encode(80, b"")
    with pytest.raises(ValueError):
        BINARY.encode(256, b"")
    with pytest.raises(ValueError):
        BINARY.encode(-1, b"")


def test_framing_follows_the_subprotocol_name() -> None:
    assert framing_for_subprotocol("") == BINARY
    assert framing_for_subprotocol("channel.k8s.io") == BINARY
    assert framing_for_subprotocol("v4.channel.k8s.io") == BINARY
    assert framing_for_subprotocol("base64.channel.k8s.io") == BASE64
    assert framing_for_subprotocol("v4.base64.channel.k8s.io") == BASE64
    assert framing_for_subprotocol("v5.channel.k8s.io") == V5


def test_port_i_uses_data_channel_2i_and_error_channel_2i_plus_1() -> None:
    assert [port_channels(i) for i in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert [port_index(c) for c in range(4)] == [(0, False), (0, True), (1, False), (1, True)]


def test_port_prefix_is_little_endian_uint16() -> None:
    assert encode_port_prefix(8080) == b"\x90\x1f"
    assert encode_port_prefix(65535) == b"\xff\xff"
    for bad in (0, 65536):
        with pytest.raises(ValueError):
            encode_port_prefix(bad)


def test_first_frame_on_every_port_channel_is_its_port() -> None:
    assert port_greetings([80, 443], BINARY) == [
        b"\x00\x50\x00",
        b"\x01\x50\x00",
        b"\x02\xbb\x01",
        b"\x03\xbb\x01",
    ]
    decoded = [BASE64.decode(m) for m in port_greetings([80], BASE64)]
    assert decoded == [ChannelData(0, b"\x50\x00"), ChannelData(1, b"\x50\x00")]
