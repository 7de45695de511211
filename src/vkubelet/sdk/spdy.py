"""asyncio around the sans-I/O `SpdyConnection`, for both ends: the kubelet API serving kubectl
(streams the client opens) and `vkubelet.streaming` calling another kubelet or apiserver
(streams we open, over a socket or tunnelled in a WebSocket).

One `SpdySession` owns a `ByteTransport`. Its read loop turns frames into events and feeds each
stream's bounded `InboundPipe`: a full inbox stops the loop, which stops reading the socket
(back-pressure, as spdystream does it, since SPDY as Kubernetes speaks it has no flow control).
Every write is flushed at once and awaited with `drain`, so a slow peer slows the provider
instead of filling memory. The session ends on EOF, on a protocol error, or (serving) after
`idle_timeout` without traffic either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterable
from typing import Protocol

from ..protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    Event,
    RstStatus,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReplied,
    StreamReset,
    StreamStateError,
)
from .pipe import InboundPipe

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024


class ByteTransport(Protocol):
    """Where the SPDY bytes travel. `read` returns b"" once the peer has gone, and raises
    `ConnectionError` (its text the reason) when what carries SPDY broke its own protocol."""

    async def read(self) -> bytes: ...

    def write(self, data: bytes) -> None:
        """Queue bytes; calls keep their order."""
        ...

    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


class SocketTransport:
    """SPDY straight over an upgraded connection; `initial` is what arrived with the upgrade."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, initial: bytes = b""
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._pending = initial

    async def read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        try:
            return await self._reader.read(READ_SIZE)
        except OSError as exc:
            log.debug("SPDY connection lost: %s", exc)
            return b""

    def write(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            async with asyncio.timeout(5):
                await self._writer.wait_closed()


class SpdyStream:
    """One stream, opened by either end. Implements the capabilities' `ByteStream`."""

    def __init__(self, session: SpdySession, stream_id: int, headers: dict[str, str]) -> None:
        self.session = session
        self.id = stream_id
        self.headers = headers
        self.inbox = InboundPipe(session.stream_buffer)
        self.replied = asyncio.Event()  # the stream is accepted (by whichever end did not open it)
        self.refused: str | None = None  # why the stream ended before or instead of a reply
        self.remote_fin = False  # the peer ended its side in order (not reset, not lost)
        self._write_closed = False

    @property
    def kind(self) -> str:
        """The stream's ``streamType`` header (error, stdin, data...)."""
        return next((v for k, v in self.headers.items() if k.lower() == "streamtype"), "")

    def reply(self) -> bool:
        """Accept a stream the peer opened."""
        return self.session.reply(self)

    def reset(self, status: int = RstStatus.CANCEL) -> None:
        """Abandon the stream both ways."""
        self.session.reset(self, status)

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self.inbox.read(max_bytes)

    async def write(self, data: bytes) -> None:
        if self._write_closed:
            raise BrokenPipeError(f"SPDY stream {self.id} is closed for writing")
        if data:
            await self.session.send(self, data, fin=False)

    async def write_quietly(self, data: bytes) -> None:
        """For error reports: the peer may well have gone already, which is fine."""
        with contextlib.suppress(OSError):
            await self.write(data)

    async def close(self) -> None:
        """Half-close: FIN once; later calls, and calls on a stream that is gone, do nothing."""
        if self._write_closed:
            return
        self._write_closed = True
        with contextlib.suppress(OSError):
            await self.session.send(self, b"", fin=True)

    def discard(self) -> None:
        """The handler is done with the stream: drop whatever else the peer sends on it."""
        self.inbox.discard()
        self.session.forget(self)

    def gone(self, reason: str) -> None:
        """Reset, or the connection ended: no more input, no more output."""
        self._write_closed = True
        if not self.replied.is_set():
            self.refused = reason
            self.replied.set()
        self.inbox.feed_eof()


class SpdySession:
    def __init__(
        self,
        transport: ByteTransport,
        *,
        client: bool,
        limits: SpdyLimits | None = None,
        stream_buffer: int = 1 << 20,
        idle_timeout: float | None = None,
        ping_interval: float | None = None,
    ) -> None:
        self._transport = transport
        self._conn = SpdyConnection(limits, client=client)
        self._peer = "the server" if client else "client"
        self.stream_buffer = stream_buffer
        self._idle_timeout = idle_timeout
        self._ping_interval = ping_interval
        self._streams: dict[int, SpdyStream] = {}
        self._opened: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self.closed = asyncio.Event()  # the read loop has ended: nothing more will arrive
        self.error: str | None = None  # why, if it was not an orderly end

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="spdy read loop"))
        if self._ping_interval:
            self._tasks.append(asyncio.create_task(self._ping_every(self._ping_interval)))

    async def aclose(self, grace: float = 0.0) -> None:
        """Say GOAWAY, give the peer `grace` seconds to hang up, then drop the connection;
        streams still open end at once.

        Closing first would make the kernel answer the peer's late packets with a reset, and
        a reset can destroy data the peer has received but not yet read (the exit status).
        """
        if grace:
            for stream in list(self._streams.values()):
                stream.inbox.discard()  # a full buffer must not keep the read loop from the close
        if not self.closed.is_set():
            self._conn.goaway()
            self._flush()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._transport.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self.closed.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._end("the connection was closed")
        await self._transport.aclose()

    # --- streams --------------------------------------------------------------------------

    async def accept(self) -> SpdyStream | None:
        """The next stream the peer opens, or None once the connection has ended."""
        if self.closed.is_set() and self._opened.empty():
            return None
        return await self._opened.get()

    def open(self, headers: dict[str, str]) -> SpdyStream:
        """Send SYN_STREAM now; `wait_replied` waits for the answers. Opening several streams
        before waiting saves a round trip per stream over client-go's one-by-one habit.
        Raises `BrokenPipeError` when the connection cannot take a new stream."""
        if self.closed.is_set():
            raise BrokenPipeError(f"the connection is closed: {self.error or 'by ' + self._peer}")
        try:
            stream_id = self._conn.open_stream(headers)
        except StreamStateError as exc:
            raise BrokenPipeError(str(exc)) from None
        stream = SpdyStream(self, stream_id, headers)
        self._streams[stream_id] = stream
        self._flush()
        return stream

    async def wait_replied(self, streams: Iterable[SpdyStream], within: float) -> None:
        """Wait until the peer has accepted every stream. Raises `ConnectionRefusedError` if it
        refused one and `TimeoutError` if it did not answer `within` seconds."""
        async with asyncio.timeout(within):
            for stream in streams:
                await stream.replied.wait()
                if stream.refused is not None:
                    raise ConnectionRefusedError(
                        f"the server refused the {stream.kind} stream: {stream.refused}"
                    )

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
        self._streams.pop(stream.id, None)
        stream.gone("reset by us")
        stream.inbox.discard()

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
            raise BrokenPipeError(f"SPDY stream {stream.id} was reset by {self._peer}")
        self._flush()
        await self._transport.drain()

    def _flush(self) -> None:
        out = self._conn.data_to_send()
        if out:
            self._transport.write(out)
            self._last_activity = self._loop.time()

    async def _ping_every(self, interval: float) -> None:
        """Keeps NATs and the apiserver's proxy from dropping a quiet connection."""
        with contextlib.suppress(OSError):
            while not self.closed.is_set():
                await asyncio.sleep(interval)
                self._conn.ping()
                self._flush()
                await self._transport.drain()

    # --- input ----------------------------------------------------------------------------

    async def _run(self) -> None:
        reason = f"{self._peer} closed the connection"
        try:
            while not self._conn.failed:
                data = await self._read_or_idle()
                if not data:
                    break
                await self._dispatch(self._conn.receive_data(data))
            if self._conn.failed:
                reason = self.error or "protocol error"
        except ConnectionError as exc:
            self.error = reason = str(exc)
        finally:
            self._flush()
            self._end(reason)

    async def _read_or_idle(self) -> bytes:
        if self._idle_timeout is None:
            return await self._transport.read()
        while True:
            deadline = self._last_activity + self._idle_timeout
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self._transport.read()
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
                case StreamOpened() if self._conn.client:
                    # Kubernetes servers never open streams toward the client.
                    self._conn.reset(event.stream_id, RstStatus.REFUSED_STREAM)
                case StreamOpened():
                    opened = SpdyStream(self, event.stream_id, event.headers)
                    opened.replied.set()  # it is ours to answer: nothing to wait for
                    self._streams[opened.id] = opened
                    if event.fin:
                        opened.inbox.feed_eof()
                    self._opened.put_nowait(opened)
                case StreamReplied():
                    if (stream := self._streams.get(event.stream_id)) is not None:
                        stream.replied.set()
                case DataReceived():
                    if (stream := self._streams.get(event.stream_id)) is not None:
                        await stream.inbox.put(event.data)
                        if event.fin:
                            stream.remote_fin = True
                            stream.inbox.feed_eof()
                case StreamReset():
                    if (stream := self._streams.pop(event.stream_id, None)) is not None:
                        stream.gone(f"reset by {self._peer} ({_rst_name(event.status)})")
                case ConnectionFailed():
                    self.error = f"SPDY protocol error from {self._peer}: {event.reason}"
                    log.warning("%s", self.error)
                case _:
                    pass  # pings are echoed by the core; after GOAWAY no new streams open
        self._flush()

    def _end(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._flush()
        for stream in self._streams.values():
            stream.gone(reason)
        self._streams.clear()
        self._opened.put_nowait(None)


def _rst_name(status: int) -> str:
    try:
        return RstStatus(status).name
    except ValueError:
        return f"status {status}"
