"""A lean HTTP/1.1 client for `KubeClient`: asyncio protocols, httptools, keep-alive pools.

Why not httpx2: each request through httpx2/httpcore2/anyio costs ~1.5 ms of CPU (auth flow
generators, URL and header models, anyio's stream wrappers, a pool scan probing idle sockets),
about 45 % of the agent's CPU in a pod burst. The apiserver needs none of it: one host, TLS set
up once from the kubeconfig, JSON bodies, HTTP/1.1 keep-alive. Why not h11 over asyncio streams
(this module's first version): h11's pure-Python framing and header validation, plus the
StreamReader's per-read futures, were still half of each request's CPU. Here a connection is an
asyncio Protocol that feeds the bytes to httptools (llhttp, the C parser uvicorn uses) as they
arrive, and wakes the waiting request once; the request head is a few joined bytes whose every
value is ours or checked (docs/benchmarks.md, "The lean HTTP path", has the measurements).

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
import re
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlencode, urlsplit

import httptools
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError

from .._kubeconfig import http11_tls

_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_READ_SIZE = 256 * 1024
_TARGET = re.compile(rb"[!-~]+")  # visible ASCII: no space, CR, LF or control byte
_VALUE = re.compile(rb"[ -~]+")


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
            self._header = _value(f"Bearer {user.token}", "the kubeconfig's token")
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
        """A token file that cannot be read or holds a line break fails the request as
        unreachable (the caller retries: a rotation may be under way), naming the file."""
        assert self._token_file is not None
        try:
            token = Path(self._token_file).read_text().strip()
            self._header = _value(f"Bearer {token}", f"the token in {self._token_file}")
        except (OSError, ConfigError) as e:
            raise TransportFailure(f"token file {self._token_file}: {e}") from None


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
        tls = http11_tls(config) if secure else None
        return cls(host, port, tls, url.path.rstrip("/"), url.netloc.rpartition("@")[2].encode())

    def target(self, path: str, params: Mapping[str, str] | None) -> bytes:
        query = f"?{urlencode(params)}" if params else ""
        return f"{self.prefix}{path}{query}".encode()


class _Answer:
    """One answer as httptools parses it: its callbacks fill these fields as bytes arrive."""

    __slots__ = (
        "_length",
        "chunks",
        "complete",
        "error",
        "extra",
        "gzip",
        "head_done",
        "keep_alive",
        "parser",
        "received",
        "size",
        "status",
        "streamed",
        "until_eof",
    )

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.gzip = False
        self.chunks: list[bytes] = []
        self.size = 0  # bytes in `chunks`
        self.streamed = False  # handed over as it arrives: reading pauses while it piles up
        self.received = False  # any byte of the answer arrived
        self.head_done = False  # status and headers known (a final answer, not a 1xx)
        self.complete = False
        self.keep_alive = False
        self.until_eof = False  # no length and not chunked: the body ends with the connection
        self.extra = False  # bytes beyond the answer: not a connection to reuse
        self.error: str | None = None
        self._length = False

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-encoding":
            self.gzip = value.strip().lower() == b"gzip"
        elif name in (b"content-length", b"transfer-encoding"):
            self._length = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        self.status = status
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once complete
        self.until_eof = not self._length and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
        self._length = False  # after an interim answer: the final one's headers count

    def take(self) -> list[bytes]:
        chunks, self.chunks, self.size = self.chunks, [], 0
        return chunks


class _Connection(asyncio.Protocol):
    """One connection: bytes are fed to the current answer's parser as they arrive, and the
    task waiting for them is woken (one future per wait, usually one per request)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.answer: _Answer | None = None
        self.ended = False  # EOF or connection lost
        self.lost: str = "closed by the server"
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes nobody asked for: this connection is not to be trusted
            self.ended = True
            self.lost = "unexpected bytes from the server"
            return
        answer.received = True
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if answer.complete:
                answer.extra = True
            else:
                answer.error = f"bad answer from the apiserver: {e}"
        if answer.streamed and answer.size > _READ_SIZE and not answer.complete:
            self._reading_paused = True  # a stream its reader has not caught up with
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        if exc is not None:
            self.lost = repr(exc)
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def closed(self) -> bool:
        return self.ended or self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        self.ended = True
        if self.transport is not None:
            self.transport.close()

    def begin(self) -> _Answer:
        self.answer = _Answer()
        return self.answer

    async def drain(self, within: float) -> None:
        if self._writable is not None:
            try:
                async with asyncio.timeout(within):
                    await self._writable
            except TimeoutError:
                raise TransportFailure("timed out writing the request") from None

    async def wait(self, within: float | None) -> None:
        """Until more of the answer arrives, or the connection ends. The deadline is a plain
        timer on the future: `asyncio.timeout` costs a tenth of a small request's CPU."""
        if self._reading_paused:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if within is None else loop.call_later(within, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            raise TransportFailure("timed out reading the answer") from None
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def check(self, answer: _Answer, first: bool) -> None:
        """Raise if the answer cannot go on: a parse error, or the connection ended early.
        `first`: nothing of the answer has arrived yet, so an end is `_Stale` (see the
        re-sending rule)."""
        if answer.error is not None:
            raise TransportFailure(answer.error)
        if self.ended and not answer.complete:
            if answer.until_eof:
                answer.complete = True
            elif first and not answer.received:
                raise _Stale(self.lost)
            elif answer.head_done:
                raise TransportFailure("connection closed before the end of the answer")
            else:
                raise TransportFailure(f"connection lost: {self.lost}")

    def reusable(self) -> bool:
        answer = self.answer
        return (
            answer is not None
            and answer.complete
            and not answer.extra
            and not answer.until_eof
            and answer.keep_alive
            and not self.closed()
        )


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
        connection (the fence: a write allowed when queued may not be when it leaves). After
        a 401 with a renewable token, the token is re-read and the request sent once more."""
        target = self._endpoint.target(path, params)
        if self._slots is not None:
            if not self._slots.locked():
                await self._slots.acquire()  # at once: no timer to set
            else:
                try:
                    async with asyncio.timeout(self._timeout):
                        await self._slots.acquire()
                except TimeoutError as e:
                    raise TransportFailure("timed out waiting for a pooled connection") from e
        try:
            status, answer = await self._exchange(method, target, body, content_type, before_write)
            if status == 401 and self._auth.renewable:
                self._auth.renew()
                status, answer = await self._exchange(
                    method, target, body, content_type, before_write
                )
            return status, answer
        finally:
            if self._slots is not None:
                self._slots.release()

    async def _exchange(
        self,
        method: str,
        target: bytes,
        body: bytes | None,
        content_type: str | None,
        before_write: Callable[[], None],
    ) -> tuple[int, bytes]:
        head = self._head(method, target, body, content_type, gzip=True)
        data = head + body if body else head
        for attempt in (1, 2):
            conn, reused = await self._checkout()
            try:
                answer = await self._send(conn, data, before_write)
                while True:
                    conn.check(answer, first=not answer.received)
                    if answer.complete:
                        break
                    await conn.wait(self._timeout)
            except _Stale as e:
                self._drop(conn)
                if attempt == 1 and reused and method in _IDEMPOTENT:
                    continue
                raise TransportFailure(f"connection lost: {e}") from None
            except BaseException:
                self._drop(conn)
                raise
            self._checkin(conn)
            chunks = answer.chunks
            content = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if content and answer.gzip:
                try:
                    content = zlib.decompress(content, wbits=31)
                except zlib.error as e:
                    raise TransportFailure(f"bad gzip answer from the apiserver: {e}") from None
            return answer.status, content
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
                answer = await self._stream_head(conn, target)
                if answer.status == 401 and self._auth.renewable:
                    self._drop(conn)  # its short error body is not worth reading
                    self._auth.renew()
                    conn, _ = await self._checkout()
                    answer = await self._stream_head(conn, target)
            except _Stale as e:
                raise TransportFailure(f"connection lost: {e}") from None
            yield StreamedAnswer(answer.status, self._body(conn, answer, read_timeout))
        finally:
            self._drop(conn)

    async def _stream_head(self, conn: _Connection, target: bytes) -> _Answer:
        answer = await self._send(conn, self._head("GET", target, None, None, gzip=False), _nothing)
        answer.streamed = True
        while not answer.head_done:
            conn.check(answer, first=True)
            await conn.wait(self._timeout)
        return answer

    async def _body(
        self, conn: _Connection, answer: _Answer, read_timeout: float | None
    ) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (httptools undoes chunked and Content-Length
        framing)."""
        while True:
            if answer.chunks:
                for chunk in answer.take():
                    yield chunk
                continue
            conn.check(answer, first=False)
            if answer.complete:
                return
            await conn.wait(read_timeout)

    def _head(
        self, method: str, target: bytes, body: bytes | None, content_type: str | None, gzip: bool
    ) -> bytes:
        """The request's head. Written by hand rather than by h11 (whose validating writer
        was a fifth of the agent's CPU in a pod burst): every value is either ours or checked
        here, so no CR, LF or space from a name or a token can split the head."""
        if _TARGET.fullmatch(target) is None:
            raise TransportFailure(f"cannot send the request: bad target {target[:200]!r}")
        parts = [
            method.encode(),
            b" ",
            target,
            b" HTTP/1.1\r\nHost: ",
            self._endpoint.host_header,
            b"\r\nUser-Agent: vkubelet\r\n",
        ]
        if gzip:
            parts.append(b"Accept-Encoding: gzip\r\n")
        if (auth := self._auth.header()) is not None:
            parts += (b"Authorization: ", auth, b"\r\n")
        if body is not None:
            kind = content_type.encode() if content_type else b"application/json"
            if _VALUE.fullmatch(kind) is None:
                raise TransportFailure(f"cannot send the request: bad content type {kind!r}")
            parts += (b"Content-Type: ", kind, b"\r\nContent-Length: ", b"%d" % len(body), b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def _send(
        self, conn: _Connection, data: bytes, before_write: Callable[[], None]
    ) -> _Answer:
        """Write the request; the answer is then parsed as it arrives."""
        assert conn.transport is not None
        answer = conn.begin()
        before_write()  # no await between this and the write
        if conn.closed():
            raise _Stale(conn.lost)
        conn.transport.write(data)
        await conn.drain(self._timeout)
        return answer

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
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout):
                _, conn = await loop.create_connection(
                    _Connection,
                    endpoint.host,
                    endpoint.port,
                    ssl=endpoint.tls,
                    server_hostname=endpoint.host if endpoint.tls else None,
                )
        except TimeoutError:
            raise TransportFailure(
                f"connect to {endpoint.host}:{endpoint.port} timed out"
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise TransportFailure(f"connect to {endpoint.host}:{endpoint.port}: {e!r}") from None
        return conn

    def _checkin(self, conn: _Connection) -> None:
        if self._closed or not conn.reusable() or len(self._idle) >= self._limits.max_idle:
            self._drop(conn)
            return
        self._busy.discard(conn)
        conn.answer = None
        conn.idle_since = now = time.monotonic()
        idle = self._idle
        while idle and now - idle[0].idle_since > self._limits.idle_expiry:
            idle.pop(0).close()  # the least recently used: checkouts take from the top
        idle.append(conn)


def _value(text: str, what: str) -> bytes:
    """A header value that cannot split the request head (no CR, LF or other control byte)."""
    value = text.encode()
    if _VALUE.fullmatch(value) is None:
        raise ConfigError(f"{what} holds a character not allowed in an HTTP header")
    return value


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _nothing() -> None:
    """No check before a GET's bytes leave (reads are never fenced)."""
