"""What route handlers share: the server's settings, the node a request is for, and helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lightkube.resources.core_v1 import Pod
from wsproto.utilities import generate_accept_token

from ..protocols.channel import ChannelFraming
from ..protocols.remotecommand import HEADER_ACCEPTED_PROTOCOL_VERSIONS, HEADER_PROTOCOL_VERSION
from ..protocols.spdy import SpdyLimits
from ..sdk.provider import PodLifecycleHandler
from ..sdk.spdy import SocketTransport, SpdySession
from ..sdk.websocket import ChannelSession, WebSocket
from ._http import Exchange, HttpError, Request
from ._metrics import ServerMetrics

PodSource = Callable[[], Iterable[Pod | bytes]]
"""The pods bound to a node: lightkube Pods, or each pod's JSON as bytes (served as it is, which
spares decoding a cache that keeps pods as JSON)."""


def _no_pods() -> Iterable[Pod | bytes]:
    return ()


@dataclass(frozen=True)
class KubeletNode:
    """One virtual node as its kubelet port sees it.

    `pods` returns the pods the apiserver has bound to the node (the agent's pod cache) and
    answers `/pods`. `addresses` are the names and IPs the node is reached at: when several
    nodes share a port, the request's Host header picks the node among them.
    """

    name: str
    provider: PodLifecycleHandler
    pods: PodSource = _no_pods
    port: int = 10250
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerConfig:
    """Limits and timeouts of a kubelet API server. The defaults follow the kubelet's."""

    host: str | None = None  # None: every interface
    max_connections: int = 1000
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 1 << 20
    header_timeout: float = 30.0
    tls_handshake_timeout: float = 10.0
    # The kubelet's streaming server: 4 h without traffic ends a session, and clients get 30 s
    # to open the streams they announced.
    stream_idle_timeout: float = 4 * 3600.0
    stream_creation_timeout: float = 30.0
    # After a session ends we wait this long for the client to hang up before closing.
    close_grace: float = 5.0
    spdy_limits: SpdyLimits = field(default_factory=SpdyLimits)
    max_websocket_message: int = 1 << 20
    stream_buffer: int = 1 << 20  # unread input per stream before the connection stalls
    run_output_limit: int = 16 << 20  # `/run` collects output in memory
    # A log request answers at once with headers; but an error found this quickly still gets
    # a proper status code (400 with the message, as from a kubelet) instead of a broken stream.
    logs_first_chunk_wait: float = 0.25


@dataclass
class Call:
    """One routed request: the exchange, its node and the path parameters."""

    exchange: Exchange
    node: KubeletNode
    params: dict[str, str]
    config: ServerConfig
    metrics: ServerMetrics
    port: int

    @property
    def request(self) -> Request:
        return self.exchange.request

    @property
    def provider(self) -> PodLifecycleHandler:
        return self.node.provider

    def missing(self, capability: type[Any], what: str) -> HttpError:
        """The 501 for a provider without `capability`: it names what is missing, so the user
        learns it is the provider's choice rather than a broken node."""
        return HttpError(
            501,
            f"{what} is not supported on node {self.node.name}: its provider "
            f"({type(self.node.provider).__name__}) does not implement {capability.__name__}",
        )

    @contextmanager
    def track(self, kind: str, transport: str) -> Iterator[None]:
        gauge = self.metrics.streams.labels(str(self.port), kind, transport)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    async def pod_uid(self, container: str | None = None) -> str:
        """Check that the provider runs the pod (and container) before upgrading: afterwards
        the client could only be told through the error stream. Returns the pod's UID."""
        namespace, name = self.params["namespace"], self.params["pod"]
        pod = await self.provider.get_pod(namespace, name)
        if pod is None or pod.metadata is None:
            raise HttpError(404, f"pod {namespace}/{name} is not running on node {self.node.name}")
        uid = str(pod.metadata.uid or "")
        wanted_uid = self.params.get("uid")
        if wanted_uid and wanted_uid != uid:
            raise HttpError(404, f"pod {namespace}/{name} with UID {wanted_uid} not found")
        if container is not None and pod.spec is not None:
            names = {c.name for c in pod.spec.containers or ()}
            names |= {c.name for c in pod.spec.initContainers or ()}
            names |= {c.name for c in pod.spec.ephemeralContainers or ()}
            if names and container not in names:
                raise HttpError(404, f"container {container} is not valid for pod {name}")
        return uid


def upgrade_kind(request: Request) -> str | None:
    """ "spdy", "websocket" or None, from the Upgrade header."""
    if not request.header_has_token("connection", "upgrade"):
        return None
    if request.header_has_token("upgrade", "websocket"):
        return "websocket"
    if request.header_has_token("upgrade", "spdy/3.1"):
        return "spdy"
    return None


def websocket_subprotocols(request: Request) -> list[str]:
    return [
        p.strip()
        for value in request.header_values("sec-websocket-protocol")
        for p in value.split(",")
        if p.strip()
    ]


async def start_websocket_session(
    call: Call, subprotocol: str, framing: ChannelFraming, inbound: Iterable[int]
) -> ChannelSession:
    """Check the WebSocket handshake (RFC 6455 §4.2), answer 101 and return a running session
    over the same connection that keeps what arrives on the `inbound` channels."""
    request = call.request
    if request.method != "GET":
        raise HttpError(400, "a WebSocket upgrade must be a GET request")
    if request.header("sec-websocket-version") != "13":
        raise HttpError(426, "unsupported WebSocket version", [("Sec-WebSocket-Version", "13")])
    key = request.header("sec-websocket-key")
    if not key:
        raise HttpError(400, "missing Sec-WebSocket-Key")
    headers = [
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Accept", generate_accept_token(key.strip().encode()).decode()),
    ]
    if subprotocol:
        headers.append(("Sec-WebSocket-Protocol", subprotocol))
    trailing = await call.exchange.switch_protocols(headers)
    config = call.config
    session = ChannelSession(
        WebSocket(
            call.exchange.reader,
            call.exchange.writer,
            trailing,
            client=False,
            idle_timeout=config.stream_idle_timeout,
        ),
        framing,
        max_message=config.max_websocket_message,
        channel_buffer=config.stream_buffer,
    )
    for number in inbound:
        session.channel(number)
    session.start()
    return session


async def start_spdy_session(
    call: Call, chosen: str | None, offered: list[str], accepted: list[str]
) -> SpdySession:
    """Answer an `Upgrade: SPDY/3.1` request: 400 (with the versions we accept) when the
    negotiation found nothing, else 101 and a running session over the same connection."""
    if chosen is None:
        raise HttpError(
            400,
            f"unable to upgrade: unable to negotiate protocol: client supports {offered}, "
            f"server accepts {accepted}",
            [(HEADER_ACCEPTED_PROTOCOL_VERSIONS, p) for p in accepted],
        )
    trailing = await call.exchange.switch_protocols(
        [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1"), (HEADER_PROTOCOL_VERSION, chosen)]
    )
    config = call.config
    session = SpdySession(
        SocketTransport(call.exchange.reader, call.exchange.writer, trailing),
        client=False,
        limits=config.spdy_limits,
        idle_timeout=config.stream_idle_timeout,
        stream_buffer=config.stream_buffer,
    )
    session.start()
    return session
