"""The client half of SPDY, as the apiserver plays it, assembled from the codec pieces.

Tests drive ``SpdyConnection`` with bytes this peer writes and check the bytes it answers with,
so every assertion is about what crosses the wire.
"""

from __future__ import annotations

from vkubelet.protocols.spdy.frames import (
    DataFrame,
    Frame,
    FrameParser,
    GoAwayFrame,
    PingFrame,
    RstStreamFrame,
    SynReplyFrame,
    SynStreamFrame,
)
from vkubelet.protocols.spdy.headers import HeaderDecoder, HeaderEncoder

# Four consecutive header blocks written by Go's compress/zlib (NewWriterLevelDict at
# BestCompression with the dictionary from moby/spdystream, Flush after each), i.e. exactly
# what the apiserver's SPDY client sends: {streamtype: error}, {streamtype: stdout},
# {port: 8080, requestid: 0, streamtype: data}, and an empty block.
GO_BLOCKS = [
    bytes.fromhex("78f9e3c6a7c26260606004a7b392a2d4c45c6851c29a0a0a6800000000ffff"),
    bytes.fromhex("c22ac5565c92925f5a02000000ffff"),
    bytes.fromhex("02a55548b15d04ce21160616060c0c0c9c459068ce04257f46030cdda0322a11000000ffff"),
    bytes.fromhex("6260606000000000ffff"),
]


class Peer:
    def __init__(self) -> None:
        self.encoder = HeaderEncoder()
        self.decoder = HeaderDecoder()
        self.parser = FrameParser()
        self.replies: dict[int, dict[str, str]] = {}

    def syn_stream(
        self,
        stream_id: int,
        headers: dict[str, str],
        *,
        fin: bool = False,
        unidirectional: bool = False,
    ) -> bytes:
        block = self.encoder.encode(headers)
        return SynStreamFrame(stream_id, block, fin=fin, unidirectional=unidirectional).serialize()

    def read(self, data: bytes) -> list[Frame]:
        """Parse what the server sent; reply header blocks are inflated in order."""
        self.parser.receive(data)
        frames: list[Frame] = []
        while (frame := self.parser.next_frame()) is not None:
            if isinstance(frame, SynReplyFrame):
                self.replies[frame.stream_id] = self.decoder.decode(frame.header_block)
            frames.append(frame)
        return frames


def data(stream_id: int, payload: bytes, fin: bool = False) -> bytes:
    return DataFrame(stream_id, payload, fin).serialize()


def ping(ping_id: int) -> bytes:
    return PingFrame(ping_id).serialize()


def rst(stream_id: int, status: int) -> bytes:
    return RstStreamFrame(stream_id, status).serialize()


def goaway(last: int, status: int = 0) -> bytes:
    return GoAwayFrame(last, status).serialize()
