"""The inbound half of a stream or channel: bytes from the peer, waiting for their reader.

Shared by the kubelet API (server) and `vkubelet.streaming` (client), whose streams meet the
same problem: no flow control in the protocol.
"""

from __future__ import annotations

import asyncio
from collections import deque


class InboundPipe:
    """A bounded byte buffer between a connection's read loop and a provider.

    Neither SPDY (as the apiserver speaks it) nor the channel protocol has flow control, so the
    only brake is to stop reading the socket: `put` waits while more than `high_water` bytes
    are unread, which stalls the whole connection (as spdystream does) and lets TCP push back.
    Once the consumer is done it calls `discard`, and the data still arriving is dropped so that
    a stream nobody reads can never wedge the others.
    """

    def __init__(self, high_water: int = 1 << 20) -> None:
        self._high_water = high_water
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._discarded = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    async def put(self, data: bytes) -> None:
        if self._eof or self._discarded or not data:
            return
        while self._size > self._high_water and not self._discarded:
            self._writable.clear()
            await self._writable.wait()
        if self._discarded:
            return
        self._chunks.append(data)
        self._size += len(data)
        self._readable.set()

    def feed_eof(self) -> None:
        self._eof = True
        self._readable.set()

    def discard(self) -> None:
        self._discarded = self._eof = True
        self._chunks.clear()
        self._size = 0
        self._readable.set()
        self._writable.set()

    async def read(self, max_bytes: int = 65536) -> bytes:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        while not self._chunks:
            if self._eof:
                return b""
            self._readable.clear()
            await self._readable.wait()
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self._size -= len(chunk)
        if self._size <= self._high_water:
            self._writable.set()
        return chunk

    async def read_all(self, limit: int) -> bytes:
        """Everything up to the end (a status message); beyond `limit` bytes the rest is dropped
        so that a hostile peer cannot make us hold more."""
        out = bytearray()
        while data := await self.read():
            out += data[: max(0, limit - len(out))]
        return bytes(out)


__all__ = ["InboundPipe"]
