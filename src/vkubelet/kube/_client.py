"""A thin asynchronous Kubernetes API client, the one every part of vkubelet talks through.

lightkube loads kubeconfigs (client certs, tokens, exec plugins, in-cluster accounts); requests go
through the lean HTTP/1.1 client of `_http11` (asyncio streams and h11, ~1/10 of httpx2's CPU per
request), or through httpx when a test injects a transport or the credentials need lightkube's
auth flows (exec plugins). The agent's hot
paths — list/watch with bookmarks, status patches, events — go through the few raw methods here,
so that each request costs one msgspec decode and nothing else. An optional token bucket caps the
request rate (off unless asked for: the reference's default of 5 QPS is its main bottleneck).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx2 as httpx
import msgspec
from lightkube.config.kubeconfig import SingleConfig

from .._kubeconfig import httpx_params, load_context
from ._errors import Unreachable, api_error
from ._http11 import Auth, Endpoint, Limits, Pool, StreamedAnswer, TransportFailure, supports

JSON = dict[str, Any]

_decode = msgspec.json.decode
_encode = msgspec.json.encode

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class TokenBucket:
    """Requests per second with bursts; waiters are served in order."""

    def __init__(self, qps: float, burst: int) -> None:
        self._rate = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
                self._stamp = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self._rate)


@dataclass(frozen=True)
class ClientOptions:
    qps: float | None = None  # None: no client-side limit (the apiserver's APF still applies)
    burst: int = 1000
    timeout: float = 30.0
    # The lean HTTP/1.1 client (`_http11`); VKUBELET_HTTP_CLIENT=httpx switches every request
    # back to httpx2, a fallback should an apiserver or proxy disagree with the lean client.
    lean: bool = field(default_factory=lambda: os.environ.get("VKUBELET_HTTP_CLIENT") != "httpx")


# Ordinary requests: a bounded pool, as large as a node's status workers (a burst's writes wait
# on a loaded apiserver together; see `_workqueue`). The lean client pays nothing per idle
# connection (httpx, the fallback, probes each one's socket per request: 5 % of the cluster
# provider's CPU in a 1,000-pod burst with 64 of them). Watches: no cap, since each holds its
# connection for minutes, and none kept idle once a watch ends. Idle request connections are
# kept 30 s, not httpx's 5: a new one costs a TLS handshake with client-certificate checks on
# both ends (2 % of the agent's CPU in a 1,000-pod burst, where work comes in waves and
# connections idled out between them).
_REQUESTS = Limits(max_connections=96, max_idle=96, idle_expiry=30)
_WATCHES = Limits(max_connections=None, max_idle=0, idle_expiry=0)
_HEARTBEATS = Limits(max_connections=16, max_idle=16, idle_expiry=5)


class _HttpxPool:
    """The httpx path, kept for an injected transport (unit tests, `testing.fakeapi`) and for
    credentials the lean client does not handle (exec plugins): lightkube's auth flows do."""

    def __init__(self, client: httpx.AsyncClient, timeout: float) -> None:
        self._client = client
        self._timeout = timeout

    async def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: bytes | None,
        content_type: str | None,
        before_write: Callable[[], None],
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": content_type} if body is not None and content_type else None
        before_write()  # as late as httpx lets us look: before it takes a connection
        try:
            response = await self._client.request(
                method, path, params=params, content=body, headers=headers
            )
        except httpx.TransportError as e:
            raise TransportFailure(repr(e)) from e
        return response.status_code, response.content

    @asynccontextmanager
    async def stream(
        self, path: str, params: Mapping[str, str] | None, read_timeout: float | None
    ) -> AsyncIterator[StreamedAnswer]:
        timeout = httpx.Timeout(self._timeout, read=read_timeout)
        try:
            async with self._client.stream("GET", path, params=params, timeout=timeout) as response:
                yield StreamedAnswer(response.status_code, self._chunks(response))
        except httpx.TransportError as e:
            raise TransportFailure(repr(e)) from e

    @staticmethod
    async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.TransportError as e:
            raise TransportFailure(repr(e)) from e

    async def aclose(self) -> None:
        await self._client.aclose()


_Pool = Pool | _HttpxPool


class KubeClient:
    def __init__(
        self,
        config: SingleConfig,
        options: ClientOptions = ClientOptions(),
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self._options = options
        self._transport = transport
        # Three pools: long-lived watches (one per node and per watched object), heartbeats,
        # and ordinary requests, so that neither pod work nor open watches delay the others.
        self._http, self._watch_http, self._heartbeat_http = self._new_pools(config)
        self._closing: set[asyncio.Future[None]] = set()
        self._bucket = TokenBucket(options.qps, options.burst) if options.qps else None

    @property
    def lean(self) -> bool:
        """Whether requests go through the lean HTTP/1.1 client (else httpx)."""
        return isinstance(self._http, Pool)

    def _new_pools(self, config: SingleConfig) -> tuple[_Pool, _Pool, _Pool]:
        limits = (_REQUESTS, _WATCHES, _HEARTBEATS)
        timeout = self._options.timeout
        pools: list[_Pool]
        if self._transport is None and self._options.lean and supports(config):
            endpoint, auth = Endpoint.from_config(config), Auth(config)
            pools = [Pool(endpoint, auth, each, timeout) for each in limits]
        else:
            pools = [_HttpxPool(self._new_httpx(config, each), timeout) for each in limits]
        return pools[0], pools[1], pools[2]

    def _new_httpx(self, config: SingleConfig, limits: Limits) -> httpx.AsyncClient:
        # HTTP/1.1 only: with httpx2 2.16 a request on an HTTP/2 connection waits until the
        # connection's open watch streams end (measured: 29.5 s), so multiplexing would stall
        # the agent.
        params = httpx_params(config, timeout=self._options.timeout, transport=self._transport)
        return httpx.AsyncClient(
            **params,
            limits=httpx.Limits(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_idle,
                keepalive_expiry=limits.idle_expiry,
            ),
        )

    def _before_send(self, method: str) -> None:
        """A hook run as each request leaves (FencedClient refuses writes here)."""

    @classmethod
    def from_kubeconfig(
        cls,
        path: Path | str | None = None,
        *,
        context: str | None = None,
        options: ClientOptions = ClientOptions(),
    ) -> KubeClient:
        """Load `path`, or $KUBECONFIG / ~/.kube/config / the in-cluster account when None."""
        return cls(load_context(path, context), options)

    def reload(self, config: SingleConfig) -> None:
        """Switch to new credentials (a renewed client certificate). Requests in flight finish on
        the old connections; long watches end when those close, and their owners resume."""
        old = (self._http, self._watch_http, self._heartbeat_http)
        self.config = config
        self._http, self._watch_http, self._heartbeat_http = self._new_pools(config)
        asyncio.get_running_loop().call_later(30, self._close_later, old)

    def _close_later(self, pools: tuple[_Pool, ...]) -> None:
        for pool in pools:
            task = asyncio.ensure_future(pool.aclose())
            self._closing.add(task)  # keep a reference until it is done
            task.add_done_callback(self._closing.discard)

    @property
    def server(self) -> str:
        return str(self.config.cluster.server)

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._watch_http.aclose()
        await self._heartbeat_http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> JSON:
        """Send one request and decode the JSON answer; raise ApiError or Unreachable."""
        content = await self._send(self._http, method, path, params, body, content_type)
        decoded: JSON = _decode(content) if content else {}
        return decoded

    async def request_raw(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> bytes:
        """Like `request`, but return the body undecoded, for callers that decode into a type."""
        return await self._send(self._http, method, path, params, body, content_type)

    async def _send(
        self,
        pool: _Pool,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Any,
        content_type: str,
    ) -> bytes:
        if self._bucket:
            await self._bucket.take()
        content = None if body is None else (body if isinstance(body, bytes) else _encode(body))
        self._before_send(method)  # early: a refused write does not wait for a slot
        try:
            status, answer = await pool.request(
                method, path, params, content, content_type, lambda: self._before_send(method)
            )
        except TransportFailure as e:
            raise Unreachable(f"{self.server}: {e}") from e
        if status >= 300:
            raise api_error(status, answer)
        return answer

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Any) -> JSON:
        return await self.request("POST", path, body=body)

    async def replace(self, path: str, body: Any) -> JSON:
        return await self.request("PUT", path, body=body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> JSON:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def heartbeat(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> JSON:
        """A PATCH on the heartbeat pool (lease renewals, node status), as the kubelet keeps a
        separate heartbeat client: a node must not look dead because pod work is queued."""
        answer = await self._send(self._heartbeat_http, "PATCH", path, None, body, content_type)
        decoded: JSON = _decode(answer)
        return decoded

    async def delete(self, path: str, body: Any = None) -> JSON:
        return await self.request("DELETE", path, body=body)

    async def stream(
        self, path: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """GET `path` and yield the body as it arrives (a followed pod log, say), on the watch
        pool since such a response may stay open indefinitely."""
        chunks = self._stream(path, params, read_timeout=None)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def watch(
        self, path: str, params: Mapping[str, str], *, timeout_seconds: int
    ) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (type, raw object JSON) for each watch event until the server ends the watch.

        The object is left undecoded so the caller decodes it once, straight into its own type.
        """
        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_seconds)}
        # Lines split as bytes: decoding the stream to text first would be a measurable share
        # of the agent's CPU when thousands of pods change.
        # A line cut across chunks is kept in pieces, joined once: a large object arrives in
        # many chunks, and concatenating each to the rest would copy it over and over.
        pieces: list[bytes] = []
        chunks = self._stream(path, query, read_timeout=timeout_seconds + 30.0)
        async with contextlib.aclosing(chunks):  # the connection closes with this generator
            async for chunk in chunks:
                if b"\n" not in chunk:
                    pieces.append(chunk)
                    continue
                if pieces:
                    pieces.append(chunk)
                    chunk, pieces = b"".join(pieces), []
                *lines, rest = chunk.split(b"\n")
                if rest:
                    pieces.append(rest)
                for line in lines:
                    if line:
                        event = _decode_event(line)
                        yield event.type, event.object

    async def _stream(
        self, path: str, params: Mapping[str, str] | None, read_timeout: float | None
    ) -> AsyncGenerator[bytes, None]:
        if self._bucket:
            await self._bucket.take()
        self._before_send("GET")
        try:
            async with self._watch_http.stream(path, params, read_timeout) as answer:
                if answer.status >= 300:
                    try:  # a short error body; a stream's own reads may wait forever
                        async with asyncio.timeout(self._options.timeout):
                            content = b"".join([c async for c in answer.chunks])
                    except TimeoutError:
                        raise Unreachable(f"{self.server}: timed out reading an error") from None
                    raise api_error(answer.status, content)
                async for chunk in answer.chunks:
                    yield chunk
        except TransportFailure as e:
            raise Unreachable(f"{self.server}: {e}") from e


class _WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


_decode_event = msgspec.json.Decoder(_WatchEvent).decode
