"""Where to stream to, and the HTTP/1.1 upgrade that turns a TLS connection into a stream.

An `Endpoint` is an apiserver (or a kubelet's port) plus credentials. lightkube parses the
kubeconfig and builds the TLS context (CA, client certificate) and the httpx `Auth` (token,
token file, exec plugin); we run that auth flow by hand for the one request that matters, since
an upgraded connection is not something httpx can hand over. h11 writes the request and reads
the answer: a 101 gives back the socket and any bytes already read past the head, anything else
becomes an `UpgradeFailed` carrying the server's Status message.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

import h11
import httpx2 as httpx
import msgspec
from lightkube.config.kubeconfig import SingleConfig

from .._kubeconfig import http11_tls, httpx_auth, load_context
from ._errors import StreamingError, UpgradeFailed

READ_SIZE = 64 * 1024
MAX_ERROR_BODY = 64 * 1024
USER_AGENT = "vkubelet-streaming"

Query = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Endpoint:
    """An apiserver, or with ``kubelet=True`` a kubelet's API port, and how to log in to it.

    ``server`` is the base URL (a path prefix, as behind some proxies, is kept). ``auth`` adds
    the Authorization header; client certificates live in ``ssl_context``.
    """

    server: str
    ssl_context: ssl.SSLContext | None = None
    auth: httpx.Auth | None = None
    kubelet: bool = False
    connect_timeout: float = 30.0
    _url: tuple[str, str, int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.server)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"server must be an http(s) URL, not {self.server!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if parts.scheme == "https" and self.ssl_context is None:
            object.__setattr__(self, "ssl_context", _http11(ssl.create_default_context()))
        object.__setattr__(
            self, "_url", (parts.scheme, parts.hostname, port, parts.path.rstrip("/"))
        )

    @classmethod
    def from_kubeconfig(
        cls, path: Path | str | None = None, *, context: str | None = None
    ) -> Endpoint:
        """`path`'s `context` (default: current), or $KUBECONFIG / ~/.kube/config /
        the in-cluster service account when `path` is None."""
        return cls.from_config(load_context(path, context))

    @classmethod
    def from_config(cls, config: SingleConfig) -> Endpoint:
        """One context of a kubeconfig lightkube has loaded (what `KubeClient.config` holds)."""
        if config.user is None:
            raise ValueError("the kubeconfig context names no user")
        server = str(config.cluster.server)
        context = http11_tls(config) if server.startswith("https:") else None
        return cls(server, context, httpx_auth(config))

    @property
    def host(self) -> str:
        return self._url[1]

    @property
    def port(self) -> int:
        return self._url[2]

    def target(self, path_segments: Sequence[str], query: Query = ()) -> str:
        """The request target for a path made of (quoted) segments under the server's prefix."""
        path = self._url[3] + "".join("/" + quote(s, safe="") for s in path_segments)
        return path + ("?" + urlencode(list(query)) if query else "")


def _http11(context: ssl.SSLContext) -> ssl.SSLContext:
    # An upgrade exists only in HTTP/1.1: never let ALPN pick h2.
    context.set_alpn_protocols(["http/1.1"])
    return context


@dataclass
class Upgraded:
    """A connection after `101 Switching Protocols`: the socket, the bytes h11 had already read
    past the response head (they belong to the new protocol), and the response headers."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    trailing: bytes
    headers: dict[str, str]

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()


@dataclass
class _Refused:
    status: int
    body: bytes


async def upgrade(
    endpoint: Endpoint, method: str, target: str, headers: Sequence[tuple[str, str]]
) -> Upgraded:
    """Send one upgrade request and return the switched connection, or raise `UpgradeFailed`
    with the server's message. A 401 is retried once with refreshed credentials when the auth
    flow offers them (a rotated token file, an exec plugin's new token)."""
    flow = _auth_flow(endpoint, method, target)
    authorization = await _next_authorization(flow, None)
    try:
        answer = await _attempt(endpoint, method, target, headers, authorization)
        if isinstance(answer, _Refused) and answer.status == 401 and flow is not None:
            retry = await _next_authorization(flow, httpx.Response(401))
            if retry is not None and retry != authorization:
                answer = await _attempt(endpoint, method, target, headers, retry)
    finally:
        if flow is not None:
            await flow.aclose()
    if isinstance(answer, _Refused):
        raise _refusal(answer)
    return answer


def _auth_flow(
    endpoint: Endpoint, method: str, target: str
) -> AsyncGenerator[httpx.Request, httpx.Response] | None:
    if endpoint.auth is None:
        return None
    scheme, host, port, _ = endpoint._url
    request = httpx.Request(method, f"{scheme}://{host}:{port}{target}")
    return endpoint.auth.async_auth_flow(request)


async def _next_authorization(
    flow: AsyncGenerator[httpx.Request, httpx.Response] | None, response: httpx.Response | None
) -> str | None:
    if flow is None:
        return None
    try:
        request = await (flow.__anext__() if response is None else flow.asend(response))
    except StopAsyncIteration:
        return None
    except Exception as exc:  # an exec plugin that fails, a token file that vanished
        raise StreamingError(f"cannot get credentials: {exc}") from exc
    return request.headers.get("Authorization")


async def _attempt(
    endpoint: Endpoint,
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    authorization: str | None,
) -> Upgraded | _Refused:
    port = endpoint.port
    host_header = endpoint.host if port in (80, 443) else f"{endpoint.host}:{port}"
    if ":" in endpoint.host:  # an IPv6 literal
        host_header = f"[{endpoint.host}]" + ("" if port in (80, 443) else f":{port}")
    all_headers = [("Host", host_header), ("User-Agent", USER_AGENT), *headers]
    if authorization:
        all_headers.append(("Authorization", authorization))
    try:
        async with asyncio.timeout(endpoint.connect_timeout):
            reader, writer = await asyncio.open_connection(
                endpoint.host,
                port,
                ssl=endpoint.ssl_context,
                server_hostname=endpoint.host if endpoint.ssl_context else None,
            )
    except (OSError, ssl.SSLError, TimeoutError) as exc:
        raise StreamingError(f"cannot connect to {endpoint.server}: {exc}") from exc
    upgraded = Upgraded(reader, writer, b"", {})
    try:
        async with asyncio.timeout(endpoint.connect_timeout):
            answer = await _exchange(reader, writer, method, target, all_headers)
    except BaseException as exc:
        writer.close()
        if isinstance(exc, TimeoutError):
            raise StreamingError(f"{endpoint.server} did not answer the upgrade") from exc
        if isinstance(exc, OSError | ssl.SSLError | h11.ProtocolError):
            raise StreamingError(f"upgrade to {endpoint.server} failed: {exc}") from exc
        raise
    if isinstance(answer, _Refused):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await upgraded.aclose()
    return answer


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    target: str,
    headers: list[tuple[str, str]],
) -> Upgraded | _Refused:
    conn = h11.Connection(h11.CLIENT)
    writer.write(conn.send(h11.Request(method=method, target=target, headers=headers)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(READ_SIZE)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            conn.receive_data(data)
        elif isinstance(event, h11.InformationalResponse):
            if event.status_code == 101:
                answer = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
                return Upgraded(reader, writer, bytes(conn.trailing_data[0]), answer)
        elif isinstance(event, h11.Response):
            return _Refused(event.status_code, await _body(conn, reader))
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionResetError("the server closed the connection")


async def _body(conn: h11.Connection, reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while len(body) < MAX_ERROR_BODY:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(READ_SIZE)
            conn.receive_data(data)
            if not data:
                break
        elif isinstance(event, h11.Data):
            body += event.data
        else:
            break
    return bytes(body[:MAX_ERROR_BODY])


def _refusal(refused: _Refused) -> UpgradeFailed:
    """The apiserver answers with a metav1.Status; a kubelet with plain text."""
    text = refused.body.decode("utf-8", errors="replace").strip()
    try:
        status = msgspec.json.decode(refused.body)
    except msgspec.DecodeError:
        status = None
    if isinstance(status, Mapping) and status.get("kind") == "Status":
        return UpgradeFailed(
            int(status.get("code") or refused.status),
            str(status.get("reason") or ""),
            str(status.get("message") or ""),
        )
    try:
        reason = HTTPStatus(refused.status).phrase.replace(" ", "")
    except ValueError:
        reason = ""
    return UpgradeFailed(refused.status, reason, text[:2000])
