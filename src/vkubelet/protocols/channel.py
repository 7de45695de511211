"""The ``channel.k8s.io`` WebSocket framing: many byte streams over one WebSocket.

Every message starts with its channel. The binary variants use a raw byte; the base64 variants
(text messages) use the character ``'0' + channel`` followed by the data in standard base64.
v5 reserves channel 255 for a two-byte "close channel N" signal, which is how a client
half-closes stdin without closing the WebSocket.

WebSocket message boundaries come from the WebSocket layer, so this module is stateless:
one message in, one decoded value out.

Port-forward reuses the framing with two channels per requested port: data on ``2i`` and
errors on ``2i + 1``. The server's first message on each of them is the port number as a
little-endian uint16, so the client can tell which port a channel belongs to.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass
from typing import Final

CLOSE_SIGNAL: Final = 255
# Text messages must stay ASCII, so '0' + channel may go up to 0x7F.
MAX_BASE64_CHANNEL: Final = 0x7F - ord("0")

WireMessage = bytes | str
"""A WebSocket message payload: bytes for binary messages, str for text messages."""

_PORT = struct.Struct("<H")


class ChannelError(ValueError):
    """A message that does not follow the channel framing."""


@dataclass(frozen=True, slots=True)
class ChannelData:
    channel: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ChannelClose:
    """v5: the peer will send nothing more on ``channel`` (typically stdin)."""

    channel: int


@dataclass(frozen=True, slots=True)
class ChannelFraming:
    base64: bool = False
    stream_close: bool = False

    def encode(self, channel: int, data: bytes) -> WireMessage:
        if self.base64:
            if not 0 <= channel <= MAX_BASE64_CHANNEL:
                raise ValueError(f"channel {channel} cannot be written as one ASCII character")
            return chr(ord("0") + channel) + base64.b64encode(data).decode("ascii")
        limit = CLOSE_SIGNAL - 1 if self.stream_close else 255
        if not 0 <= channel <= limit:
            raise ValueError(f"channel {channel} is outside 0..{limit}")
        return bytes((channel,)) + data

    def encode_close(self, channel: int) -> bytes:
        if not self.stream_close:
            raise ValueError("this protocol has no stream-close signal")
        if not 0 <= channel < CLOSE_SIGNAL:
            raise ValueError(f"channel {channel} is outside 0..254")
        return bytes((CLOSE_SIGNAL, channel))

    def decode(self, message: WireMessage) -> ChannelData | ChannelClose | None:
        """Decode one message. Empty messages carry nothing and give None, which the Go
        server also skips. Whether the channel exists is the caller's business."""
        # Go reads text and binary messages alike, so either type is accepted in either mode.
        raw = message.encode("utf-8") if isinstance(message, str) else bytes(message)
        if not raw:
            return None
        if self.stream_close and raw[0] == CLOSE_SIGNAL:
            if len(raw) != 2:
                raise ChannelError(f"close signal must be 2 bytes, got {len(raw)}")
            return ChannelClose(raw[1])
        if not self.base64:
            return ChannelData(raw[0], raw[1:])
        channel = raw[0] - ord("0")
        if not 0 <= channel <= MAX_BASE64_CHANNEL:
            raise ChannelError(f"base64 message starts with {raw[:1]!r}, not a channel")
        try:
            return ChannelData(channel, base64.b64decode(raw[1:], validate=True))
        except binascii.Error as exc:
            raise ChannelError(f"bad base64 on channel {channel}: {exc}") from None


def framing_for_subprotocol(name: str) -> ChannelFraming:
    """The framing a negotiated subprotocol name implies ("" means binary, unversioned)."""
    return ChannelFraming(base64="base64." in name, stream_close=name.startswith("v5."))


# --- port-forward ----------------------------------------------------------------------------


def port_channels(index: int) -> tuple[int, int]:
    """(data, error) channels of the ``index``-th requested port."""
    if index < 0:
        raise ValueError("port index must be non-negative")
    return 2 * index, 2 * index + 1


def port_index(channel: int) -> tuple[int, bool]:
    """Which requested port a channel serves, and whether it is that port's error channel."""
    if channel < 0:
        raise ValueError("channel must be non-negative")
    return channel // 2, channel % 2 == 1


def encode_port_prefix(port: int) -> bytes:
    if not 0 < port <= 0xFFFF:
        raise ValueError(f"port {port} is outside 1..65535")
    return _PORT.pack(port)


def port_greetings(ports: list[int], framing: ChannelFraming) -> list[WireMessage]:
    """The messages the server sends first: each port's number on its data then error channel."""
    messages: list[WireMessage] = []
    for index, port in enumerate(ports):
        prefix = encode_port_prefix(port)
        for channel in port_channels(index):
            messages.append(framing.encode(channel, prefix))
    return messages
