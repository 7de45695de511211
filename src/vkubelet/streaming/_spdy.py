"""asyncio around the client role of `SpdyConnection`, over a socket or a WebSocket tunnel.

The SPDY bytes are the same whichever way they travel: straight over the upgraded TLS socket,
or (port-forward through an apiserver since 1.31) inside WebSocket binary messages. A
`ByteTransport` hides which. One read loop turns frames into events and feeds each stream's
bounded `InboundPipe`; a full inbox stops the loop, which stops reading the socket (back-pressure,
as spdystream does it). Writes are flushed at once and awaited with `drain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from ..sdk._pipe import InboundPipe
from ._connect import READ_SIZE, Upgraded
from ._errors import StreamingError
from ._websocket import WebSocket

log = logging.getLogger(__name__)


class ByteTransport(Protocol):
    async def read(self) -> bytes:
        """Some bytes, or b"" once the peer has gone."""
        ...

    def write(self, data: bytes) -> None:
        """Queue bytes; calls keep their order."""
        ...

    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


class SocketTransport:
    """SPDY straight over the upgraded connection."""

    def __init__(self, upgraded: Upgraded) -> None:
        self._upgraded = upgraded
        self._pending = upgraded.trailing

    async def read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        try:
            return await self._upgraded.reader.read(READ_SIZE)
        except OSError as exc:
            log.debug("SPDY connection lost: %s", exc)
            return b""

    def write(self, data: bytes) -> None:
        if not self._upgraded.writer.is_closing():
            self._upgraded.writer.write(data)

    async def drain(self) -> None:
        await self._upgraded.writer.drain()

    async def aclose(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._upgraded.aclose()


class TunnelTransport:
    """SPDY inside WebSocket binary messages: message boundaries mean nothing, so each piece
    of a message is passed on as it arrives."""

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket

    async def read(self) -> bytes:
        while (piece := await self._ws.receive()) is not None:
            if piece[0]:
                return piece[0]
        return b""

    def write(self, data: bytes) -> None:
        if self._ws.open:
            self._ws.send_nowait(data)

    async def drain(self) -> None:
        await self._ws.drain()

    async def aclose(self) -> None:
        await self._ws.aclose()


class SpdyClientStream:
    """One stream we opened. Implements the capabilities' `ByteStream` (read, write, close)."""

    def __init__(self, session: SpdyClient, stream_id: int, headers: dict[str, str]) -> None:
        self.session = session
        self.id = stream_id
        self.headers = headers
        self.inbox = InboundPipe(session.stream_buffer)
        self.replied = asyncio.Event()
        self.refused: str | None = None  # why the stream ended before or instead of a reply
        self.remote_fin = False  # the peer ended its side in order (not reset, not lost)
        self._write_closed = False

    @property
    def kind(self) -> str:
        """The stream's ``streamType`` header (error, stdin, data...)."""
        return next((v for k, v in self.headers.items() if k.lower() == "streamtype"), "")

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self.inbox.read(max_bytes)

    async def write(self, data: bytes) -> None:
        if self._write_closed:
            raise BrokenPipeError(f"SPDY stream {self.id} is closed for writing")
        if data:
            await self.session.send(self, data, fin=False)

    async def close(self) -> None:
        """Half-close: FIN once; a stream that is already gone is left alone."""
        if self._write_closed:
            return
        self._write_closed = True
        with contextlib.suppress(OSError):
            await self.session.send(self, b"", fin=True)

    def reset(self) -> None:
        """Abandon the stream both ways (RST_STREAM CANCEL)."""
        self.session.reset(self)

    def gone(self, reason: str) -> None:
        self._write_closed = True
        if not self.replied.is_set():
            self.refused = reason
            self.replied.set()
        self.inbox.feed_eof()


class SpdyClient:
    def __init__(
        self,
        transport: ByteTransport,
        *,
        ping_interval: float | None = 5.0,
        stream_buffer: int = 1 << 20,
        limits: SpdyLimits | None = None,
    ) -> None:
        self._transport = transport
        self._conn = SpdyConnection(limits, client=True)
        self.stream_buffer = stream_buffer
        self._ping_interval = ping_interval
        self._streams: dict[int, SpdyClientStream] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = asyncio.Event()  # the read loop has ended: nothing more will arrive
        self.error: str | None = None  # why, if it was not an orderly end

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="spdy client read loop"))
        if self._ping_interval:
            self._tasks.append(asyncio.create_task(self._ping_every(self._ping_interval)))

    async def aclose(self) -> None:
        """Say GOAWAY and drop the connection; streams still open end at once."""
        if not self.closed.is_set():
            self._conn.goaway()
            self._flush()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._transport.drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._end("the connection was closed")
        await self._transport.aclose()

    # --- streams ------------------------------------------------------------------------

    def open(self, headers: dict[str, str]) -> SpdyClientStream:
        """Send SYN_STREAM now; `wait_replied` waits for the answers. Opening several streams
        before waiting saves a round trip per stream over client-go's one-by-one habit."""
        if self.closed.is_set():
            raise StreamingError(f"the connection is closed: {self.error or 'by the server'}")
        try:
            stream_id = self._conn.open_stream(headers)
        except StreamStateError as exc:
            raise StreamingError(str(exc)) from None
        stream = SpdyClientStream(self, stream_id, headers)
        self._streams[stream_id] = stream
        self._flush()
        return stream

    async def wait_replied(self, streams: Iterable[SpdyClientStream], within: float) -> None:
        """Wait until the server has accepted every stream; raise if it refused one."""
        try:
            async with asyncio.timeout(within):
                for stream in streams:
                    await stream.replied.wait()
                    if stream.refused is not None:
                        raise StreamingError(
                            f"the server refused the {stream.kind} stream: {stream.refused}"
                        )
        except TimeoutError:
            raise StreamingError(
                f"the server did not accept the streams within {within:.0f}s"
            ) from None

    async def send(self, stream: SpdyClientStream, data: bytes, *, fin: bool) -> None:
        if self.closed.is_set():
            raise BrokenPipeError("the SPDY connection is closed")
        try:
            sent = self._conn.send_data(stream.id, data, fin)
        except StreamStateError as exc:
            raise BrokenPipeError(str(exc)) from None
        if not sent:
            raise BrokenPipeError(f"SPDY stream {stream.id} was reset")
        self._flush()
        await self._transport.drain()

    def reset(self, stream: SpdyClientStream) -> None:
        self._conn.reset(stream.id, RstStatus.CANCEL)
        self._flush()
        self._streams.pop(stream.id, None)
        stream.gone("reset by us")
        stream.inbox.discard()

    def _flush(self) -> None:
        out = self._conn.data_to_send()
        if out:
            self._transport.write(out)

    async def _ping_every(self, interval: float) -> None:
        with contextlib.suppress(OSError):
            while not self.closed.is_set():
                await asyncio.sleep(interval)
                self._conn.ping()
                self._flush()
                await self._transport.drain()

    # --- input --------------------------------------------------------------------------

    async def _run(self) -> None:
        reason = "the server closed the connection"
        try:
            while not self._conn.failed:
                data = await self._transport.read()
                if not data:
                    break
                await self._dispatch(self._conn.receive_data(data))
            if self._conn.failed:
                reason = self.error or "protocol error"
        except StreamingError as exc:
            self.error = reason = str(exc)
        finally:
            self._flush()
            self._end(reason)

    async def _dispatch(self, events: list[Event]) -> None:
        self._flush()  # ping echoes and resets queued by the core
        for event in events:
            match event:
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
                        stream.gone(f"reset by the server ({_rst_name(event.status)})")
                case StreamOpened():
                    # Kubernetes servers never open streams toward the client.
                    self._conn.reset(event.stream_id, RstStatus.REFUSED_STREAM)
                case ConnectionFailed():
                    self.error = f"SPDY protocol error from the server: {event.reason}"
                    log.warning("%s", self.error)
                case _:
                    pass  # pings are echoed by the core; after GOAWAY no new streams open
        self._flush()

    def _end(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for stream in self._streams.values():
            stream.gone(reason)
        self._streams.clear()


def _rst_name(status: int) -> str:
    try:
        return RstStatus(status).name
    except ValueError:
        return f"status {status}"
