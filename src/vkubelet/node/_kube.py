"""A thin asynchronous Kubernetes API client for the node agent.

lightkube loads kubeconfigs (client certs, tokens, exec plugins, in-cluster accounts) and builds the
HTTP client settings; its msgspec models give typed objects where we want them. The agent's hot
paths — list/watch with bookmarks, status patches, events — go through the few raw methods here,
so that each request costs one msgspec decode and nothing else. An optional token bucket caps the
request rate (off unless asked for: the reference's default of 5 QPS is its main bottleneck).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import SingleConfig

from .._kubeconfig import load_kubeconfig

JSON = dict[str, Any]

_decode = msgspec.json.decode
_encode = msgspec.json.encode

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the apiserver, with its Status reason when it sent one."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        return self.status == 410


class Unreachable(Exception):
    """The apiserver could not be reached (connection refused, TLS failure, timeout)."""


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
    # HTTP/1.1: with httpx2 2.16 a request on an HTTP/2 connection waits until the connection's
    # open watch streams end (measured: 29.5 s), so multiplexing would stall the agent.
    http2: bool = False
    timeout: float = 30.0


# Ordinary requests: a bounded pool (httpcore probes every idle pooled connection's socket twice
# per request, so a large pool costs more than it brings: 5 % of the cluster provider's CPU in
# a 1,000-pod burst with 64; the apiserver on the other end is the limit anyway). Watches: no
# cap, since each holds its connection for minutes, and none kept idle once a watch ends.
# Idle request connections are kept 30 s, not httpx's 5: a new one costs a TLS handshake with
# client-certificate checks on both ends (2 % of the agent's CPU in a 1,000-pod burst, where
# work comes in waves and connections idled out between them).
_REQUESTS = httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=30)
_WATCHES = httpx.Limits(max_connections=None, max_keepalive_connections=0)
_HEARTBEATS = httpx.Limits(max_connections=16, max_keepalive_connections=16)


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
        # Two pools: long-lived watches (one per node and per watched object) in one, ordinary
        # requests in the other. httpcore scans a pool's connections for every request, so a
        # request sharing a pool with a thousand watches pays for each of them.
        self._http = self._new_http(config, _REQUESTS)
        self._watch_http = self._new_http(config, _WATCHES)
        self._heartbeat_http = self._new_http(config, _HEARTBEATS)
        self._closing: set[asyncio.Future[None]] = set()
        self._bucket = TokenBucket(options.qps, options.burst) if options.qps else None

    def _new_http(self, config: SingleConfig, limits: httpx.Limits) -> httpx.AsyncClient:
        params = ConnectionParams(
            timeout=httpx.Timeout(self._options.timeout),
            trust_env=False,
            transport=self._transport,  # type: ignore[arg-type]  # lightkube annotates the sync type
            http2=self._options.http2,
        )
        return httpx.AsyncClient(**params.httpx_params(config), limits=limits)

    @classmethod
    def from_kubeconfig(
        cls,
        path: Path | str | None = None,
        *,
        context: str | None = None,
        options: ClientOptions = ClientOptions(),
    ) -> KubeClient:
        """Load `path`, or $KUBECONFIG / ~/.kube/config / the in-cluster account when None."""
        kubeconfig = load_kubeconfig(path)
        config = kubeconfig.get(context)
        if config is None:
            raise ValueError(f"kubeconfig {path or '(from environment)'}: no context {context!r}")
        return cls(config, options)

    def reload(self, config: SingleConfig) -> None:
        """Switch to new credentials (a renewed client certificate). Requests in flight finish on
        the old connections; long watches end when those close, and their owners resume."""
        old = (self._http, self._watch_http, self._heartbeat_http)
        self.config = config
        self._http = self._new_http(config, _REQUESTS)
        self._watch_http = self._new_http(config, _WATCHES)
        self._heartbeat_http = self._new_http(config, _HEARTBEATS)
        asyncio.get_running_loop().call_later(30, self._close_later, old)

    def _close_later(self, clients: tuple[httpx.AsyncClient, ...]) -> None:
        for client in clients:
            task = asyncio.ensure_future(client.aclose())
            self._closing.add(task)  # keep a reference until it is done
            task.add_done_callback(self._closing.discard)

    @property
    def server(self) -> str:
        return str(self.config.cluster.server)

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._watch_http.aclose()
        await self._heartbeat_http.aclose()

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
        content = await self.request_raw(
            method, path, params=params, body=body, content_type=content_type
        )
        if not content:
            return {}
        decoded: JSON = _decode(content)
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
        if self._bucket:
            await self._bucket.take()
        content = None if body is None else (body if isinstance(body, bytes) else _encode(body))
        headers = {"Content-Type": content_type} if content is not None else None
        try:
            response = await self._http.request(
                method, path, params=params, content=content, headers=headers
            )
        except httpx.TransportError as e:
            raise Unreachable(f"{self.server}: {e!r}") from e
        if response.status_code >= 300:
            raise _api_error(response.status_code, response.content)
        return response.content

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
        if self._bucket:
            await self._bucket.take()
        try:
            response = await self._heartbeat_http.request(
                "PATCH", path, content=_encode(body), headers={"Content-Type": content_type}
            )
        except httpx.TransportError as e:
            raise Unreachable(f"{self.server}: {e!r}") from e
        if response.status_code >= 300:
            raise _api_error(response.status_code, response.content)
        decoded: JSON = _decode(response.content)
        return decoded

    async def delete(self, path: str, body: Any = None) -> JSON:
        return await self.request("DELETE", path, body=body)

    async def stream(
        self, path: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """GET `path` and yield the body as it arrives (a followed pod log, say), on the watch
        pool since such a response may stay open indefinitely."""
        if self._bucket:
            await self._bucket.take()
        timeout = httpx.Timeout(30.0, read=None)
        try:
            async with self._watch_http.stream(
                "GET", path, params=params, timeout=timeout
            ) as response:
                if response.status_code >= 300:
                    raise _api_error(response.status_code, await response.aread())
                async for chunk in response.aiter_bytes():
                    yield chunk
        except httpx.TransportError as e:
            raise Unreachable(f"{self.server}: {e!r}") from e

    async def watch(
        self, path: str, params: Mapping[str, str], *, timeout_seconds: int
    ) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (type, raw object JSON) for each watch event until the server ends the watch.

        The object is left undecoded so the caller decodes it once, straight into its own type.
        """
        if self._bucket:
            await self._bucket.take()
        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_seconds)}
        timeout = httpx.Timeout(30.0, read=timeout_seconds + 30.0)
        try:
            async with self._watch_http.stream(
                "GET", path, params=query, timeout=timeout
            ) as response:
                if response.status_code >= 300:
                    raise _api_error(response.status_code, await response.aread())
                # Lines split as bytes: httpx's aiter_lines decodes the stream to text first,
                # a measurable share of the agent's CPU when thousands of pods change.
                rest = b""
                async for chunk in response.aiter_bytes():
                    *lines, rest = (rest + chunk).split(b"\n")
                    for line in lines:
                        if line:
                            event = _decode_event(line)
                            yield event.type, event.object
        except httpx.TransportError as e:
            raise Unreachable(f"{self.server}: {e!r}") from e


class _WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


_decode_event = msgspec.json.Decoder(_WatchEvent).decode


def _api_error(status: int, content: bytes) -> ApiError:
    try:
        body = _decode(content)
    except msgspec.DecodeError:
        return ApiError(status, "Unknown", content.decode(errors="replace")[:500])
    if isinstance(body, dict):
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
    return ApiError(status, "Unknown", str(body)[:500])


def status_error(raw: bytes) -> ApiError:
    """Turn the object of a watch ERROR event (a metav1.Status) into an ApiError."""
    body = _decode(raw)
    return ApiError(
        int(body.get("code", 500)), str(body.get("reason", "")), body.get("message", "")
    )
