"""Sans-I/O cores of the kubelet streaming protocols (exec, attach, port-forward).

Bytes in, events out; no sockets, no asyncio. They are the bottom layer: they import nothing
else from vkubelet, so they can be fuzzed and tested byte for byte, and one core serves every
transport (a TLS socket, the apiserver's WebSocket tunnel, a test).

- ``spdy``: SPDY/3.1 framing, header compression and the server connection state machine.
- ``channel``: the ``channel.k8s.io`` WebSocket framing and the port-forward channel layout.
- ``remotecommand``: exec/attach semantics shared by both transports.
- ``portforward``: pairing of SPDY port-forward streams and port parsing.
"""

from .channel import (
    ChannelClose,
    ChannelData,
    ChannelError,
    ChannelFraming,
    WireMessage,
    encode_port_prefix,
    framing_for_subprotocol,
    port_channels,
    port_greetings,
    port_index,
)
from .portforward import (
    PORT_FORWARD_PROTOCOL,
    PairComplete,
    PairExpired,
    PairPending,
    PortForwardStreamType,
    StreamPairer,
    StreamRejected,
    forward_error_message,
    negotiate_spdy_portforward,
    negotiate_websocket_portforward,
    parse_port,
    parse_port_query,
)
from .remotecommand import (
    Channel,
    ExecProtocol,
    ResizeDecoder,
    ResizeError,
    StreamOptions,
    StreamType,
    TerminalSize,
    encode_exit_status,
    encode_internal_error,
    encode_resize,
    expected_stream_count,
    negotiate_spdy_exec,
    negotiate_websocket_exec,
    stream_type,
)
from .spdy import (
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

__all__ = [
    "PORT_FORWARD_PROTOCOL",
    "Channel",
    "ChannelClose",
    "ChannelData",
    "ChannelError",
    "ChannelFraming",
    "ConnectionFailed",
    "DataReceived",
    "ExecProtocol",
    "GoAwayReceived",
    "GoAwayStatus",
    "PairComplete",
    "PairExpired",
    "PairPending",
    "PingAcknowledged",
    "PingReceived",
    "PortForwardStreamType",
    "ResizeDecoder",
    "ResizeError",
    "RstStatus",
    "SpdyConnection",
    "SpdyLimits",
    "StreamOpened",
    "StreamOptions",
    "StreamPairer",
    "StreamRejected",
    "StreamReset",
    "StreamStateError",
    "StreamType",
    "TerminalSize",
    "WireMessage",
    "encode_exit_status",
    "encode_internal_error",
    "encode_port_prefix",
    "encode_resize",
    "expected_stream_count",
    "forward_error_message",
    "framing_for_subprotocol",
    "negotiate_spdy_exec",
    "negotiate_spdy_portforward",
    "negotiate_websocket_exec",
    "negotiate_websocket_portforward",
    "parse_port",
    "parse_port_query",
    "port_channels",
    "port_greetings",
    "port_index",
    "stream_type",
]
