"""HTTP/1.1 over asyncio streams with h11: requests in, responses (or a protocol switch) out.

h11 rather than an HTTP framework because the kubelet port must hand the raw socket to SPDY after
`101 Switching Protocols`, and h11 gives us exactly that point plus the bytes it had already
read (`trailing_data`). Frameworks only model WebSocket upgrades.

One connection serves requests one after another (keep-alive). While an ordinary handler runs,
the socket is still read so that a client hanging up is noticed at once: a `logs -f` whose
reader has gone must stop following instead of waiting for the next log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024


class HttpError(Exception):
    """Answer the request with `status` and `message` (as text/plain)."""

    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 1 << 20
    # A request head must arrive within this (slow-loris) and so must the next one on a
    # kept-alive connection.
    header_timeout: float = 30.0


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, list[str]]  # lower-case names
    peercert: dict[str, Any] | None = None
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None

    def header_values(self, name: str) -> list[str]:
        return self.headers.get(name.lower(), [])

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    def header_has_token(self, name: str, token: str) -> bool:
        """Whether a comma-separated header (Connection, Upgrade) lists `token`."""
        token = token.lower()
        return any(
            part.strip().lower() == token
            for value in self.header_values(name)
            for part in value.split(",")
        )


@dataclass
class Exchange:
    """One request and the means to answer it. A handler answers exactly once: `respond`,
    `start` + `write`* + `finish`, or `switch_protocols` and then the raw socket."""

    request: Request
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    _conn: h11.Connection
    status: int = 0
    started: bool = False
    finished: bool = False
    upgraded: bool = False

    async def respond(
        self,
        status: int,
        body: bytes | str = b"",
        content_type: str = "text/plain; charset=utf-8",
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        all_headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            *headers,
        ]
        await self.start(status, all_headers)
        if data:
            await self.write(data)
        await self.finish()

    async def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        response = h11.Response(
            status_code=status,
            headers=list(headers),
            reason=_REASONS.get(status, b""),
        )
        self._send(response)
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        """Send and flush one piece of the body (one chunk when chunked)."""
        if data:
            self._send(h11.Data(data=data))
            await self.writer.drain()

    async def finish(self) -> None:
        self._send(h11.EndOfMessage())
        self.finished = True
        await self.writer.drain()

    async def switch_protocols(self, headers: Iterable[tuple[str, str]]) -> bytes:
        """Answer 101 and give up HTTP on this connection. Returns the bytes the client sent
        after the request that h11 had already read: the start of the new protocol."""
        self.started = self.finished = self.upgraded = True
        self.status = 101
        self._send(h11.InformationalResponse(status_code=101, headers=list(headers)))
        await self.writer.drain()
        data, _closed = self._conn.trailing_data
        return bytes(data)

    def _send(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            self.writer.write(data)


Handler = Callable[[Exchange], Awaitable[None]]


async def serve_connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Handler,
    limits: HttpLimits,
) -> None:
    """Serve requests until the client closes, a handler takes the socket, or an error."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
    peercert = writer.get_extra_info("peercert") or None
    try:
        while True:
            try:
                async with asyncio.timeout(limits.header_timeout):
                    request = await _read_request(conn, reader, limits, peercert)
            except TimeoutError:
                return
            except h11.RemoteProtocolError as exc:
                await _refuse(conn, writer, exc.error_status_hint, str(exc))
                return
            except HttpError as exc:
                await _refuse(conn, writer, exc.status, exc.message)
                return
            if request is None:
                return
            exchange = Exchange(request, reader, writer, conn)
            if _wants_upgrade(request):
                await handler(exchange)
            else:
                await _run_watching_for_hangup(handler(exchange), reader, conn)
            if exchange.upgraded:
                return  # the handler owned the socket and has closed it
            if not exchange.finished or conn.our_state is not h11.DONE:
                return  # the answer was cut short: the connection cannot be reused
            if conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (OSError, h11.LocalProtocolError) as exc:
        log.debug("connection ended: %r", exc)
    finally:
        if not writer.is_closing():
            writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _read_request(
    conn: h11.Connection,
    reader: asyncio.StreamReader,
    limits: HttpLimits,
    peercert: dict[str, Any] | None,
) -> Request | None:
    request: Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(READ_SIZE)
            conn.receive_data(data)
            if not data and conn.their_state is h11.IDLE:
                return None  # closed between requests: the usual end of a keep-alive
            continue
        match event:
            case h11.Request():
                # h11 bounds a head that arrives in pieces; one that came in a single read
                # is measured here.
                size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
                if size > limits.max_header_bytes:
                    raise HttpError(431, "request header fields too large")
                request = _to_request(event, peercert)
            case h11.Data():
                body += event.data
                if len(body) > limits.max_body_bytes:
                    raise HttpError(413, "request body too large")
            case h11.EndOfMessage():
                assert request is not None
                request.body = bytes(body)
                return request
            case h11.ConnectionClosed():
                return None
            case _:
                return None  # PAUSED cannot happen before EndOfMessage


def _to_request(event: h11.Request, peercert: dict[str, Any] | None) -> Request:
    target = event.target.decode("latin-1")
    parts = urlsplit(target)
    headers: dict[str, list[str]] = {}
    for name, value in event.headers:
        headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    return Request(
        method=event.method.decode("ascii").upper(),
        target=target,
        path=parts.path or "/",
        query=parse_qs(parts.query, keep_blank_values=True),
        headers=headers,
        peercert=peercert,
    )


def _wants_upgrade(request: Request) -> bool:
    return request.header_has_token("connection", "upgrade") and bool(request.header("upgrade"))


async def _run_watching_for_hangup(
    work: Awaitable[None], reader: asyncio.StreamReader, conn: h11.Connection
) -> None:
    """Run `work`, cancelling it if the client closes the connection meanwhile.

    Bytes that arrive meanwhile (a pipelined next request) go to h11's buffer; a client that
    sends more than a request head's worth while we answer is treated as gone.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_hangup(reader, conn))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Both must be over before the caller reads the socket again.
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending


async def _wait_for_hangup(reader: asyncio.StreamReader, conn: h11.Connection) -> None:
    received = 0
    while True:
        data = await reader.read(READ_SIZE)
        if not data:
            return
        received += len(data)
        if received > 64 * 1024:
            return
        conn.receive_data(data)


async def _refuse(
    conn: h11.Connection, writer: asyncio.StreamWriter, status: int, text: str
) -> None:
    """Answer a request we could not even parse, if the protocol state still allows it."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = (text + "\n").encode()
    with contextlib.suppress(h11.LocalProtocolError, OSError):
        writer.write(
            conn.send(
                h11.Response(
                    status_code=status,
                    headers=[
                        ("Content-Type", "text/plain; charset=utf-8"),
                        ("Content-Length", str(len(body))),
                        ("Connection", "close"),
                    ],
                    reason=_REASONS.get(status, b""),
                )
            )
        )
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    421: b"Misdirected Request",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
}
