"""asyncio around wsproto for the `channel.k8s.io` family: numbered byte channels in messages.

The HTTP layer has already answered the upgrade; this owns the socket afterwards. Messages are
reassembled (up to `max_message` bytes), decoded by the shared `ChannelFraming` core and fed
to the pipe registered for their channel; messages for channels nobody reads are dropped, as
the Go server does. Outgoing data is cut into messages of at most 32 KiB so that one large
write does not become one large allocation on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, generate_accept_token

from ..protocols.channel import ChannelClose, ChannelData, ChannelError, ChannelFraming
from ..sdk.pipe import InboundPipe
from ._pipe import shut_down

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
SEND_CHUNK = 32 * 1024


def accept_token(key: str) -> str:
    """Sec-WebSocket-Accept for a client's Sec-WebSocket-Key (RFC 6455 §4.2.2)."""
    return generate_accept_token(key.strip().encode("ascii")).decode("ascii")


class WsChannel:
    """One channel of a session. Implements the capabilities' `ByteStream`."""

    def __init__(self, session: WebSocketSession, number: int) -> None:
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
        """v5 tells the client with the close signal; older versions have no way to say it,
        so the channel just goes quiet until the WebSocket closes."""
        if self._closed:
            return
        self._closed = True
        if self.session.framing.stream_close:
            with contextlib.suppress(OSError):
                await self.session.send_raw(self.session.framing.encode_close(self.number))


class WebSocketSession:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        initial: bytes = b"",
        *,
        framing: ChannelFraming,
        idle_timeout: float = 4 * 3600,
        max_message: int = 1 << 20,
        channel_buffer: int = 1 << 20,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._ws = Connection(ConnectionType.SERVER)
        self._initial = initial
        self.framing = framing
        self._idle_timeout = idle_timeout
        self._max_message = max_message
        self.channel_buffer = channel_buffer
        self._channels: dict[int, WsChannel] = {}
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    def channel(self, number: int) -> WsChannel:
        """The channel object for `number`; input for it is kept only once this was called."""
        if number not in self._channels:
            self._channels[number] = WsChannel(self, number)
        return self._channels[number]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="websocket read loop")

    # --- output ---------------------------------------------------------------------------

    async def send(self, channel: int, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, max(len(view), 1), SEND_CHUNK):
            await self.send_raw(
                self.framing.encode(channel, bytes(view[start : start + SEND_CHUNK]))
            )

    async def send_raw(self, message: bytes | str) -> None:
        if self.closed.is_set() or self._ws.state is not ConnectionState.OPEN:
            raise BrokenPipeError("the WebSocket is closed")
        if isinstance(message, str):
            self._write(self._ws.send(TextMessage(data=message)))
        else:
            self._write(self._ws.send(BytesMessage(data=message)))
        await self._writer.drain()

    def _write(self, data: bytes) -> None:
        if data and not self._writer.is_closing():
            self._writer.write(data)
            self._last_activity = self._loop.time()

    async def aclose(
        self, code: int = CloseReason.NORMAL_CLOSURE, reason: str = "", grace: float = 5.0
    ) -> None:
        """Send a close frame, wait up to `grace` for the client's, then close the socket."""
        for channel in self._channels.values():
            channel.pipe.discard()  # a full buffer must not keep the read loop from the close
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            with contextlib.suppress(LocalProtocolError):
                self._write(self._ws.send(CloseConnection(code=code, reason=reason)))
            with contextlib.suppress(OSError):
                await self._writer.drain()
        if not self.closed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self.closed.wait()
        await shut_down(self._task, self._end, self._writer)

    # --- input ----------------------------------------------------------------------------

    async def _run(self) -> None:
        parts: list[bytes | str] = []
        size = 0
        try:
            data = self._initial
            while True:
                if data:
                    self._ws.receive_data(data)
                for event in self._ws.events():
                    match event:
                        case BytesMessage() | TextMessage():
                            size += len(event.data)
                            if size > self._max_message:
                                self._fail(CloseReason.MESSAGE_TOO_BIG, "message too big")
                                return
                            parts.append(
                                event.data if isinstance(event.data, str) else bytes(event.data)
                            )
                            if event.message_finished:
                                message = _join(parts)
                                parts, size = [], 0
                                if not await self._deliver(message):
                                    return
                        case Ping():
                            self._write(self._ws.send(event.response()))
                        case CloseConnection():
                            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                                self._write(self._ws.send(event.response()))
                            return
                        case _:
                            pass
                if self._ws.state is ConnectionState.CLOSED:
                    return
                data = await self._read_or_idle()
                if not data:
                    return
        except (OSError, LocalProtocolError) as exc:
            log.debug("WebSocket connection lost: %s", exc)
        finally:
            self._end()

    async def _deliver(self, message: bytes | str) -> bool:
        try:
            decoded = self.framing.decode(message)
        except ChannelError as exc:
            self._fail(CloseReason.PROTOCOL_ERROR, str(exc))
            return False
        match decoded:
            case ChannelData(channel, payload):
                target = self._channels.get(channel)
                if target is not None:
                    await target.pipe.put(payload)
            case ChannelClose(channel):
                target = self._channels.get(channel)
                if target is not None:
                    target.pipe.feed_eof()
            case None:
                pass
        return True

    def _fail(self, code: int, reason: str) -> None:
        log.warning("closing WebSocket: %s", reason)
        if self._ws.state is ConnectionState.OPEN:
            self._write(self._ws.send(CloseConnection(code=code, reason=reason[:120])))

    async def _read_or_idle(self) -> bytes:
        while True:
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

    def _end(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for channel in self._channels.values():
            channel.pipe.feed_eof()


def _join(parts: list[bytes | str]) -> bytes | str:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], str):
        return "".join(p for p in parts if isinstance(p, str))
    return b"".join(p for p in parts if isinstance(p, bytes | bytearray))
