"""asyncio around the sans-I/O `SpdyConnection`: a read loop, per-stream buffers, flushed writes.

One `SpdySession` owns an upgraded socket. Its read loop turns frames into events: new streams
are queued for the route handler (`accept`), data goes to each stream's `InboundPipe`, and
pings are echoed by the core. Every write is flushed at once and awaited with `drain`, so a slow
client slows the provider instead of filling memory. The session ends on EOF, on a protocol
error, or after `idle_timeout` without traffic either way (the kubelet's default is 4 h).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    Event,
    RstStatus,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReset,
    StreamStateError,
)
from ..sdk._pipe import InboundPipe
from ._pipe import shut_down

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024


class SpdyStream:
    """One client-opened stream. Implements the capabilities' `ByteStream`."""

    def __init__(self, session: SpdySession, stream_id: int, headers: dict[str, str]) -> None:
        self.session = session
        self.id = stream_id
        self.headers = headers
        self.pipe = InboundPipe(session.stream_buffer)
        self._closed = False  # our FIN sent (or the stream is gone)

    def reply(self) -> bool:
        return self.session.reply(self)

    def reset(self, status: int = RstStatus.CANCEL) -> None:
        self.session.reset(self, status)

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self.pipe.read(max_bytes)

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise BrokenPipeError(f"SPDY stream {self.id} is closed")
        if data:
            await self.session.send(self, data, fin=False)

    async def write_quietly(self, data: bytes) -> None:
        """For error reports: the client may well have gone already, which is fine."""
        with contextlib.suppress(OSError):
            await self.write(data)

    async def close(self) -> None:
        """Send FIN once; later calls, and calls on a stream that is gone, do nothing."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            await self.session.send(self, b"", fin=True)

    def discard(self) -> None:
        """The handler is done with the stream: drop whatever else the client sends on it."""
        self.pipe.discard()
        self.session.forget(self)

    def mark_gone(self) -> None:
        """The stream was reset or the connection ended: no more input, no more output."""
        self._closed = True
        self.pipe.feed_eof()


class SpdySession:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        initial: bytes = b"",
        *,
        limits: SpdyLimits | None = None,
        idle_timeout: float = 4 * 3600,
        stream_buffer: int = 1 << 20,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._initial = initial
        self._conn = SpdyConnection(limits)
        self._idle_timeout = idle_timeout
        self.stream_buffer = stream_buffer
        self._streams: dict[int, SpdyStream] = {}
        self._opened: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()  # the read loop has ended: no more input, ever

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="spdy read loop")

    async def aclose(self, grace: float = 5.0) -> None:
        """Say GOAWAY, give the client `grace` seconds to hang up, then close the socket.

        Closing first would make the kernel answer the client's late packets with a reset, and
        a reset can destroy data the client has received but not yet read (the exit status).
        """
        for stream in list(self._streams.values()):
            stream.pipe.discard()  # a full buffer must not keep the read loop from the close
        if not self.closed.is_set():
            self._conn.goaway()
            self._flush()
            with contextlib.suppress(OSError):
                await self._writer.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self.closed.wait()
        await shut_down(self._task, self._end, self._writer)

    async def accept(self) -> SpdyStream | None:
        """The next stream the client opens, or None once the connection has ended."""
        if self.closed.is_set() and self._opened.empty():
            return None
        return await self._opened.get()

    def stream(self, stream_id: int) -> SpdyStream | None:
        return self._streams.get(stream_id)

    # --- output ---------------------------------------------------------------------------

    def reply(self, stream: SpdyStream) -> bool:
        ok = self._conn.reply(stream.id)
        self._flush()
        return ok

    def reset(self, stream: SpdyStream, status: int = RstStatus.CANCEL) -> None:
        self._conn.reset(stream.id, status)
        self._flush()
        stream.mark_gone()
        stream.discard()

    def forget(self, stream: SpdyStream) -> None:
        self._streams.pop(stream.id, None)

    async def send(self, stream: SpdyStream, data: bytes, *, fin: bool) -> None:
        if self.closed.is_set():
            raise BrokenPipeError("the SPDY connection is closed")
        try:
            sent = self._conn.send_data(stream.id, data, fin)
        except StreamStateError as exc:
            raise BrokenPipeError(str(exc)) from None
        if not sent:
            raise BrokenPipeError(f"SPDY stream {stream.id} was reset by the client")
        self._flush()
        await self._writer.drain()

    def _flush(self) -> None:
        out = self._conn.data_to_send()
        if out and not self._writer.is_closing():
            self._writer.write(out)
            self._last_activity = self._loop.time()

    # --- input ----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            if self._initial:
                await self._dispatch(self._conn.receive_data(self._initial))
            while not self._conn.failed:
                data = await self._read_or_idle()
                if not data:
                    break
                await self._dispatch(self._conn.receive_data(data))
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("SPDY connection lost: %s", exc)
        finally:
            self._end()

    async def _read_or_idle(self) -> bytes:
        while True:
            deadline = self._last_activity + self._idle_timeout
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self._reader.read(READ_SIZE)
            except TimeoutError:
                if self._loop.time() >= self._last_activity + self._idle_timeout:
                    log.info("closing SPDY connection idle for %.0fs", self._idle_timeout)
                    return b""
                continue  # we wrote something meanwhile: the connection is not idle
            self._last_activity = self._loop.time()
            return data

    async def _dispatch(self, events: list[Event]) -> None:
        self._flush()  # ping echoes and resets queued by the core
        for event in events:
            match event:
                case StreamOpened():
                    stream = SpdyStream(self, event.stream_id, event.headers)
                    self._streams[stream.id] = stream
                    if event.fin:
                        stream.pipe.feed_eof()
                    self._opened.put_nowait(stream)
                case DataReceived():
                    target = self._streams.get(event.stream_id)
                    if target is not None:
                        await target.pipe.put(event.data)
                        if event.fin:
                            target.pipe.feed_eof()
                case StreamReset():
                    gone = self._streams.pop(event.stream_id, None)
                    if gone is not None:
                        gone.mark_gone()
                case ConnectionFailed():
                    log.warning("SPDY protocol error from client: %s", event.reason)
                case _:
                    pass  # pings are echoed by the core; GOAWAY only stops new streams

    def _end(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._flush()
        for stream in self._streams.values():
            stream.mark_gone()
        self._streams.clear()
        self._opened.put_nowait(None)
