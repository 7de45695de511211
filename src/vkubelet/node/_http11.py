"""A lean HTTP/1.1 client for `KubeClient`: asyncio streams, h11, keep-alive pools.

Why not httpx2: each request through httpx2/httpcore2/anyio costs ~1.5 ms of CPU (auth flow
generators, URL and header models, anyio's stream wrappers, a pool scan probing idle sockets),
about 45 % of the agent's CPU in a pod burst. The apiserver needs none of it: one host, TLS set
up once from the kubeconfig, JSON bodies, HTTP/1.1 keep-alive. Here a request is h11's state
machine over an asyncio stream taken from a pool of idle connections (docs/benchmarks.md,
"The lean HTTP path", has the measurements, h11 against aiohttp's C parser among them).

Re-sending rule. A pooled connection the server closed while it sat idle is usually seen closed
(EOF already read) when taken from the pool, and is dropped before anything is written. If the
close races our write, it shows as EOF or a reset before any byte of the answer; then the
request is sent once more on a fresh connection only if the connection was a *reused* one and
the method is idempotent (GET, HEAD, PUT, DELETE, OPTIONS: RFC 9110; a PUT carries a
resourceVersion, so a replay cannot overwrite a newer object, and a replayed DELETE at worst
answers 404) -- Go's net/http rule. POST and PATCH are never re-sent once written: the server
may have acted on them before the connection broke, so the caller gets `TransportFailure` (its
Unreachable) as for any lost answer. Idle connections are dropped after 30 s, well before the
apiserver's own idle timeout (90 s), so that race is rare. A failure on a fresh connection is
never retried here: the caller's back-off decides.

Credentials: a bearer token (static, or a token file re-read on a 401 with the request sent once
more, as lightkube and client-go do for rotated service-account tokens), basic auth, and client
certificates in the TLS context. Exec plugins and auth providers are not handled here:
`supports` says so and KubeClient keeps httpx for those configs.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import h11
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.config.models import User
from lightkube.core.exceptions import ConfigError

_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_READ_SIZE = 256 * 1024
_USER_AGENT = b"vkubelet"


class TransportFailure(Exception):
    """The server could not be reached or the connection broke (KubeClient: Unreachable)."""


class _Stale(Exception):
    """The connection failed before any byte of the answer: maybe closed by the server while
    it sat idle in our pool."""


def supports(config: SingleConfig) -> bool:
    """Whether this client can speak for `config`'s user (else KubeClient keeps httpx)."""
    user = config.user
    if user is None or user.token_file is not None or user.token is not None:
        return True
    return user.exec is None and user.auth_provider is None


@dataclass(frozen=True)
class Limits:
    max_connections: int | None  # None: no cap
    max_idle: int  # idle connections kept for reuse (0: close after each answer)
    idle_expiry: float  # seconds an idle connection is kept


class Auth:
    """The Authorization header for a kubeconfig user, re-read from its token file on a 401."""

    def __init__(self, config: SingleConfig) -> None:
        user = config.user
        self._token_file = user.token_file if user else None
        self._header: bytes | None = None
        if user is None or self._token_file is not None:
            pass
        elif user.token is not None:
            self._header = f"Bearer {user.token}".encode()
        elif user.username and user.password:
            basic = base64.b64encode(f"{user.username}:{user.password}".encode()).decode()
            self._header = f"Basic {basic}".encode()

    @property
    def renewable(self) -> bool:
        return self._token_file is not None

    def header(self) -> bytes | None:
        if self._header is None and self._token_file is not None:
            self._reread()
        return self._header

    def renew(self) -> None:
        """After a 401: the kubelet may have rotated the token file since we read it."""
        if self._token_file is not None:
            self._reread()

    def _reread(self) -> None:
        assert self._token_file is not None
        try:
            token = Path(self._token_file).read_text().strip()
        except FileNotFoundError as e:
            raise ConfigError(f"Token file {self._token_file} not found") from e
        self._header = f"Bearer {token}".encode()


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect: from the kubeconfig's cluster (TLS context with its CA and the
    user's client certificate, made once per KubeClient and shared by its pools)."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    prefix: str  # the server URL's path, if any (e.g. a proxy that serves several clusters)
    host_header: bytes

    @classmethod
    def from_config(cls, config: SingleConfig) -> Endpoint:
        url = urlsplit(str(config.cluster.server))
        secure = url.scheme == "https"
        host = url.hostname or "localhost"
        port = url.port or (443 if secure else 80)
        tls = None
        if secure:
            user = config.user or User()
            tls = verify_cluster(config.cluster, user, config.abs_file, trust_env=False)
            tls.set_alpn_protocols(["http/1.1"])
        return cls(host, port, tls, url.path.rstrip("/"), url.netloc.rpartition("@")[2].encode())

    def target(self, path: str, params: Mapping[str, str] | None) -> bytes:
        query = f"?{urlencode(params)}" if params else ""
        return f"{self.prefix}{path}{query}".encode()


class _Connection:
    __slots__ = ("http", "idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def closed(self) -> bool:
        return (
            self.writer.transport.is_closing()
            or self.reader.at_eof()
            or self.reader.exception() is not None
        )

    def close(self) -> None:
        self.writer.close()


@dataclass
class StreamedAnswer:
    status: int
    chunks: AsyncIterator[bytes]


class Pool:
    """One pool of keep-alive connections to the apiserver, with the shared credentials."""

    def __init__(self, endpoint: Endpoint, auth: Auth, limits: Limits, timeout: float) -> None:
        self._endpoint = endpoint
        self._auth = auth
        self._limits = limits
        self._timeout = timeout
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()  # checked out: closed too when the pool closes
        self._slots = asyncio.Semaphore(limits.max_connections) if limits.max_connections else None
        self._closed = False

    async def aclose(self) -> None:
        """Close every connection, busy ones too: open watches end (their owners resume on
        the client's new pools after a `reload`), nothing is left behind at shutdown."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
        for conn in list(self._busy):
            self._drop(conn)

    async def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: bytes | None,
        content_type: str | None,
        before_write: Callable[[], None],
    ) -> tuple[int, bytes]:
        """Send one request and read the whole answer: (status, body). `before_write` runs
        right before each attempt's bytes are written, after any wait for a slot or a
        connection (the fence: a write allowed when queued may not be when it leaves)."""
        target = self._endpoint.target(path, params)
        if self._slots is None:
            return await self._request(method, target, body, content_type, before_write)
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except TimeoutError as e:
            raise TransportFailure("timed out waiting for a pooled connection") from e
        try:
            return await self._request(method, target, body, content_type, before_write)
        finally:
            self._slots.release()

    async def _request(
        self,
        method: str,
        target: bytes,
        body: bytes | None,
        content_type: str | None,
        before_write: Callable[[], None],
    ) -> tuple[int, bytes]:
        status, answer = await self._exchange(method, target, body, content_type, before_write)
        if status == 401 and self._auth.renewable:
            self._auth.renew()
            status, answer = await self._exchange(method, target, body, content_type, before_write)
        return status, answer

    async def _exchange(
        self,
        method: str,
        target: bytes,
        body: bytes | None,
        content_type: str | None,
        before_write: Callable[[], None],
    ) -> tuple[int, bytes]:
        head = self._head(method, target, body, content_type, gzip=True)
        for attempt in (1, 2):
            conn, reused = await self._checkout()
            try:
                status, headers = await self._send(conn, head, body, self._timeout, before_write)
                parts = [part async for part in self._body(conn, self._timeout)]
            except _Stale as e:
                self._drop(conn)
                if attempt == 1 and reused and method in _IDEMPOTENT:
                    continue
                raise TransportFailure(f"connection lost: {e}") from None
            except BaseException:
                self._drop(conn)
                raise
            self._checkin(conn)
            answer = parts[0] if len(parts) == 1 else b"".join(parts)
            if answer and _gzipped(headers):
                try:
                    answer = zlib.decompress(answer, wbits=31)
                except zlib.error as e:
                    raise TransportFailure(f"bad gzip answer from the apiserver: {e}") from None
            return status, answer
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def stream(
        self, path: str, params: Mapping[str, str] | None, read_timeout: float | None
    ) -> AsyncIterator[StreamedAnswer]:
        """GET `target` and hand over the body as it arrives (watches, followed logs), each
        read waiting at most `read_timeout`. No re-send: these pools keep no idle connections,
        so each stream has a fresh one."""
        target = self._endpoint.target(path, params)
        conn, _ = await self._checkout()
        try:
            try:
                head = self._head("GET", target, None, None, gzip=False)
                status, _headers = await self._send(conn, head, None, self._timeout, _nothing)
                if status == 401 and self._auth.renewable:
                    async for _ in self._body(conn, self._timeout):  # the short error body
                        pass
                    self._drop(conn)
                    self._auth.renew()
                    conn, _ = await self._checkout()
                    head = self._head("GET", target, None, None, gzip=False)
                    status, _headers = await self._send(conn, head, None, self._timeout, _nothing)
            except _Stale as e:
                raise TransportFailure(f"connection lost: {e}") from None
            yield StreamedAnswer(status, self._body(conn, read_timeout))
        finally:
            self._drop(conn)

    def _head(
        self, method: str, target: bytes, body: bytes | None, content_type: str | None, gzip: bool
    ) -> h11.Request:
        headers = [(b"Host", self._endpoint.host_header), (b"User-Agent", _USER_AGENT)]
        if gzip:
            headers.append((b"Accept-Encoding", b"gzip"))
        if (auth := self._auth.header()) is not None:
            headers.append((b"Authorization", auth))
        if body is not None:
            headers.append((b"Content-Type", (content_type or "application/json").encode()))
            headers.append((b"Content-Length", str(len(body)).encode()))
        return h11.Request(method=method, target=target, headers=headers)

    async def _send(
        self,
        conn: _Connection,
        head: h11.Request,
        body: bytes | None,
        read_timeout: float,
        before_write: Callable[[], None],
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Write the request and read up to the answer's head: (status, headers)."""
        http = conn.http
        try:
            data = http.send(head) or b""
            if body:
                data += http.send(h11.Data(data=body)) or b""
            data += http.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as e:
            raise TransportFailure(f"cannot send the request: {e}") from None
        before_write()  # no await between this and the write
        try:
            conn.writer.write(data)
            if conn.writer.transport.get_write_buffer_size() > _READ_SIZE:
                async with asyncio.timeout(read_timeout):
                    await conn.writer.drain()
        except TimeoutError:
            raise TransportFailure("timed out writing the request") from None
        except (ConnectionError, OSError) as e:
            raise _Stale(repr(e)) from None
        while True:
            event = await self._next_event(conn, read_timeout, first=True)
            if isinstance(event, h11.Response):
                return event.status_code, list(event.headers)
            # an InformationalResponse (100 Continue): keep reading

    async def _body(self, conn: _Connection, read_timeout: float | None) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (h11 undoes chunked and Content-Length framing)."""
        while True:
            event = await self._next_event(conn, read_timeout, first=False)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise TransportFailure("connection closed before the end of the answer")

    async def _next_event(
        self, conn: _Connection, read_timeout: float | None, *, first: bool
    ) -> object:
        """h11's next event, reading from the socket as it needs; `first`: nothing of the
        answer has arrived yet, so a failure is `_Stale` (see the re-sending rule)."""
        http = conn.http
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as e:
                raise TransportFailure(f"bad answer from the apiserver: {e}") from None
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(read_timeout):
                    data = await conn.reader.read(_READ_SIZE)
            except TimeoutError:
                raise TransportFailure("timed out reading the answer") from None
            except (ConnectionError, OSError) as e:
                if first and http.their_state is h11.SEND_RESPONSE:
                    raise _Stale(repr(e)) from None
                raise TransportFailure(f"connection lost: {e!r}") from None
            if not data and first and http.their_state is h11.SEND_RESPONSE:
                raise _Stale("closed by the server")
            http.receive_data(data)

    async def _checkout(self) -> tuple[_Connection, bool]:
        if self._closed:
            raise TransportFailure("the client is closed")
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed() or now - conn.idle_since > self._limits.idle_expiry:
                conn.close()
                continue
            self._busy.add(conn)
            return conn, True
        conn = await self._connect()
        if self._closed:  # closed while connecting
            conn.close()
            raise TransportFailure("the client is closed")
        self._busy.add(conn)
        return conn, False

    def _drop(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.close()

    async def _connect(self) -> _Connection:
        endpoint = self._endpoint
        try:
            async with asyncio.timeout(self._timeout):
                reader, writer = await asyncio.open_connection(
                    endpoint.host,
                    endpoint.port,
                    ssl=endpoint.tls,
                    server_hostname=endpoint.host if endpoint.tls else None,
                    limit=_READ_SIZE,
                )
        except TimeoutError:
            raise TransportFailure(
                f"connect to {endpoint.host}:{endpoint.port} timed out"
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise TransportFailure(f"connect to {endpoint.host}:{endpoint.port}: {e!r}") from None
        return _Connection(reader, writer)

    def _checkin(self, conn: _Connection) -> None:
        http = conn.http
        if (
            self._closed
            or http.our_state is not h11.DONE
            or http.their_state is not h11.DONE
            or http.trailing_data[0]  # bytes beyond the answer: not a connection to trust
            or len(self._idle) >= self._limits.max_idle
        ):
            self._drop(conn)
            return
        self._busy.discard(conn)
        http.start_next_cycle()
        conn.idle_since = time.monotonic()
        self._idle.append(conn)


def _gzipped(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"content-encoding" and value.lower() == b"gzip" for name, value in headers)


def _nothing() -> None:
    """No check before a GET's bytes leave (reads are never fenced)."""
