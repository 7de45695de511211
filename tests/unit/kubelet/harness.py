"""A real kubelet API server on 127.0.0.1 with a throwaway CA, a fake provider, and clients.

The clients speak to it over real TLS sockets the way the apiserver and kubectl do: h11 for
plain HTTPS, the SPDY peer from the protocol tests for exec and port-forward, and wsproto for
WebSocket. Nothing is mocked below the provider and the auth webhooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import msgspec
import pytest
from lightkube.resources.core_v1 import Pod
from prometheus_client import CollectorRegistry
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    RejectConnection,
    Request,
    TextMessage,
)

from vkubelet.devcluster import _pki
from vkubelet.kubelet import (
    Attributes,
    AuthenticationError,
    Credentials,
    Decision,
    KubeletAuth,
    KubeletNode,
    KubeletServer,
    ServerConfig,
    UnionAuthenticator,
    UserInfo,
    X509Authenticator,
    server_ssl_context,
)
from vkubelet.protocols.spdy.frames import DataFrame, GoAwayFrame, PingFrame, RstStreamFrame
from vkubelet.sdk.capabilities import AttachIO, ByteStream, ContainerLogOptions
from vkubelet.sdk.provider import PodStatus, ProviderError, ResolvedPod

from ..protocols.spdy_peer import Peer

NAMESPACE = "default"
POD = "web"
CONTAINER = "app"
POD_UID = "uid-web"


# --- certificates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    apiserver_cert: Path  # the apiserver's kubelet client certificate
    apiserver_key: Path
    rogue_cert: Path  # a client certificate from a CA the server does not trust
    rogue_key: Path


def make_pki(directory: Path) -> Pki:
    ca = _pki.new_ca("kubelet-test-ca")
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca.cert_pem())
    server = _pki.issue(ca, "system:node:n1", server=True, ip_addresses=("127.0.0.1",))
    client = _pki.issue(
        ca, "kube-apiserver-kubelet-client", organizations=("kubeadm:cluster-admins",), client=True
    )
    rogue_ca = _pki.new_ca("rogue-ca")
    rogue = _pki.issue(rogue_ca, "mallory", organizations=("system:masters",), client=True)
    server_cert, server_key = server.write(directory, "server")
    client_cert, client_key = client.write(directory, "apiserver-client")
    rogue_cert, rogue_key = rogue.write(directory, "rogue")
    return Pki(ca_path, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)


def client_context(pki: Pki, *, cert: bool = True, rogue: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.set_alpn_protocols(["http/1.1"])
    if rogue:
        context.load_cert_chain(str(pki.rogue_cert), str(pki.rogue_key))
    elif cert:
        context.load_cert_chain(str(pki.apiserver_cert), str(pki.apiserver_key))
    return context


# --- auth fakes -----------------------------------------------------------------------------


class FakeTokens:
    """A token authenticator with a fixed table, standing in for TokenReview."""

    def __init__(self, users: dict[str, UserInfo]) -> None:
        self.users = users

    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        if credentials.bearer_token is None:
            return None
        user = self.users.get(credentials.bearer_token)
        if user is None:
            raise AuthenticationError("unknown token")
        return user


@dataclass
class FakeAuthorizer:
    """Allows everyone except the users in `deny`; remembers what it was asked."""

    deny: set[str] = field(default_factory=set)
    asked: list[tuple[str, Attributes]] = field(default_factory=list)

    async def authorize(self, user: UserInfo, attributes: Attributes) -> Decision:
        self.asked.append((user.name, attributes))
        if user.name in self.deny:
            return Decision(False, "denied by test")
        return Decision(True)


# --- providers ------------------------------------------------------------------------------


def make_pod(
    name: str = POD, namespace: str = NAMESPACE, uid: str = POD_UID, node: str = "n1"
) -> Pod:
    return msgspec.convert(
        {
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"nodeName": node, "containers": [{"name": CONTAINER, "image": "busybox"}]},
            "status": {"phase": "Running"},
        },
        Pod,
    )


class LifecycleOnly:
    """A provider with no optional capability at all."""

    def __init__(self, pods: Iterable[Pod] = ()) -> None:
        self.pods = {(p.metadata.namespace, p.metadata.name): p for p in pods if p.metadata}

    async def create_pod(self, pod: ResolvedPod) -> None:
        pass

    async def update_pod(self, pod: ResolvedPod) -> None:
        pass

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        pass

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        return self.pods.get((namespace, name))

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = self.pods.get((namespace, name))
        return None if pod is None else pod.status

    async def list_pods(self) -> list[Pod]:
        return list(self.pods.values())


class FakeProvider(LifecycleOnly):
    """Every capability, with behaviour chosen by the command or port a test uses.

    exec commands: `echo ARGS` (stdout), `fail CODE` (stderr + exit CODE), `cat` (stdin to
    stdout), `sizes N` (print N terminal sizes), `sleep` (until cancelled), `boom` (raises).
    Port-forward dials `echo_ports[port]` on 127.0.0.1; other ports are refused.
    """

    def __init__(self, pods: Iterable[Pod] = ()) -> None:
        super().__init__(pods or [make_pod()])
        self.echo_ports: dict[int, int] = {}
        self.log_lines: list[bytes] = [b"line 1\n", b"line 2\n"]
        self.more_logs: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.log_options: list[ContainerLogOptions] = []
        self.log_stream_closed = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        if (namespace, pod) not in self.pods or container != CONTAINER:
            raise ProviderError("NotFound", f"no container {container} in {namespace}/{pod}")
        self.log_options.append(options)
        try:
            for line in self.log_lines:
                yield line
            while options.follow:
                more = await self.more_logs.get()
                if more is None:
                    return
                yield more
        finally:
            self.log_stream_closed.set()

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        self.started.set()
        match command:
            case ["echo", *words]:
                assert io.stdout is not None
                await io.stdout.write((" ".join(words) + "\n").encode())
                return 0
            case ["fail", code]:
                if io.stdout is not None:
                    await io.stdout.write(b"partial\n")
                if io.stderr is not None:
                    await io.stderr.write(b"oops\n")
                return int(code)
            case ["cat"]:
                assert io.stdin is not None and io.stdout is not None
                while data := await io.stdin.read():
                    await io.stdout.write(data)
                return 0
            case ["sizes", count]:
                assert io.stdout is not None
                seen = 0
                async for size in io.resizes:
                    await io.stdout.write(f"{size.width}x{size.height}\n".encode())
                    seen += 1
                    if seen == int(count):
                        break
                return 0
            case ["sleep"]:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
                return 0
            case ["nope"]:
                raise ProviderError("CommandNotFound", 'exec: "nope": executable file not found')
            case _:
                raise RuntimeError(f"cannot run {command}")

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        assert io.stdout is not None
        await io.stdout.write(b"attached\n")

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        if port not in self.echo_ports:
            raise ConnectionRefusedError(f"dial tcp 127.0.0.1:{port}: connection refused")
        reader, writer = await asyncio.open_connection("127.0.0.1", self.echo_ports[port])

        async def upstream() -> None:
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            writer.write_eof()

        async def downstream() -> None:
            while data := await reader.read(65536):
                await stream.write(data)
            await stream.close()

        try:
            await asyncio.gather(upstream(), downstream())
        finally:
            writer.close()

    async def stats_summary(self) -> dict[str, Any]:
        return {"node": {"nodeName": "n1", "cpu": {"usageNanoCores": 5}}, "pods": []}

    async def metrics_resource(self) -> str:
        return "# TYPE node_cpu_usage_seconds_total counter\nnode_cpu_usage_seconds_total 1.5\n"


async def start_echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        finally:
            writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


# --- HTTPS client ---------------------------------------------------------------------------


class HttpClient:
    """One TLS connection speaking HTTP/1.1 through h11, able to follow a 101 upgrade."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int, context: ssl.SSLContext) -> HttpClient:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
        )
        return cls(reader, writer)

    async def request(
        self, method: str, target: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        given = list(headers)
        has_host = any(name.lower() == "host" for name, _ in given)
        all_headers = given if has_host else [("Host", "127.0.0.1"), *given]
        self.writer.write(
            self.conn.send(h11.Request(method=method, target=target, headers=all_headers))
        )
        self.writer.write(self.conn.send(h11.EndOfMessage()))
        await self.writer.drain()

    async def _event(self) -> Any:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise ConnectionError(f"server closed the connection: {exc}") from exc
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
                continue
            return event

    async def response(self) -> h11.Response | h11.InformationalResponse:
        while True:
            event = await self._event()
            if isinstance(event, h11.Response | h11.InformationalResponse):
                return event
            if isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before a response")

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            event = await self._event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def trailing(self) -> bytes:
        return bytes(self.conn.trailing_data[0])

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


async def fetch(
    port: int,
    context: ssl.SSLContext,
    target: str,
    *,
    method: str = "GET",
    token: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> Reply:
    client = await HttpClient.connect(port, context)
    try:
        extra = list(headers)
        if token is not None:
            extra.append(("Authorization", f"Bearer {token}"))
        await client.request(method, target, extra)
        response = await client.response()
        body = await client.body()
        joined: dict[str, str] = {}
        for name, value in response.headers:
            key = name.decode().lower()
            joined[key] = f"{joined[key]}, {value.decode()}" if key in joined else value.decode()
        return Reply(response.status_code, joined, body)
    finally:
        await client.close()


# --- SPDY client ----------------------------------------------------------------------------


class SpdyClient:
    """The apiserver's side of an upgraded connection, recording what the server sends."""

    def __init__(self, http: HttpClient) -> None:
        self.reader = http.reader
        self.writer = http.writer
        self.peer = Peer()
        self.data: defaultdict[int, bytearray] = defaultdict(bytearray)
        self.fins: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaway: GoAwayFrame | None = None
        self.pings: list[int] = []
        self.eof = False
        self._absorb(http.trailing())

    @classmethod
    async def upgrade(
        cls,
        port: int,
        context: ssl.SSLContext,
        target: str,
        protocols: Iterable[str],
        *,
        method: str = "POST",
    ) -> SpdyClient:
        http = await HttpClient.connect(port, context)
        headers = [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")]
        headers += [("X-Stream-Protocol-Version", p) for p in protocols]
        await http.request(method, target, headers)
        response = await http.response()
        assert response.status_code == 101, response
        return cls(http)

    @property
    def replies(self) -> dict[int, dict[str, str]]:
        return self.peer.replies

    def _absorb(self, data: bytes) -> None:
        for frame in self.peer.read(data):
            match frame:
                case DataFrame():
                    self.data[frame.stream_id] += frame.data
                    if frame.fin:
                        self.fins.add(frame.stream_id)
                case RstStreamFrame():
                    self.resets[frame.stream_id] = frame.status
                case GoAwayFrame():
                    self.goaway = frame
                case PingFrame():
                    self.pings.append(frame.ping_id)
                case _:
                    pass

    async def open(self, stream_id: int, headers: dict[str, str], *, fin: bool = False) -> None:
        self.writer.write(self.peer.syn_stream(stream_id, headers, fin=fin))
        await self.writer.drain()

    async def send(self, stream_id: int, payload: bytes, *, fin: bool = False) -> None:
        self.writer.write(DataFrame(stream_id, payload, fin).serialize())
        await self.writer.drain()

    async def ping(self, ping_id: int) -> None:
        self.writer.write(PingFrame(ping_id).serialize())
        await self.writer.drain()

    async def wait_for(self, condition: Callable[[], bool], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not condition():
                if self.eof:
                    raise AssertionError("connection closed before the condition held")
                data = await self.reader.read(65536)
                if not data:
                    self.eof = True
                self._absorb(data)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()


# --- WebSocket client -----------------------------------------------------------------------


class WsClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.subprotocol: str | None = None
        self.messages: list[bytes | str] = []
        self.closed: CloseConnection | None = None
        self._parts: list[bytes | str] = []

    @classmethod
    async def connect(
        cls, port: int, context: ssl.SSLContext, target: str, subprotocols: list[str]
    ) -> WsClient:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
        )
        client = cls(reader, writer)
        writer.write(
            client.ws.send(Request(host="127.0.0.1", target=target, subprotocols=subprotocols))
        )
        await writer.drain()
        while True:
            event = await client._next_event()
            if isinstance(event, AcceptConnection):
                client.subprotocol = event.subprotocol
                return client
            if isinstance(event, RejectConnection):
                await client.close()
                raise ConnectionError(f"WebSocket rejected with {event.status_code}")

    async def _next_event(self) -> Event:
        while True:
            for event in self.ws.events():
                return event
            data = await self.reader.read(65536)
            self.ws.receive_data(data or None)

    async def send(self, message: bytes | str) -> None:
        if isinstance(message, str):
            self.writer.write(self.ws.send(TextMessage(data=message)))
        else:
            self.writer.write(self.ws.send(BytesMessage(data=message)))
        await self.writer.drain()

    async def _pump(self) -> None:
        """Handle one event: keep finished messages, answer the server's close."""
        event = await self._next_event()
        match event:
            case BytesMessage() | TextMessage():
                self._parts.append(event.data if isinstance(event.data, str) else bytes(event.data))
                if event.message_finished:
                    if isinstance(self._parts[0], str):
                        self.messages.append("".join(str(p) for p in self._parts))
                    else:
                        self.messages.append(
                            b"".join(bytes(p) for p in self._parts if not isinstance(p, str))
                        )
                    self._parts = []
            case CloseConnection():
                self.closed = event
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    self.writer.write(self.ws.send(event.response()))
                    await self.writer.drain()
            case _:
                pass

    async def wait_for(self, condition: Callable[[], bool], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not condition():
                if self.closed is not None:
                    raise AssertionError("WebSocket closed before the condition held")
                await self._pump()

    async def receive_all(self, within: float = 5.0) -> list[bytes | str]:
        """Every message until the server closes the WebSocket."""
        async with asyncio.timeout(within):
            while self.closed is None:
                await self._pump()
        return self.messages

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()


# --- the server ----------------------------------------------------------------------------

TOKENS = {
    "good-token": UserInfo("alice", groups=("devs", "system:authenticated")),
    "bob-token": UserInfo("bob", groups=("system:authenticated",)),
}


@dataclass
class Kubelet:
    server: KubeletServer
    pki: Pki
    authorizer: FakeAuthorizer
    registry: CollectorRegistry
    providers: list[Any] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def provider(self) -> FakeProvider:
        provider = self.providers[0]
        assert isinstance(provider, FakeProvider)
        return provider

    def context(self, *, cert: bool = True) -> ssl.SSLContext:
        return client_context(self.pki, cert=cert)

    async def get(
        self,
        target: str,
        *,
        cert: bool = True,
        token: str | None = None,
        method: str = "GET",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Reply:
        return await fetch(
            self.port,
            self.context(cert=cert and token is None),
            target,
            method=method,
            token=token,
            headers=headers,
        )


StartKubelet = Callable[..., Awaitable[Kubelet]]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def start_kubelet(pki: Pki) -> AsyncIterator[StartKubelet]:
    servers: list[KubeletServer] = []

    async def start(
        *,
        provider: LifecycleOnly | None = None,
        nodes: Sequence[KubeletNode] | None = None,
        config: ServerConfig | None = None,
        allow_anonymous: bool = False,
    ) -> Kubelet:
        if nodes is None:
            the_provider = provider or FakeProvider()
            nodes = [KubeletNode("n1", the_provider, pods=lambda: list(the_provider.pods.values()))]
        authorizer = FakeAuthorizer()
        auth = KubeletAuth(
            UnionAuthenticator(
                X509Authenticator(), FakeTokens(TOKENS), allow_anonymous=allow_anonymous
            ),
            authorizer,
        )
        registry = CollectorRegistry()
        server = KubeletServer(
            nodes,
            ssl_context=server_ssl_context(pki.server_cert, pki.server_key, pki.ca),
            auth=auth,
            port=0,
            config=config or ServerConfig(host="127.0.0.1"),
            registry=registry,
        )
        await server.start()
        servers.append(server)
        return Kubelet(server, pki, authorizer, registry, [n.provider for n in nodes])

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def kubelet(start_kubelet: StartKubelet) -> Kubelet:
    return await start_kubelet()
