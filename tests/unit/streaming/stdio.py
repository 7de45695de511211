"""In-memory stdio for `AttachIO`: what an upper kubelet would hand a relaying provider."""

from __future__ import annotations

import asyncio


class Collected:
    """An output stream that keeps everything written to it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._grew = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.data += data
        self._grew.set()

    async def wait_until_it_ends_with(self, suffix: bytes, *, beyond: int = 0) -> None:
        """Until the data ends with `suffix` and is longer than `beyond` bytes."""
        while len(self.data) <= beyond or not self.data.endswith(suffix):
            self._grew.clear()
            await self._grew.wait()


class Feed:
    """An input stream the test writes to as it goes; `end` is the client's EOF."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()

    def send(self, data: bytes) -> None:
        self._queue.put_nowait(data)

    def end(self) -> None:
        self._queue.put_nowait(b"")

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self._queue.get()


class Payload:
    """An input stream serving fixed bytes in chunks, then EOF."""

    def __init__(self, data: bytes, chunk: int = 65536) -> None:
        self._view = memoryview(data)
        self._chunk = chunk
        self._pos = 0

    async def read(self, max_bytes: int = 65536) -> bytes:
        size = min(max_bytes, self._chunk)
        piece = bytes(self._view[self._pos : self._pos + size])
        self._pos += len(piece)
        return piece


class Loopback:
    """The upper side of a forwarded connection (a `ByteStream`): sends a payload, keeps what
    comes back, and notes the far side's half-close."""

    def __init__(self, payload: bytes) -> None:
        self._source = Payload(payload)
        self.received = bytearray()
        self.closed = False

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self._source.read(max_bytes)

    async def write(self, data: bytes) -> None:
        self.received += data

    async def close(self) -> None:
        self.closed = True
