"""The kubelet API server: TLS listener, connection limit, routing, authentication, errors.

One `KubeletServer` listens on one port for one or more virtual nodes. With one node every
request is for it. With several, the Host header picks the node (the apiserver dials the address
the node reports), and pod-scoped requests fall back to whichever node the pod is bound to.

Errors never leave a client waiting: a missing provider capability is a 501 that names it,
"not found" from a provider is a 404, anything else a 500 with the message (but `_logs`
answers a provider's log errors with 400, as the kubelet does). Once a streamed response has
started the status can no longer change, so the connection is cut instead and the client sees
a truncated body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import msgspec
from lightkube.resources.core_v1 import Pod
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..sdk.capabilities import MetricsProvider, StatsProvider
from ..sdk.provider import ProviderError
from ._auth import (
    AuthenticationError,
    Credentials,
    KubeletAuth,
    UserInfo,
    request_attributes,
)
from ._context import Call, KubeletNode, ServerConfig
from ._exec import handle_attach, handle_exec, handle_run
from ._http import Exchange, HttpError, HttpLimits, Request, serve_connection
from ._logs import handle_logs
from ._metrics import metrics_for
from ._portforward import handle_port_forward

log = logging.getLogger(__name__)

_json = msgspec.json.encode

RouteHandler = Callable[[Call], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    name: str
    methods: frozenset[str]
    params: dict[str, str]
    handler: RouteHandler | None = None  # None: answered by the server itself


_GET = frozenset({"GET"})
_GET_POST = frozenset({"GET", "POST"})
_POST = frozenset({"POST"})


def match_route(path: str) -> Route | None:
    """Trailing slashes are ignored (the kubelet redirects them; answering is simpler)."""
    segments = [unquote(s) for s in path.strip("/").split("/")]
    if any(not s for s in segments):
        return None
    match segments:
        case ["healthz"]:
            return Route("healthz", _GET, {})
        case ["metrics"]:
            return Route("metrics", _GET, {})
        case ["metrics", "resource"]:
            return Route("metrics_resource", _GET, {}, handle_metrics_resource)
        case ["stats", "summary"]:
            return Route("stats", _GET, {}, handle_stats)
        case ["pods"]:
            return Route("pods", _GET, {}, handle_pods)
        case ["runningpods"]:
            return Route("runningpods", _GET, {}, handle_running_pods)
        case ["containerLogs", ns, pod, container]:
            return Route("logs", _GET, _pod(ns, pod, container), handle_logs)
        case ["exec", ns, pod, container] | ["exec", ns, pod, _, container]:
            return Route("exec", _GET_POST, _pod(ns, pod, container, segments), handle_exec)
        case ["attach", ns, pod, container] | ["attach", ns, pod, _, container]:
            return Route("attach", _GET_POST, _pod(ns, pod, container, segments), handle_attach)
        case ["run", ns, pod, container] | ["run", ns, pod, _, container]:
            return Route("run", _POST, _pod(ns, pod, container, segments), handle_run)
        case ["portForward", ns, pod] | ["portForward", ns, pod, _]:
            params = {"namespace": ns, "pod": pod}
            if len(segments) == 4:
                params["uid"] = segments[3]
            return Route("portforward", _GET_POST, params, handle_port_forward)
    return None


def _pod(ns: str, pod: str, container: str, segments: Sequence[str] = ()) -> dict[str, str]:
    params = {"namespace": ns, "pod": pod, "container": container}
    if len(segments) == 5:
        params["uid"] = segments[3]
    return params


# --- simple routes --------------------------------------------------------------------------


async def handle_stats(call: Call) -> None:
    provider = call.provider
    if not isinstance(provider, StatsProvider):
        raise call.missing(StatsProvider, "/stats/summary")
    summary = await provider.stats_summary()
    await call.exchange.respond(200, _json(summary), "application/json")


async def handle_metrics_resource(call: Call) -> None:
    provider = call.provider
    if not isinstance(provider, MetricsProvider):
        raise call.missing(MetricsProvider, "/metrics/resource")
    text = await provider.metrics_resource()
    await call.exchange.respond(200, text, "text/plain; version=0.0.4; charset=utf-8")


async def handle_pods(call: Call) -> None:
    """The pods the apiserver has bound to this node, as the agent's cache has them."""
    await _pod_list(call, call.node.pods())


async def handle_running_pods(call: Call) -> None:
    """The pods the provider runs, bound or not (the kubelet's debugging view)."""
    await _pod_list(call, await call.provider.list_pods())


async def _pod_list(call: Call, pods: Iterable[Pod | bytes]) -> None:
    items = [msgspec.Raw(p) if isinstance(p, bytes) else p for p in pods]
    body = {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
    await call.exchange.respond(200, _json(body), "application/json")


def _is_not_found(exc: BaseException) -> bool:
    """A provider says "no such pod/container" with ProviderError("NotFound", ...). KeyError and
    friends are not taken as that: they are more often bugs, which a 404 would hide."""
    if isinstance(exc, ProviderError):
        return exc.reason.lower().replace("_", "") == "notfound"
    return isinstance(exc, FileNotFoundError)


# --- the server -----------------------------------------------------------------------------


class KubeletServer:
    """The kubelet API of `nodes` on one port. Use `serve_nodes` to get one per port."""

    def __init__(
        self,
        nodes: Sequence[KubeletNode],
        *,
        ssl_context: ssl.SSLContext,
        auth: KubeletAuth,
        port: int = 10250,
        config: ServerConfig | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("a kubelet server needs at least one node")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")
        self.nodes = list(nodes)
        self.ssl_context = ssl_context
        self.auth = auth
        self.requested_port = port
        self.config = config or ServerConfig()
        self.registry, self.metrics = metrics_for(registry)
        self._limits = HttpLimits(
            max_header_bytes=self.config.max_header_bytes,
            max_body_bytes=self.config.max_body_bytes,
            header_timeout=self.config.header_timeout,
        )
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._label = str(port)

    @property
    def port(self) -> int:
        """The bound port (useful when asked for port 0)."""
        if self._server is None or not self._server.sockets:
            return self.requested_port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_connection,
            host=self.config.host,
            port=self.requested_port,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.config.tls_handshake_timeout,
            limit=self.config.max_header_bytes,
            reuse_address=True,
        )
        self._label = str(self.port)
        log.info(
            "kubelet API for %s listening on port %d",
            ", ".join(n.name for n in self.nodes),
            self.port,
        )

    async def close(self) -> None:
        """Stop listening and end every open connection (streams included)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def serve_forever(self) -> None:
        """Run until cancelled, then close."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def __aenter__(self) -> KubeletServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- connections ----------------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(self._connections) >= self.config.max_connections:
            self.metrics.rejected_connections.labels(self._label).inc()
            log.warning(
                "connection limit (%d) reached; closing a new connection", len(self._connections)
            )
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        gauge = self.metrics.connections.labels(self._label)
        gauge.inc()
        try:
            await serve_connection(reader, writer, self._handle, self._limits)
        except asyncio.CancelledError:
            # `close()` ends connections this way. The task is asyncio's own connection task,
            # whose done-callback (Python 3.11) would report a cancellation as an error.
            pass
        except Exception:
            log.exception("kubelet API connection failed")
        finally:
            gauge.dec()
            self._connections.discard(task)
            if not writer.is_closing():
                writer.close()

    # --- requests -------------------------------------------------------------------------

    async def _handle(self, exchange: Exchange) -> None:
        request = exchange.request
        route = match_route(request.path)
        name = route.name if route else "unknown"
        started = time.monotonic()
        try:
            await self._dispatch(exchange, route)
        except HttpError as exc:
            await self._fail(exchange, exc.status, exc.message, exc.headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if _is_not_found(exc):
                await self._fail(exchange, 404, str(exc))
            else:
                log.warning("%s %s failed: %s", request.method, request.path, exc, exc_info=exc)
                await self._fail(exchange, 500, str(exc) or type(exc).__name__)
        finally:
            self.metrics.requests.labels(self._label, name, str(exchange.status or 499)).inc()
            self.metrics.request_seconds.labels(self._label, name).observe(
                time.monotonic() - started
            )

    async def _fail(
        self, exchange: Exchange, status: int, message: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        if exchange.started:
            # Too late for a status: cut the connection so the client sees a broken body.
            exchange.writer.close()
            return
        await exchange.respond(status, message + "\n", headers=headers)

    async def _dispatch(self, exchange: Exchange, route: Route | None) -> None:
        request = exchange.request
        if route is not None and route.name == "healthz":
            await exchange.respond(200, "ok")
            return
        user = await self._authenticate(request)
        if route is None:
            raise HttpError(404, f"404 page not found: no kubelet API endpoint {request.path}")
        if request.method not in route.methods:
            allowed = ", ".join(sorted(route.methods))
            raise HttpError(405, f"{request.method} is not allowed here", [("Allow", allowed)])
        node = self._node_for(route, request)
        if route.name == "metrics":
            # The process's own metrics belong to no node in particular: without one named,
            # the caller must be allowed them on every node of this port.
            for target in [node] if node is not None else self.nodes:
                await self._authorize(user, request, target)
            await exchange.respond(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
            return
        if node is None:
            raise HttpError(
                421,
                f"this port serves nodes {', '.join(n.name for n in self.nodes)}; "
                f"the Host header {request.header('host')!r} names none of them",
            )
        await self._authorize(user, request, node)
        assert route.handler is not None
        await route.handler(
            Call(exchange, node, route.params, self.config, self.metrics, self.port)
        )

    # --- node selection -------------------------------------------------------------------

    def _node_for(self, route: Route, request: Request) -> KubeletNode | None:
        if len(self.nodes) == 1:
            return self.nodes[0]
        host = _host_name(request.header("host") or "")
        by_host = [n for n in self.nodes if host == n.name or host in n.addresses]
        if len(by_host) == 1:
            return by_host[0]
        if "pod" in route.params:
            ns, pod = route.params["namespace"], route.params["pod"]
            by_pod = [n for n in self.nodes if _binds(n, ns, pod)]
            if len(by_pod) == 1:
                return by_pod[0]
            if not by_pod:
                raise HttpError(404, f"pod {ns}/{pod} is not bound to a node served on this port")
        return None

    # --- security -------------------------------------------------------------------------

    async def _authenticate(self, request: Request) -> UserInfo:
        token = None
        authorization = request.header("authorization")
        if authorization is not None:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                token = value.strip()
        credentials = Credentials(request.peercert or None, token)
        try:
            user = await self.auth.authenticator.authenticate(credentials)
        except AuthenticationError as exc:
            log.info("authentication failed for %s %s: %s", request.method, request.path, exc)
            user = None
        if user is None:
            self.metrics.auth_failures.labels(self._label, "401").inc()
            raise HttpError(401, "Unauthorized")
        return user

    async def _authorize(self, user: UserInfo, request: Request, node: KubeletNode) -> None:
        attributes = request_attributes(request.method, request.path, node.name)
        what = (
            f"user={user.name}, verb={attributes.verb}, resource={attributes.resource}, "
            f"subresource={attributes.subresource}"
        )
        try:
            decision = await self.auth.authorizer.authorize(user, attributes)
        except Exception as exc:
            log.warning("authorization error (%s): %s", what, exc)
            raise HttpError(500, f"Authorization error ({what})") from exc
        if not decision.allowed:
            self.metrics.auth_failures.labels(self._label, "403").inc()
            raise HttpError(403, f"Forbidden ({what})")


def _host_name(host: str) -> str:
    """The host part of a Host header: `[::1]:10250` → `::1`, `node-1:10250` → `node-1`."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


class _Meta(msgspec.Struct):
    name: str | None = None
    namespace: str | None = None


class _PodMeta(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


_decode_meta = msgspec.json.Decoder(_PodMeta).decode


def _binds(node: KubeletNode, namespace: str, name: str) -> bool:
    for pod in node.pods():
        meta = _decode_meta(pod).metadata if isinstance(pod, bytes) else pod.metadata
        if meta is not None and meta.name == name and meta.namespace == namespace:
            return True
    return False


def serve_nodes(
    nodes: Iterable[KubeletNode],
    *,
    ssl_context: ssl.SSLContext,
    auth: KubeletAuth,
    config: ServerConfig | None = None,
    registry: CollectorRegistry | None = None,
) -> list[KubeletServer]:
    """One server per distinct `KubeletNode.port`, each serving the nodes on that port.
    Start them with `await server.start()` (or `async with`)."""
    by_port: dict[int, list[KubeletNode]] = {}
    for node in nodes:
        by_port.setdefault(node.port, []).append(node)
    return [
        KubeletServer(
            group, ssl_context=ssl_context, auth=auth, port=port, config=config, registry=registry
        )
        for port, group in by_port.items()
    ]
