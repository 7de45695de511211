"""asyncio around wsproto for both ends of a `channel.k8s.io` session: the kubelet API serving
kubectl, and `vkubelet.streaming` calling another apiserver or kubelet.

The HTTP upgrade has been answered before a `WebSocket` takes the socket. Messages are read
piece by piece as wsproto parses them, so a large message never has to be held whole unless the
caller wants it whole (`ChannelSession` does; the streaming client's SPDY tunnel does not). A
client pings every few seconds, as client-go's heartbeat does, so that idle proxies and load
balancers do not close a quiet session; a server closes a session idle for `idle_timeout`.

`ChannelSession` is the channel protocol on top: messages are reassembled (up to
`max_message` bytes), decoded by the shared `ChannelFraming` core and fed to the pipe
registered for their channel; messages for channels nobody reads are dropped, as the Go server
does. Outgoing data is cut into messages of at most 32 KiB so that one large write does not
become one large allocation on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from ..protocols.channel import ChannelClose, ChannelData, ChannelError, ChannelFraming
from .pipe import InboundPipe

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
SEND_CHUNK = 32 * 1024


class WebSocket:
    """One WebSocket on an upgraded connection; `initial` is what arrived with the upgrade."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        initial: bytes = b"",
        *,
        client: bool,
        ping_interval: float | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        kind = ConnectionType.CLIENT if client else ConnectionType.SERVER
        self._ws = Connection(kind, trailing_data=initial)
        self._idle_timeout = idle_timeout
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self.close_code: int | None = None  # set once the WebSocket has ended
        self._pinger = (
            asyncio.create_task(self._ping_every(ping_interval), name="websocket pings")
            if ping_interval
            else None
        )

    @property
    def open(self) -> bool:
        return self._ws.state is ConnectionState.OPEN

    # --- output ---------------------------------------------------------------------------

    def send_nowait(self, message: bytes | str) -> None:
        """Queue one message (str: a text message); `drain` waits until the socket has taken
        it. Messages queued by several tasks keep the order of the calls."""
        if not self.open:
            raise BrokenPipeError("the WebSocket is closed")
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(message)
        self._write(self._ws.send(event))

    async def drain(self) -> None:
        await self._writer.drain()

    async def send(self, message: bytes | str) -> None:
        self.send_nowait(message)
        await self.drain()

    def _write(self, data: bytes) -> None:
        if data and not self._writer.is_closing():
            self._writer.write(data)
            self._last_activity = self._loop.time()

    async def _ping_every(self, interval: float) -> None:
        with contextlib.suppress(OSError, LocalProtocolError):
            while True:
                await asyncio.sleep(interval)
                if not self.open:
                    return
                self._write(self._ws.send(Ping()))
                await self._writer.drain()

    # --- input ----------------------------------------------------------------------------

    async def receive(self) -> tuple[bytes, bool] | None:
        """The next piece of a data message and whether it completes the message; None once
        the WebSocket has closed (``close_code`` says how). One reader at a time."""
        while True:
            for event in self._ws.events():
                match event:
                    case BytesMessage() | TextMessage():
                        data = event.data
                        payload = data.encode() if isinstance(data, str) else bytes(data)
                        return payload, event.message_finished
                    case Ping():
                        with contextlib.suppress(LocalProtocolError):
                            self._write(self._ws.send(event.response()))
                    case CloseConnection():
                        if self._ws.state is ConnectionState.REMOTE_CLOSING:
                            with contextlib.suppress(LocalProtocolError):
                                self._write(self._ws.send(event.response()))
                        self.close_code = event.code
                        return None
                    case _:
                        pass  # pongs
            if self.close_code is not None:
                return None
            # b"": the peer has gone (or idled out); wsproto then reports an abnormal closure
            # and refuses further sends.
            self._ws.receive_data(await self._read_or_idle() or None)

    async def _read_or_idle(self) -> bytes:
        """The next bytes, or b"" once the peer has gone or the session was idle too long."""
        try:
            while True:
                if self._idle_timeout is None:
                    return await self._reader.read(READ_SIZE)
                try:
                    async with asyncio.timeout_at(self._last_activity + self._idle_timeout):
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    if self._loop.time() >= self._last_activity + self._idle_timeout:
                        log.info("closing WebSocket idle for %.0fs", self._idle_timeout)
                        return b""
                    continue
                self._last_activity = self._loop.time()
                return data
        except OSError as exc:
            log.debug("WebSocket connection lost: %s", exc)
            return b""

    # --- end ------------------------------------------------------------------------------

    def say_goodbye(self, code: int = CloseReason.NORMAL_CLOSURE, reason: str = "") -> None:
        """Queue a close frame, unless one was sent already."""
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            with contextlib.suppress(LocalProtocolError):
                self._write(self._ws.send(CloseConnection(code=code, reason=reason[:120])))

    async def aclose(self, code: int = CloseReason.NORMAL_CLOSURE) -> None:
        """Say goodbye with a close frame (if not done already) and drop the socket, without
        waiting for the peer's answer (the caller waits for it if it wants it)."""
        if self._pinger is not None:
            self._pinger.cancel()
        self.say_goodbye(code)
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(5):
                await self._writer.drain()
        if self.close_code is None:
            self.close_code = code
        self._writer.close()
        with contextlib.suppress(TimeoutError, OSError):  # ssl.SSLError is an OSError
            async with asyncio.timeout(5):
                await self._writer.wait_closed()


class WsChannel:
    """One channel of a session. Implements the capabilities' `ByteStream`."""

    def __init__(self, session: ChannelSession, number: int) -> None:
        self.session = session
        self.number = number
        self.pipe = InboundPipe(session.channel_buffer)
        self._closed = False

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self.pipe.read(max_bytes)

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise BrokenPipeError(f"channel {self.number} is closed")
        await self.session.send(self.number, data)

    async def write_quietly(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            await self.write(data)

    async def close(self) -> None:
        """v5 tells the peer with the close signal; older versions have no way to say it, so
        the channel just goes quiet until the WebSocket closes."""
        if self._closed:
            return
        self._closed = True
        if self.session.framing.stream_close:
            with contextlib.suppress(OSError):
                await self.session.ws.send(self.session.framing.encode_close(self.number))


class ChannelSession:
    """Numbered channels over a WebSocket: one read loop fills the pipe of each channel."""

    def __init__(
        self,
        ws: WebSocket,
        framing: ChannelFraming,
        *,
        max_message: int = 1 << 20,
        channel_buffer: int = 1 << 20,
    ) -> None:
        self.ws = ws
        self.framing = framing
        self._max_message = max_message
        self.channel_buffer = channel_buffer
        self._channels: dict[int, WsChannel] = {}
        self.error: str | None = None  # why the session ended, when it was not orderly
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def channel(self, number: int) -> WsChannel:
        """The channel object for `number`; input for it is kept only once this was called."""
        if number not in self._channels:
            self._channels[number] = WsChannel(self, number)
        return self._channels[number]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="websocket channel read loop")

    async def send(self, channel: int, data: bytes) -> None:
        """Even empty data is sent: an empty message on an output channel tells a client that
        the session is ready."""
        view = memoryview(data)
        for start in range(0, max(len(view), 1), SEND_CHUNK):
            piece = bytes(view[start : start + SEND_CHUNK])
            await self.ws.send(self.framing.encode(channel, piece))

    async def aclose(self, grace: float = 0.0) -> None:
        """Send a close frame, wait up to `grace` for the peer's, then close the socket."""
        for channel in self._channels.values():
            channel.pipe.discard()  # a full buffer must not keep the read loop from the close
        self.ws.say_goodbye()
        if grace and not self.closed.is_set():
            with contextlib.suppress(OSError):
                await self.ws.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self.closed.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end()
        await self.ws.aclose()

    async def _run(self) -> None:
        parts: list[bytes] = []
        size = 0
        try:
            while (piece := await self.ws.receive()) is not None:
                data, finished = piece
                size += len(data)
                if size > self._max_message:
                    self._fail(CloseReason.MESSAGE_TOO_BIG, "message too big")
                    return
                parts.append(data)
                if not finished:
                    continue
                message = b"".join(parts)
                parts, size = [], 0
                try:
                    decoded = self.framing.decode(message)
                except ChannelError as exc:
                    self._fail(CloseReason.PROTOCOL_ERROR, str(exc))
                    return
                await self._deliver(decoded)
            if self.ws.close_code not in (CloseReason.NORMAL_CLOSURE, None):
                self.error = f"the WebSocket closed with code {self.ws.close_code}"
        finally:
            self._end()

    async def _deliver(self, decoded: ChannelData | ChannelClose | None) -> None:
        match decoded:
            case ChannelData(channel, payload):
                if (target := self._channels.get(channel)) is not None:
                    await target.pipe.put(payload)
            case ChannelClose(channel):
                if (target := self._channels.get(channel)) is not None:
                    target.pipe.feed_eof()
            case None:
                pass

    def _fail(self, code: int, reason: str) -> None:
        log.warning("closing WebSocket: %s", reason)
        self.error = reason
        self.ws.say_goodbye(code, reason)

    def _end(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for channel in self._channels.values():
            channel.pipe.feed_eof()


__all__ = ["ChannelSession", "WebSocket", "WsChannel"]
