"""The client end of SPDY: the session over an upgraded socket or tunnelled in a WebSocket, its
failures as `StreamingError`.

The SPDY bytes are the same whichever way they travel: straight over the upgraded TLS socket,
or (port-forward through an apiserver since 1.31) inside WebSocket binary messages. A
`ByteTransport` hides which; `vkubelet.sdk.spdy` is the one session both ends run.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..sdk.spdy import ByteTransport, SocketTransport, SpdySession, SpdyStream
from ..sdk.websocket import WebSocket
from ._connect import Upgraded
from ._errors import StreamingError


def socket_transport(upgraded: Upgraded) -> SocketTransport:
    """SPDY straight over the upgraded connection."""
    return SocketTransport(upgraded.reader, upgraded.writer, upgraded.trailing)


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


def client_session(transport: ByteTransport, *, ping_interval: float | None = 5.0) -> SpdySession:
    """A running session whose streams we open."""
    session = SpdySession(transport, client=True, ping_interval=ping_interval)
    session.start()
    return session


def open_stream(session: SpdySession, headers: dict[str, str]) -> SpdyStream:
    try:
        return session.open(headers)
    except BrokenPipeError as exc:
        raise StreamingError(str(exc)) from None


async def wait_replied(session: SpdySession, streams: Iterable[SpdyStream], within: float) -> None:
    """Wait until the server has accepted every stream; raise if it refused one."""
    try:
        await session.wait_replied(streams, within)
    except ConnectionRefusedError as exc:
        raise StreamingError(str(exc)) from None
    except TimeoutError:
        raise StreamingError(
            f"the server did not accept the streams within {within:.0f}s"
        ) from None
