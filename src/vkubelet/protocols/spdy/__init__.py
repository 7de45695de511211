"""Sans-I/O SPDY/3.1: the server half kube-apiserver needs from a kubelet, and the client half
a relay needs to call an apiserver or kubelet.

Split like h2: ``frames`` (wire codec), ``headers`` (zlib-compressed header blocks) and
``connection`` (stream state machine emitting events). Nothing here touches a socket.
"""

from .connection import (
    ConnectionFailed,
    DataReceived,
    Event,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReplied,
    StreamReset,
    StreamStateError,
)
from .frames import FrameError, FrameParser, GoAwayStatus, RstStatus
from .headers import SPDY3_DICTIONARY, HeaderBlockError, HeaderDecoder, HeaderEncoder

__all__ = [
    "SPDY3_DICTIONARY",
    "ConnectionFailed",
    "DataReceived",
    "Event",
    "FrameError",
    "FrameParser",
    "GoAwayReceived",
    "GoAwayStatus",
    "HeaderBlockError",
    "HeaderDecoder",
    "HeaderEncoder",
    "PingAcknowledged",
    "PingReceived",
    "RstStatus",
    "SpdyConnection",
    "SpdyLimits",
    "StreamOpened",
    "StreamReplied",
    "StreamReset",
    "StreamStateError",
]
