from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from vkubelet.kubelet import (
    KubeletAuth,
    KubeletNode,
    KubeletServer,
    ServerConfig,
    UnionAuthenticator,
    UserInfo,
    X509Authenticator,
    server_ssl_context,
)

from .harness import (
    FakeAuthorizer,
    FakeProvider,
    FakeTokens,
    LifecycleOnly,
    Pki,
    Reply,
    client_context,
    fetch,
)
from .harness import make_pki as _make_pki

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
    return _make_pki(tmp_path)


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
