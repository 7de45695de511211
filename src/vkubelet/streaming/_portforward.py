"""port-forward as a client: TCP connections into a pod behind another apiserver or kubelet.

Every route ends in SPDY ``portforward.k8s.io`` at the kubelet, so that is what we speak: one
SPDY connection carries any number of forwarded connections, each a pair of streams (error,
data) tagged with the port and a request id. Through an apiserver we first ask, as kubectl 1.31+
does, for a WebSocket with subprotocol ``SPDY/3.1+portforward.k8s.io`` and tunnel the SPDY
bytes through it (the apiserver unwraps them for the kubelet); when that upgrade is refused we
upgrade to SPDY directly. A kubelet only speaks the direct form.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

from ..protocols.portforward import (
    PORT_FORWARD_PROTOCOL,
    WEBSOCKET_SPDY_TUNNEL_PROTOCOL,
    pair_headers,
)
from ..protocols.remotecommand import HEADER_PROTOCOL_VERSION
from ..sdk.capabilities import ByteStream
from ..sdk.spdy import ByteTransport, SocketTransport, SpdySession, SpdyStream
from ._connect import Endpoint, upgrade
from ._errors import PortForwardError, StreamingError, UpgradeFailed
from ._exec import Transport
from ._spdy import TunnelTransport, client_session, open_stream, socket_transport, wait_replied
from ._websocket import open_websocket

log = logging.getLogger(__name__)

MAX_ERROR_MESSAGE = 64 * 1024


class ForwardedConnection:
    """One TCP connection to a port in the pod. Implements the capabilities' `ByteStream`:
    `read` (b"" once the pod's side has finished), `write`, and `close` to half-close."""

    def __init__(self, port: int, data: SpdyStream, error: SpdyStream) -> None:
        self.port = port
        self._data = data
        self._error = error

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self._data.read(max_bytes)

    async def write(self, data: bytes) -> None:
        await self._data.write(data)

    async def close(self) -> None:
        await self._data.close()

    async def error(self) -> str:
        """What the far side reported on the pair's error stream, once it has closed it
        (which it does when it is done with the connection); "" means no error."""
        message = await self._error.inbox.read_all(MAX_ERROR_MESSAGE)
        return message.decode("utf-8", errors="replace").strip()

    def abort(self) -> None:
        """Reset both streams: the far side drops the connection to the pod."""
        self._data.reset()
        self._error.reset()


class PortForwardSession:
    """An upgraded connection to one pod's port-forward endpoint, carrying any number of
    forwarded connections. Use as an async context manager, or call `aclose`."""

    def __init__(self, client: SpdySession, *, stream_timeout: float = 30.0) -> None:
        self._client = client
        self._stream_timeout = stream_timeout
        self._next_request_id = 0

    @classmethod
    async def connect(
        cls,
        endpoint: Endpoint,
        namespace: str,
        pod: str,
        *,
        transport: Transport = "auto",
        stream_timeout: float = 30.0,
        ping_interval: float | None = 5.0,
    ) -> PortForwardSession:
        """Raises `UpgradeFailed` (e.g. 404 for an unknown pod) or `StreamingError`."""
        client = client_session(
            await _transport(endpoint, namespace, pod, transport), ping_interval=ping_interval
        )
        return cls(client, stream_timeout=stream_timeout)

    @property
    def closed(self) -> bool:
        return self._client.closed.is_set()

    async def open(self, port: int) -> ForwardedConnection:
        """A new connection to `port` in the pod. The far side dials once both streams are
        there; a failure to dial shows up in `ForwardedConnection.error`."""
        request_id = self._next_request_id
        self._next_request_id += 1
        error_headers, data_headers = pair_headers(port, request_id)
        error = open_stream(self._client, error_headers)
        data = open_stream(self._client, data_headers)
        try:
            await wait_replied(self._client, (error, data), self._stream_timeout)
            await error.close()  # we never write on it
        except BaseException:
            data.reset()
            error.reset()
            raise
        return ForwardedConnection(port, data, error)

    async def forward(self, port: int, stream: ByteStream) -> None:
        """Copy both ways between `stream` and a new connection to `port`, as kubectl does for
        each local connection: our side's end is passed on as a half-close, and the call
        returns once the pod's side has ended. Raises `PortForwardError` with the far side's
        message if it could not forward (nothing listening on the port, say)."""
        conn = await self.open(port)
        down = asyncio.create_task(_copy_and_close(conn, stream), name="port-forward down")
        up = asyncio.create_task(_copy_and_close(stream, conn), name="port-forward up")
        try:
            # Done when the pod's side has ended (our side may still be open: a server that
            # answers and hangs up), or early if our side broke.
            while not down.done() and not (up.done() and up.exception() is not None):
                await asyncio.wait(
                    {down} if up.done() else {down, up}, return_when="FIRST_COMPLETED"
                )
            if not down.done():
                # Our side failed while the pod's side goes on: drop the connection.
                conn.abort()
            try:
                async with asyncio.timeout(self._stream_timeout):
                    message = await conn.error()
            except TimeoutError:
                message = ""
            if message:
                raise PortForwardError(message)
            for task in (down, up):
                if task.done() and (exc := task.exception()) is not None:
                    raise exc
        finally:
            for task in (down, up):
                task.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            conn.abort()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> PortForwardSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def port_forward(
    endpoint: Endpoint,
    namespace: str,
    pod: str,
    port: int,
    stream: ByteStream,
    *,
    transport: Transport = "auto",
) -> None:
    """One forwarded connection on a connection of its own: what a relay's
    `PortForwarder.port_forward` needs. Errors as for `PortForwardSession.forward`."""
    async with await PortForwardSession.connect(
        endpoint, namespace, pod, transport=transport
    ) as session:
        await session.forward(port, stream)


async def _transport(
    endpoint: Endpoint, namespace: str, pod: str, transport: Transport
) -> ByteTransport:
    if endpoint.kubelet:
        target = endpoint.target(["portForward", namespace, pod])
        if transport == "websocket":
            raise ValueError("a kubelet has no WebSocket tunnel for port-forward; use SPDY")
        return await _direct(endpoint, target)
    target = endpoint.target(["api", "v1", "namespaces", namespace, "pods", pod, "portforward"])
    if transport != "spdy":
        try:
            ws, _ = await open_websocket(endpoint, target, [WEBSOCKET_SPDY_TUNNEL_PROTOCOL])
        except UpgradeFailed as exc:
            if transport == "websocket":
                raise
            log.debug("port-forward tunnel refused (%s); falling back to SPDY", exc)
        else:
            return TunnelTransport(ws)
    return await _direct(endpoint, target)


async def _direct(endpoint: Endpoint, target: str) -> SocketTransport:
    headers = [
        ("Connection", "Upgrade"),
        ("Upgrade", "SPDY/3.1"),
        (HEADER_PROTOCOL_VERSION, PORT_FORWARD_PROTOCOL),
    ]
    upgraded = await upgrade(endpoint, "POST", target, headers)
    chosen = upgraded.headers.get(HEADER_PROTOCOL_VERSION.lower(), "")
    if chosen != PORT_FORWARD_PROTOCOL:
        await upgraded.aclose()
        raise StreamingError(f"the server chose protocol {chosen!r}, not {PORT_FORWARD_PROTOCOL}")
    return socket_transport(upgraded)


async def _copy_and_close(source: ByteStream, target: ByteStream) -> None:
    while data := await source.read():
        await target.write(data)
    await target.close()
