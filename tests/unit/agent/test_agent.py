"""The agent process against the fake apiserver: Ready means the kubelet API answers, dev
clusters approve their own serving CSRs, every provider is closed once at the stop, and
providers' events reach the right node's recorder."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.core_v1 import PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

import vkubelet.agent._providers
import vkubelet.node._certs
from vkubelet.agent import Agent
from vkubelet.agent._clientca import ClientCA
from vkubelet.node import AgentConfig, FleetNode, NodeSpec, ProviderContext
from vkubelet.providers.mock import MockConfig, MockProvider
from vkubelet.testing.fakeapi import JSON, FakeApiServer

from ..node.helpers import always, cancel_and_wait, conditions, eventually, lease_of, settings
from .pki import TestCA, pending_csrs, signer


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


def agent_config(tmp_path: Path, *names: str, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "nodes": [NodeSpec(settings(name=n, kubelet_port=0)) for n in names or ("vk-a",)],
        "workers": 4,
        "cert_dir": tmp_path / "pki",
        "approve_csrs": False,
        "insecure_kubelet_api": True,
    }
    values.update(overrides)
    return AgentConfig(**values)


def ready(api: FakeApiServer, name: str = "vk-a") -> JSON:
    return conditions(api, name).get("Ready") or {}


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_the_node_is_not_ready_while_its_serving_csr_waits_for_approval(
    api: FakeApiServer, tmp_path: Path
) -> None:
    agent = Agent(agent_config(tmp_path), client=api.client())
    port = agent.config.nodes[0].settings.kubelet_port
    task = asyncio.create_task(agent.run())
    try:
        [csr] = await eventually(lambda: pending_csrs(api), what="a serving CSR")
        await eventually(lambda: "approve" in ready(api).get("message", ""), what="why not")
        condition = ready(api)
        assert condition["status"] == "False"
        assert condition["reason"] == "KubeletAPINotServing"
        assert f"kubectl certificate approve {csr}" in condition["message"]
        # However long nobody approves it: never Ready, and nothing listens.
        await always(
            lambda: ready(api)["status"] == "False" and not answers(port),
            duration=1.0,
            what="NotReady while pending",
        )
        async with signer(api, TestCA("cluster"), only_approved=False):
            await eventually(lambda: ready(api).get("status") == "True", what="Ready")
        assert answers(port)
    finally:
        await cancel_and_wait(task)


async def test_the_node_says_why_when_its_kubelet_port_cannot_listen(
    api: FakeApiServer, tmp_path: Path
) -> None:
    ca = TestCA("cluster")
    ca.issue(tmp_path / "tls.crt", tmp_path / "tls.key", name="vk-a", addresses=["127.0.0.1"])
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = agent_config(
            tmp_path, tls_cert_file=tmp_path / "tls.crt", tls_key_file=tmp_path / "tls.key"
        )
        config.nodes[0].settings.kubelet_port = port
        task = asyncio.create_task(Agent(config, client=api.client()).run())
        try:
            await eventually(lambda: "cannot start" in ready(api).get("message", ""), within=10)
            assert ready(api)["status"] == "False"
        finally:
            await cancel_and_wait(task)


async def test_on_a_dev_cluster_the_agent_approves_its_own_serving_csr(
    api: FakeApiServer, tmp_path: Path
) -> None:
    api.create(
        "configmaps",
        {
            "metadata": {"name": "vkubelet-dev-cluster", "namespace": "kube-public"},
            "data": {"name": "test"},
        },
    )
    agent = Agent(agent_config(tmp_path, approve_csrs=None), client=api.client())
    task = asyncio.create_task(agent.run())
    try:
        async with signer(api, TestCA("cluster"), only_approved=True):
            await eventually(lambda: ready(api).get("status") == "True", what="Ready")
        [csr] = api.objects("certificatesigningrequests")
        assert csr["status"]["conditions"][0]["type"] == "Approved"
    finally:
        await cancel_and_wait(task)


async def test_elsewhere_the_agent_leaves_its_serving_csr_to_an_admin(
    api: FakeApiServer, tmp_path: Path
) -> None:
    agent = Agent(agent_config(tmp_path, approve_csrs=None), client=api.client())
    task = asyncio.create_task(agent.run())
    try:
        [name] = await eventually(lambda: pending_csrs(api))
        await always(
            lambda: not (api.get("certificatesigningrequests", name) or {}).get("status"),
            duration=0.5,
            what="the CSR stays unapproved",
        )
    finally:
        await cancel_and_wait(task)


class ClosingMock(MockProvider):
    def __init__(self, name: str, closed: list[str]) -> None:
        super().__init__(name, MockConfig())
        self._closed = closed

    async def aclose(self) -> None:
        self._closed.append(self.node_name)


class ClosingFleet:
    def __init__(self, closed: list[str]) -> None:
        self.closed = closed
        self.members = [FleetNode(n, ClosingMock(n, closed)) for n in ("dev-1", "dev-2")]

    async def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        yield self.members
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.append("fleet")


async def test_stopping_the_agent_closes_every_provider_once(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []

    def build(spec: NodeSpec, events: object) -> object:
        if spec.settings.name == "lab":
            return ClosingFleet(closed)
        return ClosingMock(spec.settings.name, closed)

    monkeypatch.setattr(vkubelet.agent._providers, "build_provider", build)
    config = agent_config(tmp_path, "vk-a", "lab", kubelet_api=False)
    task = asyncio.create_task(Agent(config, client=api.client()).run())
    await eventually(lambda: all(lease_of(api, n) for n in ("vk-a", "dev-1", "dev-2")))
    assert closed == []
    await cancel_and_wait(task)
    assert sorted(closed) == ["dev-1", "dev-2", "fleet", "vk-a"]


made: list[ProviderContext] = []


def factory(context: ProviderContext) -> MockProvider:
    """Loaded by the agent as `tests.unit.agent.test_agent:factory`."""
    made.append(context)
    return MockProvider(context.node_name, MockConfig())


async def test_a_providers_events_reach_the_recorder_of_the_pods_node(
    api: FakeApiServer, tmp_path: Path
) -> None:
    made.clear()
    config = agent_config(tmp_path, "vk-a", "vk-b", kubelet_api=False)
    for spec in config.nodes:
        spec.settings.provider = f"{__name__}:factory"
    task = asyncio.create_task(Agent(config, client=api.client()).run())
    try:
        await eventually(lambda: lease_of(api, "vk-a") and lease_of(api, "vk-b"))
        events = made[0].events
        pod = Pod(
            metadata=ObjectMeta(name="p", namespace="shop", uid="u-1"),
            spec=PodSpec(containers=[], nodeName="vk-b"),
        )
        events.pod_event(pod, "Warning", "Overheated", "the board is hot")
        events.node_event("vk-a", "Normal", "Rebooted", "the board rebooted")

        def by_reason() -> dict[str, JSON]:
            return {e["reason"]: e for e in api.objects("events")}

        await eventually(lambda: by_reason().keys() >= {"Overheated", "Rebooted"})
        found = by_reason()
        assert found["Overheated"]["involvedObject"]["name"] == "p"
        assert found["Overheated"]["source"]["host"] == "vk-b"
        assert found["Rebooted"]["involvedObject"]["kind"] == "Node"
        assert found["Rebooted"]["source"]["host"] == "vk-a"
    finally:
        await cancel_and_wait(task)


async def test_a_failed_renewal_leaves_the_kubelet_api_serving_and_never_rebinds(
    api: FakeApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(vkubelet.node._certs, "RENEW_RETRY_SECONDS", 0.05)
    caplog.set_level(logging.INFO)
    agent = Agent(agent_config(tmp_path), client=api.client())
    port = agent.config.nodes[0].settings.kubelet_port
    task = asyncio.create_task(agent.run())
    try:
        # Certificates of 4 s: renewed about 3 s after they were signed.
        async with signer(api, TestCA("cluster"), only_approved=False, seconds=4):
            await eventually(lambda: ready(api).get("status") == "True", what="Ready")
            api.fail("POST", "certificatesigningrequests$", status=500, times=3)
            await eventually(
                lambda: len(api.objects("certificatesigningrequests")) >= 2,
                within=15,
                what="renewed after the failures",
            )
            await eventually(lambda: "serving certificate renewed" in caplog.text, within=5)
        assert answers(port)
        assert ready(api)["status"] == "True"
        assert "renewal failed" in caplog.text
        assert "address already in use" not in caplog.text.lower()
        assert len(agent.servers) == 1
    finally:
        await cancel_and_wait(task)


def publish_client_ca(api: FakeApiServer) -> None:
    """The ConfigMap the apiserver publishes its client CA in, as a kubelet reads it."""
    api.create(
        "configmaps",
        {
            "metadata": {"name": "extension-apiserver-authentication", "namespace": "kube-system"},
            "data": {"client-ca-file": TestCA("clients").pem.decode()},
        },
    )


async def test_the_client_ca_file_is_one_per_process_and_removed_at_the_end(
    api: FakeApiServer,
) -> None:
    publish_client_ca(api)
    client_ca = ClientCA(None)
    client = api.client()
    try:
        first = await client_ca.file(client)
        second = await client_ca.file(client)
        assert first is not None and first == second
        assert list(first.parent.iterdir()) == [first]
        client_ca.close()
        assert not first.parent.exists()
    finally:
        await client.aclose()


async def test_kubelet_ports_starting_together_share_one_read_of_the_client_ca(
    api: FakeApiServer,
) -> None:
    publish_client_ca(api)
    client_ca = ClientCA(None)
    client = api.client()
    try:
        paths = await asyncio.gather(*(client_ca.file(client) for _ in range(10)))
        assert len(set(paths)) == 1 and paths[0] is not None
        reads = api.calls_to("GET", "/configmaps/extension-apiserver-authentication$")
        assert len(reads) == 1
        await client_ca.file(client)  # a later call (a retry) reads it again
        assert len(api.calls_to("GET", "/configmaps/extension-apiserver-authentication$")) == 2
    finally:
        client_ca.close()
        await client.aclose()


async def test_a_provider_closed_then_freed_does_not_stop_a_later_one_from_being_closed(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """Claimed nodes and fleet members build and close a provider each time: CPython hands a
    freed object's id to a later one, which must still be closed (once)."""

    class Counting:
        closes = 0

        async def aclose(self) -> None:
            Counting.closes += 1

    agent = Agent(agent_config(tmp_path), client=api.client())
    first = Counting()
    await agent.close_provider(first)
    await agent.close_provider(first)  # once only
    assert Counting.closes == 1
    del first
    gc.collect()
    for _ in range(50):  # many of them reuse the freed id
        later = Counting()
        await agent.close_provider(later)
        del later
    assert Counting.closes == 51
