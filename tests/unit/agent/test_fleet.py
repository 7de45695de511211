"""A fleet provider: nodes that come and go with the provider's inventory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

import vkubelet.agent._fleet
import vkubelet.agent._providers
from vkubelet.agent import Agent
from vkubelet.node import AgentConfig, FleetNode, NodeSpec
from vkubelet.providers.mock import MockConfig, MockProvider
from vkubelet.testing.fakeapi import FakeApiServer

from ..node.helpers import (
    NS,
    always,
    cancel_and_wait,
    eventually,
    lease_of,
    phase_of,
    pod,
    settings,
)


class Fleet:
    """A fleet whose members the test sets; each change is published at once."""

    def __init__(self) -> None:
        self.members: list[FleetNode] = []
        self._changed = asyncio.Event()

    def publish(self, members: list[FleetNode]) -> None:
        self.members = members
        self._changed.set()

    async def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        while True:
            await self._changed.wait()
            self._changed.clear()
            yield list(self.members)


def member(name: str, **labels: str) -> FleetNode:
    return FleetNode(name=name, provider=MockProvider(name, MockConfig()), labels=labels)


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> Fleet:
    made = Fleet()
    monkeypatch.setattr(vkubelet.agent._fleet, "DRAIN_POLL_SECONDS", 0.05)
    monkeypatch.setattr(vkubelet.agent._providers, "build_provider", lambda spec, events: made)
    return made


async def start(api: FakeApiServer) -> asyncio.Task[None]:
    config = AgentConfig(nodes=[NodeSpec(settings(name="lab"))], workers=4, kubelet_api=False)
    agent = Agent(config, client=api.client())
    return asyncio.create_task(agent.run())


async def test_each_member_of_a_fleet_becomes_a_node_with_its_labels(
    api: FakeApiServer, fleet: Fleet
) -> None:
    task = await start(api)
    try:
        fleet.publish([member("dev-a", model="rpi4"), member("dev-b")])
        await eventually(
            lambda: lease_of(api, "dev-a") and lease_of(api, "dev-b"), what="both registered"
        )
        assert api.get("nodes", "dev-a")["metadata"]["labels"]["model"] == "rpi4"  # type: ignore[index]
        assert api.get("nodes", "lab") is None  # the fleet's own name is no node
        api.create("pods", pod("on-b", node="dev-b"))
        await eventually(lambda: phase_of(api, "on-b") == "Running")
    finally:
        await cancel_and_wait(task)


async def test_a_member_that_leaves_is_cordoned_drained_then_deleted(
    api: FakeApiServer, fleet: Fleet
) -> None:
    task = await start(api)
    try:
        a, b = member("dev-a"), member("dev-b")
        fleet.publish([a, b])
        await eventually(lambda: lease_of(api, "dev-a") and lease_of(api, "dev-b"))
        api.create("pods", pod("on-a", node="dev-a"))
        await eventually(lambda: phase_of(api, "on-a") == "Running")
        fleet.publish([b])
        await eventually(
            lambda: (api.get("nodes", "dev-a") or {}).get("spec", {}).get("unschedulable"),
            what="dev-a cordoned",
        )
        await eventually(lambda: api.get("pods", "on-a", NS) is None, within=15)
        await eventually(lambda: api.get("nodes", "dev-a") is None, within=10, what="node deleted")
        assert api.get("nodes", "dev-b") is not None
        assert not task.done()
    finally:
        await cancel_and_wait(task)


async def test_a_changed_member_keeps_its_node_and_pods(api: FakeApiServer, fleet: Fleet) -> None:
    task = await start(api)
    try:
        provider = MockProvider("dev-a", MockConfig())
        fleet.publish([FleetNode("dev-a", provider, labels={"v": "1"})])
        await eventually(lambda: lease_of(api, "dev-a"))
        api.create("pods", pod("p", node="dev-a"))
        await eventually(lambda: phase_of(api, "p") == "Running")
        fleet.publish([FleetNode("dev-a", provider, labels={"v": "2"})])
        await eventually(
            lambda: api.get("nodes", "dev-a")["metadata"]["labels"].get("v") == "2"  # type: ignore[index]
        )
        assert api.get("pods", "p", NS) is not None
        assert provider.creates == 1
    finally:
        await cancel_and_wait(task)


async def test_a_drain_that_waits_does_not_hold_up_the_rest_of_the_fleet(
    api: FakeApiServer, fleet: Fleet
) -> None:
    """A disruption budget refuses the eviction of dev-a's pod: dev-a's drain waits, and even
    with dev-a back in the inventory (to start once its old node is gone), dev-b leaves and is
    drained and dev-c joins meanwhile."""
    task = await start(api)
    try:
        a, b = member("dev-a"), member("dev-b")
        fleet.publish([a, b])
        await eventually(lambda: lease_of(api, "dev-a") and lease_of(api, "dev-b"))
        api.create("pods", pod("guarded", node="dev-a"))
        await eventually(lambda: phase_of(api, "guarded") == "Running")
        api.fail("POST", "/pods/guarded/eviction$", status=429, times=None)
        fleet.publish([b])
        await eventually(lambda: api.calls_to("POST", "/pods/guarded/eviction$"), what="evicting")
        a_again = member("dev-a")
        fleet.publish([b, a_again])
        fleet.publish([a_again, member("dev-c")])
        await eventually(lambda: lease_of(api, "dev-c"), what="dev-c registered meanwhile")
        await eventually(lambda: api.get("nodes", "dev-b") is None, what="dev-b drained")
        assert api.get("nodes", "dev-a") is not None  # still draining
        assert api.get("pods", "guarded", NS) is not None
    finally:
        await cancel_and_wait(task)


async def test_daemonset_pods_neither_get_evicted_nor_block_the_drain(
    api: FakeApiServer, fleet: Fleet
) -> None:
    task = await start(api)
    try:
        fleet.publish([member("dev-a")])
        await eventually(lambda: lease_of(api, "dev-a"))
        daemon = pod("daemon", node="dev-a")
        daemon["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "name": "agent",
                "uid": "ds-1",
                "controller": True,
            }
        ]
        api.create("pods", daemon)
        api.create("pods", pod("app", node="dev-a"))
        await eventually(lambda: phase_of(api, "daemon") == "Running")
        await eventually(lambda: phase_of(api, "app") == "Running")
        fleet.publish([])
        await eventually(lambda: api.get("nodes", "dev-a") is None, within=10, what="deleted")
        assert api.calls_to("POST", "/pods/app/eviction$")
        assert not api.calls_to("POST", "/pods/daemon/eviction$")
    finally:
        await cancel_and_wait(task)


async def test_a_member_back_while_its_node_drains_starts_again_after_the_drain(
    api: FakeApiServer, fleet: Fleet
) -> None:
    task = await start(api)
    try:
        fleet.publish([member("dev-a")])
        await eventually(lambda: lease_of(api, "dev-a"))
        api.create("pods", pod("guarded", node="dev-a"))
        await eventually(lambda: phase_of(api, "guarded") == "Running")
        api.fail("POST", "/pods/guarded/eviction$", status=429, times=3)
        fleet.publish([])
        await eventually(lambda: api.calls_to("POST", "/pods/guarded/eviction$"))
        back = member("dev-a", again="yes")
        fleet.publish([back])
        await eventually(
            lambda: (
                (api.get("nodes", "dev-a") or {}).get("metadata", {}).get("labels", {}).get("again")
                == "yes"
            ),
            within=10,
            what="dev-a registered again by its new member",
        )
        await always(lambda: not task.done(), duration=0.2)
    finally:
        await cancel_and_wait(task)


class FlakyFleet(Fleet):
    """Its inventory cannot be read the first time (a half-written file, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1

    async def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("inventory unreadable")
        async for members in super().watch_nodes():
            yield members


async def test_a_failing_fleet_watch_is_logged_and_restarted_not_fatal(
    api: FakeApiServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyFleet()
    monkeypatch.setattr(vkubelet.agent._providers, "build_provider", lambda spec, events: flaky)
    task = await start(api)
    try:
        await eventually(lambda: "inventory unreadable" in caplog.text, what="the failure logged")
        flaky.publish([member("dev-a")])
        await eventually(lambda: lease_of(api, "dev-a"), within=5, what="restarted watch")
        assert not task.done()
    finally:
        await cancel_and_wait(task)
