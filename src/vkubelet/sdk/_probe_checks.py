"""The four probe handlers (exec, httpGet, tcpSocket, grpc), each run once, with the kubelet's
outcomes and messages (pkg/probe): success, failure, or a warning that counts as success.

They reach the container only through a `ProbeTransport`, so one implementation serves a
process on an SSH device, a VM's guest agent or an in-memory fake. HTTP runs on h11 and gRPC's
health check on h2 (both sans-I/O, the h2 library being a small pure-Python dependency where
grpcio would bring a native runtime for one RPC); HTTPS wraps the transport's byte stream in an
`ssl.SSLObject`, so TLS needs nothing of the transport either.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar
from urllib.parse import SplitResult, urljoin, urlsplit

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h11

__all__ = [
    "ExecResult",
    "Outcome",
    "ProbeReader",
    "ProbeTransport",
    "ProbeUnknown",
    "ProbeWriter",
    "Result",
    "grpc_check",
    "http_get",
    "tcp_check",
]

USER_AGENT = "kube-probe/1.37"  # the kubelet's, by the API version vkubelet serves
MAX_OUTPUT = 10 * 1024  # the kubelet keeps this much of a command's output or a response body
MAX_REDIRECTS = 10

_T = TypeVar("_T")


class ProbeUnknown(Exception):
    """The transport cannot tell (the backend is unreachable): the result counts neither way, as
    a container must not be restarted because the link to its machine failed."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    output: bytes  # stdout and stderr together


class ProbeReader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class ProbeWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class ProbeTransport(Protocol):
    """How the engine reaches a container; a provider implements it.

    `exec` runs `command` in the container's environment and must make sure it does not outlive
    `limit` seconds (kill it there: the engine only stops waiting). `open_connection` connects
    from the pod's network, as the kubelet connects to the pod IP. Either may raise
    `ProbeUnknown`, and `available()` False says that a failure seen just now may be the
    backend's, not the container's (then it counts neither way either).
    """

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult: ...

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]: ...

    def available(self) -> bool: ...


class Outcome(Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    WARNING = "warning"  # a success the kubelet reports with a ProbeWarning event


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    output: str = ""


# -- tcpSocket -------------------------------------------------------------------------------------
async def tcp_check(transport: ProbeTransport, host: str, port: int) -> Result:
    try:
        _, writer = await transport.open_connection(host, port)
    except OSError as e:
        return Result(Outcome.FAILURE, f"dial tcp {_authority(host, port)}: {_error(e)}")
    writer.close()
    return Result(Outcome.SUCCESS)


# -- a byte stream, in clear or in TLS -------------------------------------------------------------
@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One client context for every HTTPS probe, without the system's trust store: nothing is
    verified, and loading the store (`ssl.create_default_context`) costs tens of milliseconds
    of CPU that blocked the event loop inside each probe's timeout (a 1 s timeout under load)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class _Stream:
    def __init__(self, reader: ProbeReader, writer: ProbeWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self) -> bytes:
        return await self.reader.read(65536)

    def close(self) -> None:
        self.writer.close()


class _TlsStream(_Stream):
    """TLS over the transport's stream. Like the kubelet, no certificate is checked: a probe asks
    whether the server answers, not who it is."""

    def __init__(self, reader: ProbeReader, writer: ProbeWriter, host: str) -> None:
        super().__init__(reader, writer)
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        name = None if _is_ip(host) else host
        self._tls = _tls_context().wrap_bio(self._in, self._out, server_hostname=name)

    async def handshake(self) -> None:
        await self._until_done(self._tls.do_handshake)

    async def send(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()

    async def recv(self) -> bytes:
        try:
            return await self._until_done(lambda: self._tls.read(65536))
        except ssl.SSLZeroReturnError:
            return b""

    async def _until_done(self, step: Callable[[], _T]) -> _T:
        while True:
            try:
                result = step()
            except ssl.SSLWantReadError:
                self._flush()
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionResetError("connection closed during TLS") from None
                self._in.write(data)
                continue
            self._flush()
            return result

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.writer.write(data)


async def _open(transport: ProbeTransport, scheme: str, host: str, port: int) -> _Stream:
    reader, writer = await transport.open_connection(host, port)
    if scheme != "https":
        return _Stream(reader, writer)
    stream = _TlsStream(reader, writer, host)
    try:
        await stream.handshake()
    except BaseException:
        writer.close()
        raise
    return stream


# -- httpGet ---------------------------------------------------------------------------------------
async def http_get(
    transport: ProbeTransport,
    scheme: str,
    host: str,
    port: int,
    path: str,
    headers: Sequence[tuple[str, str]],
) -> Result:
    """GET the URL as the kubelet does: its default headers (a given one replaces a default),
    redirects followed only to the same host name (at most 10), 200-399 a success, and a
    redirect elsewhere not followed but reported as a warning."""
    scheme = scheme.lower()
    if scheme not in ("http", "https"):
        return Result(Outcome.FAILURE, f"unsupported scheme {scheme!r}")
    if not path.startswith("/"):
        path = f"/{path}"
    url = f"{scheme}://{_authority(host, port)}{path}"
    origin = host
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        target = parts.path or "/"
        if parts.query:
            target = f"{target}?{parts.query}"
        try:
            status, body, location = await _request(
                transport, parts.scheme, parts.hostname or host, _port(parts), target, headers
            )
        except (OSError, ValueError, h11.ProtocolError, ssl.SSLError) as e:
            return Result(Outcome.FAILURE, f'Get "{url}": {_error(e)}')
        if status in (301, 302, 303, 307, 308) and location is not None:
            next_url = urljoin(url, location)
            if urlsplit(next_url).hostname == origin:
                url = next_url
                continue
        if 200 <= status < 300:
            return Result(Outcome.SUCCESS, body)
        if 300 <= status < 400:
            return Result(Outcome.WARNING, f"Probe terminated redirects, Response body: {body}")
        return Result(Outcome.FAILURE, f"HTTP probe failed with statuscode: {status}")
    return Result(Outcome.FAILURE, f'Get "{url}": stopped after {MAX_REDIRECTS} redirects')


async def _request(
    transport: ProbeTransport,
    scheme: str,
    host: str,
    port: int,
    target: str,
    given: Sequence[tuple[str, str]],
) -> tuple[int, str, str | None]:
    """One GET: (status, the body's first 10 KiB, Location)."""
    names = {name.lower() for name, _ in given}
    defaults = [("Host", _authority(host, port)), ("User-Agent", USER_AGENT), ("Accept", "*/*")]
    headers = [(n, v) for n, v in given if n.lower() != "connection"]
    headers = [(n, v) for n, v in defaults if n.lower() not in names] + headers
    headers.append(("Connection", "close"))
    http = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
    request = h11.Request(method="GET", target=target, headers=headers)
    stream = await _open(transport, scheme, host, port)
    try:
        await stream.send(http.send(request) + http.send(h11.EndOfMessage()))
        status = 0
        location: str | None = None
        body = bytearray()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await stream.recv())
            elif isinstance(event, h11.Response):
                status = event.status_code
                for name, value in event.headers:
                    if name == b"location":
                        location = value.decode("latin-1")
            elif isinstance(event, h11.Data):
                body += event.data[: MAX_OUTPUT - len(body)]
                if len(body) >= MAX_OUTPUT:
                    break
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
            elif not isinstance(event, h11.InformationalResponse):
                raise h11.LocalProtocolError(f"unexpected {event!r}")
        if status == 0:
            raise ConnectionResetError("EOF")
        return status, body.decode(errors="replace"), location
    finally:
        stream.close()


# -- grpc ------------------------------------------------------------------------------------------
_GRPC_PATH = "/grpc.health.v1.Health/Check"
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_GRPC_CODES = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
]


async def grpc_check(transport: ProbeTransport, host: str, port: int, service: str) -> Result:
    """grpc.health.v1.Health/Check over HTTP/2 in clear text, as the kubelet calls it."""
    address = _authority(host, port)
    try:
        stream = await _open(transport, "http", host, port)
    except OSError as e:
        return Result(Outcome.FAILURE, f'error: failed to connect service at "{address}": {e}')
    try:
        return await _grpc_call(stream, address, service)
    except (OSError, h2.exceptions.ProtocolError) as e:
        return Result(Outcome.FAILURE, f"error: health rpc probe failed: {_error(e)}")
    finally:
        stream.close()


async def _grpc_call(stream: _Stream, address: str, service: str) -> Result:
    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", _GRPC_PATH),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("user-agent", USER_AGENT),
        ],
    )
    message = _proto_string(1, service) if service else b""
    conn.send_data(sid, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
    await stream.send(conn.data_to_send())
    metadata: dict[str, str] = {}
    data = bytearray()
    done = False
    while not done:
        chunk = await stream.recv()
        if not chunk:
            raise ConnectionResetError("connection closed before the answer")
        for event in conn.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                metadata.update({str(k): str(v) for k, v in event.headers or []})
            elif isinstance(event, h2.events.DataReceived):
                data += event.data or b""
                conn.acknowledge_received_data(event.flow_controlled_length or 0, sid)
            elif isinstance(event, h2.events.StreamEnded):
                done = True
            elif isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                raise ConnectionResetError(f"the server ended the call ({type(event).__name__})")
        await stream.send(conn.data_to_send())
    code = int(metadata.get("grpc-status", "2"))
    if code == 12:
        return Result(
            Outcome.FAILURE,
            "error: this server does not implement the grpc health protocol "
            f"(grpc.health.v1.Health): {metadata.get('grpc-message', '')}",
        )
    if code != 0:
        name = _GRPC_CODES[code] if 0 <= code < len(_GRPC_CODES) else f"Code({code})"
        desc = metadata.get("grpc-message", "")
        return Result(
            Outcome.FAILURE,
            f"error: health rpc probe failed: rpc error: code = {name} desc = {desc}",
        )
    status = _proto_varint_field(bytes(data[5:]), 1) if len(data) >= 5 else 0
    if status != 1:
        name = _SERVING_STATUS.get(status, str(status))
        return Result(Outcome.FAILURE, f'service unhealthy (responded with "{name}")')
    return Result(Outcome.SUCCESS, "service healthy")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _proto_string(field: int, text: str) -> bytes:
    raw = text.encode()
    return _varint(field << 3 | 2) + _varint(len(raw)) + raw


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _proto_varint_field(data: bytes, wanted: int) -> int:
    """The value of varint field `wanted` of a protobuf message (0, its default, if absent);
    other fields are skipped."""
    at, value = 0, 0
    try:
        while at < len(data):
            key, at = _read_varint(data, at)
            field, kind = key >> 3, key & 7
            if kind == 0:
                number, at = _read_varint(data, at)
                if field == wanted:
                    value = number
            elif kind == 2:
                length, at = _read_varint(data, at)
                at += length
            elif kind == 1:
                at += 8
            elif kind == 5:
                at += 4
            else:
                break
    except IndexError:
        pass
    return value


# -- helpers ---------------------------------------------------------------------------------------
def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port(parts: SplitResult) -> int:
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80


def _error(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connect: connection refused"
    return str(e) or type(e).__name__
