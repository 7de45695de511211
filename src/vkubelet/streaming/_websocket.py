"""The client end of a WebSocket: our h11 handshake, then wsproto for the frames.

Doing the handshake with the same `upgrade` as SPDY gives both transports one error path (the
apiserver's Status on a refusal). Messages are read piece by piece as wsproto parses them, so a
large message never has to be held whole unless the caller wants it whole (the channel
protocol does; the SPDY tunnel does not). A ping every few seconds keeps idle proxies and load
balancers from closing a quiet session, as client-go's heartbeat does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
from collections.abc import Sequence

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError, generate_accept_token

from ._connect import READ_SIZE, Endpoint, Upgraded, upgrade
from ._errors import StreamingError

log = logging.getLogger(__name__)


async def open_websocket(
    endpoint: Endpoint,
    target: str,
    subprotocols: Sequence[str],
    *,
    ping_interval: float | None = 5.0,
) -> WebSocket:
    """GET `target` as a WebSocket offering `subprotocols`; the server must pick one of them."""
    key = base64.b64encode(os.urandom(16)).decode("ascii")
    headers = [
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Key", key),
        ("Sec-WebSocket-Protocol", ", ".join(subprotocols)),
    ]
    upgraded = await upgrade(endpoint, "GET", target, headers)
    try:
        if upgraded.headers.get("upgrade", "").lower() != "websocket":
            raise StreamingError(f"{endpoint.server} switched to {upgraded.headers.get('upgrade')}")
        expected = generate_accept_token(key.encode("ascii")).decode("ascii")
        if upgraded.headers.get("sec-websocket-accept") != expected:
            raise StreamingError(f"{endpoint.server} sent a wrong Sec-WebSocket-Accept")
        chosen = upgraded.headers.get("sec-websocket-protocol", "")
        if chosen not in subprotocols:
            raise StreamingError(
                f"{endpoint.server} chose subprotocol {chosen!r}, not one of {list(subprotocols)}"
            )
    except BaseException:
        await upgraded.aclose()
        raise
    return WebSocket(upgraded, chosen, ping_interval=ping_interval)


class WebSocket:
    def __init__(
        self, upgraded: Upgraded, subprotocol: str, *, ping_interval: float | None = 5.0
    ) -> None:
        self.subprotocol = subprotocol
        self._upgraded = upgraded
        self._reader = upgraded.reader
        self._writer = upgraded.writer
        self._ws = Connection(ConnectionType.CLIENT, trailing_data=upgraded.trailing)
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

    def send_nowait(self, data: bytes) -> None:
        """Queue one binary message; `drain` waits until the socket has taken it. Messages
        queued by several tasks keep the order of the calls."""
        if not self.open:
            raise BrokenPipeError("the WebSocket is closed")
        self._writer.write(self._ws.send(BytesMessage(data=data)))

    async def drain(self) -> None:
        await self._writer.drain()

    async def send(self, data: bytes) -> None:
        self.send_nowait(data)
        await self.drain()

    async def _ping_every(self, interval: float) -> None:
        with contextlib.suppress(OSError, LocalProtocolError):
            while True:
                await asyncio.sleep(interval)
                if not self.open:
                    return
                self._writer.write(self._ws.send(Ping()))
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
                        self._writer.write(self._ws.send(event.response()))
                    case CloseConnection():
                        if self._ws.state is ConnectionState.REMOTE_CLOSING:
                            with contextlib.suppress(LocalProtocolError):
                                self._writer.write(self._ws.send(event.response()))
                        self.close_code = event.code
                        return None
                    case _:
                        pass  # pongs
            if self.close_code is not None:
                return None
            try:
                data = await self._reader.read(READ_SIZE)
            except OSError as exc:
                log.debug("WebSocket read failed: %s", exc)
                data = b""
            if not data:
                self.close_code = CloseReason.ABNORMAL_CLOSURE
                return None
            try:
                self._ws.receive_data(data)
            except RemoteProtocolError as exc:
                raise StreamingError(f"WebSocket protocol error from the server: {exc}") from exc

    # --- end ------------------------------------------------------------------------------

    async def aclose(self, code: int = CloseReason.NORMAL_CLOSURE) -> None:
        """Say goodbye with a close frame (if the server has not already) and drop the socket;
        like client-go, without waiting for the server's answer."""
        if self._pinger is not None:
            self._pinger.cancel()
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            with contextlib.suppress(LocalProtocolError, OSError):
                self._writer.write(self._ws.send(CloseConnection(code=code)))
                async with asyncio.timeout(5):
                    await self._writer.drain()
        if self.close_code is None:
            self.close_code = code
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._upgraded.aclose()
