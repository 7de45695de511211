"""The node controller against the fake apiserver: registration of the Node and its Lease,
co-existence with other actors' labels, taints and conditions, health-driven lease renewals and
re-registration of a deleted Node. Also the agent serving several nodes in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import pytest
from lightkube.models.core_v1 import Taint
from lightkube.resources.core_v1 import Node

from vkubelet.agent import Agent
from vkubelet.node import AgentConfig, NodeSettings, NodeSpec
from vkubelet.node._nodecontroller import LEASE_NAMESPACE, NodeController, merge_conditions
from vkubelet.providers.mock import MockConfig, MockProvider
from vkubelet.sdk import NodeCondition
from vkubelet.testing.fakeapi import JSON, FakeApiServer

from .helpers import (
    NODE,
    NS,
    always,
    cancel_and_wait,
    conditions,
    eventually,
    lease_of,
    node_of,
    phase_of,
    pod,
    settings,
)


class NodeHarness:
    def __init__(self, api: FakeApiServer, node_settings: NodeSettings, provider: object) -> None:
        self.client = api.client()
        self.controller = NodeController(self.client, node_settings, provider)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NodeController:
        self._task = asyncio.create_task(self.controller.run())
        await asyncio.wait_for(self.controller.registered.wait(), 5)
        return self.controller

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        crashed = self._task.done() and not self._task.cancelled()
        await cancel_and_wait(self._task)
        await self.client.aclose()
        if crashed and exc is None:
            self._task.result()


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


def taint_ids(api: FakeApiServer) -> set[str]:
    return {
        f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in node_of(api)["spec"]["taints"]
    }


def renewals(api: FakeApiServer, name: str = NODE) -> int:
    return len(api.calls_to("PATCH", f"/namespaces/{LEASE_NAMESPACE}/leases/{name}$"))


async def test_registration_creates_the_node_and_its_lease(api: FakeApiServer) -> None:
    mock = MockProvider(NODE, MockConfig(cpu="8", memory="32Gi", pods="500", others={"gpu": "1"}))
    async with NodeHarness(api, settings(kubelet_port=10555), mock) as controller:
        node = node_of(api)
        labels = node["metadata"]["labels"]
        assert labels["type"] == "virtual-kubelet"
        assert labels["kubernetes.io/role"] == "agent"
        assert labels["kubernetes.io/hostname"] == NODE
        assert labels["kubernetes.io/os"] == "linux"
        assert labels["kubernetes.io/arch"] == "amd64"
        assert node["spec"]["taints"] == [
            {"key": "virtual-kubelet.io/provider", "value": "mock", "effect": "NoSchedule"}
        ]
        status = node["status"]
        assert status["capacity"] == {"cpu": "8", "memory": "32Gi", "pods": "500", "gpu": "1"}
        assert status["allocatable"] == status["capacity"]
        assert status["daemonEndpoints"]["kubeletEndpoint"]["Port"] == 10555
        assert status["addresses"] == [{"type": "InternalIP", "address": "127.0.0.1"}]
        assert status["nodeInfo"]["kubeletVersion"]
        ready = conditions(api)["Ready"]
        assert (ready["status"], ready["reason"]) == ("True", "KubeletReady")
        assert {"MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"} <= set(
            conditions(api)
        )
        assert controller.uid == node["metadata"]["uid"]

        # The lease loop starts beside registration: on a loaded machine its first write may
        # come a moment after the node's.
        lease = await eventually(lambda: lease_of(api), what="the node's Lease")
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == NODE
        assert lease["spec"]["leaseDurationSeconds"] == 40
        assert lease["spec"]["renewTime"]
        [owner] = lease["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": controller.uid}

        # (whether renewals come on time is a benchmark's figure: at a 50 ms interval a
        # loaded CI machine makes some late, which says nothing about the code)
        await eventually(lambda: renewals(api) >= 3, what="lease renewals")


async def test_the_taint_can_be_replaced_or_removed(api: FakeApiServer) -> None:
    taint = {"key": "example.com/virtual", "effect": "NoExecute"}
    async with NodeHarness(api, settings(taints=[taint]), MockProvider(NODE, MockConfig())):
        assert node_of(api)["spec"]["taints"] == [taint]
    async with NodeHarness(api, settings(taints=[]), MockProvider(NODE, MockConfig())):
        assert node_of(api)["spec"].get("taints") in (None, [])


async def test_others_labels_taints_and_conditions_survive_a_restart(api: FakeApiServer) -> None:
    first = settings(labels={"zone": "a", "pool": "blue"})
    async with NodeHarness(api, first, MockProvider(NODE, MockConfig())):
        pass
    # Meanwhile an admin and the control plane edit the node.
    node = node_of(api)
    api.patch(
        "nodes",
        NODE,
        {
            "metadata": {"labels": {"team": "payments"}, "annotations": {"note": "keep me"}},
            "spec": {
                "taints": [
                    *node["spec"]["taints"],
                    {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
                    {"key": "example.com/dedicated", "value": "ml", "effect": "NoSchedule"},
                ]
            },
        },
    )
    api.patch(
        "nodes",
        NODE,
        {"status": {"conditions": [{"type": "ExternalCheck", "status": "True"}]}},
        strategic=True,
        subresource="status",
    )
    second = settings(
        labels={"zone": "b"}, taints=[{"key": "example.com/virtual", "effect": "NoSchedule"}]
    )
    async with NodeHarness(api, second, MockProvider(NODE, MockConfig())):
        await asyncio.sleep(0.3)  # a status update or two
        labels = node_of(api)["metadata"]["labels"]
        assert labels["team"] == "payments", "someone else's label"
        assert labels["zone"] == "b", "ours, changed"
        assert "pool" not in labels, "ours, no longer wanted"
        assert node_of(api)["metadata"]["annotations"]["note"] == "keep me"
        assert taint_ids(api) == {
            "node.kubernetes.io/unreachable=:NoExecute",
            "example.com/dedicated=ml:NoSchedule",
            "example.com/virtual=:NoSchedule",
        }
        assert conditions(api)["ExternalCheck"]["status"] == "True"
        assert conditions(api)["Ready"]["status"] == "True"


async def test_a_restart_that_finds_the_node_as_it_left_it_writes_only_status_and_lease(
    api: FakeApiServer,
) -> None:
    async with NodeHarness(api, settings(renew_interval=60), MockProvider(NODE, MockConfig())):
        pass
    api.calls.clear()
    controller = NodeController(api.client(), settings(), MockProvider(NODE, MockConfig()))
    await controller.register()
    writes = [(c.method, c.path) for c in api.calls if c.method != "GET"]
    assert writes == [
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
        ("PATCH", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{NODE}"),
    ]
    assert controller.uid == node_of(api)["metadata"]["uid"]


async def test_a_restart_points_a_lease_left_by_an_earlier_node_at_the_current_one(
    api: FakeApiServer,
) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        pass
    owners = [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "an-earlier-node"}]
    api.patch("leases", NODE, {"metadata": {"ownerReferences": owners}}, LEASE_NAMESPACE)
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        lease = lease_of(api)
        assert lease is not None
        assert lease["metadata"]["ownerReferences"][0]["uid"] == node_of(api)["metadata"]["uid"]


async def test_a_restart_creates_a_lease_that_is_gone(api: FakeApiServer) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        pass
    api.delete("leases", NODE, LEASE_NAMESPACE)
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        assert lease_of(api) is not None


async def test_taking_over_a_node_retries_on_a_conflicting_write(api: FakeApiServer) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        pass
    client = api.client()
    controller = NodeController(
        client, settings(labels={"zone": "c"}), MockProvider(NODE, MockConfig())
    )
    original = client.get

    async def get_then_race(path: str, params: object = None) -> JSON:
        result = await original(path)
        if path.endswith(f"/nodes/{NODE}") and "raced" not in result["metadata"].get("labels", {}):
            api.patch("nodes", NODE, {"metadata": {"labels": {"raced": "yes"}}})
        return result

    client.get = get_then_race  # type: ignore[method-assign]
    try:
        await controller.register()
    finally:
        await client.aclose()
    labels = node_of(api)["metadata"]["labels"]
    assert labels["zone"] == "c" and labels["raced"] == "yes"


async def test_status_is_updated_periodically(api: FakeApiServer) -> None:
    async with NodeHarness(api, settings(status_interval=0.05), MockProvider(NODE, MockConfig())):
        before = len(api.calls_to("PATCH", f"/nodes/{NODE}/status$"))
        await eventually(lambda: len(api.calls_to("PATCH", f"/nodes/{NODE}/status$")) >= before + 3)


class PushingNode:
    """A node provider that pushes a capacity change."""

    def __init__(self) -> None:
        self.cpu = "4"
        self.callback: Callable[[Node], None] | None = None

    async def ping(self) -> None:
        pass

    def configure_node(self, node: Node) -> None:
        assert node.status is not None
        node.status.capacity = {"cpu": self.cpu, "memory": "8Gi", "pods": "110"}

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self.callback = callback


async def test_a_node_status_push_is_written_at_once(api: FakeApiServer) -> None:
    provider = PushingNode()
    async with NodeHarness(api, settings(status_interval=60), provider) as controller:
        assert node_of(api)["status"]["capacity"]["cpu"] == "4"
        assert provider.callback is not None
        provider.cpu = "16"
        provider.callback(Node())
        await eventually(lambda: node_of(api)["status"]["capacity"]["cpu"] == "16", within=2)
        assert controller.allocatable["cpu"] == "16"


class LabellingNode:
    """A node provider whose published labels change after registration."""

    def __init__(self) -> None:
        self.labels = {"topology.kubernetes.io/region": "eu", "disk": "ssd"}
        self.callback: Callable[[Node], None] | None = None

    def configure_node(self, node: Node) -> None:
        assert node.metadata is not None
        node.metadata.labels = {**(node.metadata.labels or {}), **self.labels}

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self.callback = callback


async def test_provider_labels_follow_the_provider_and_leave_an_admins_labels_alone(
    api: FakeApiServer,
) -> None:
    provider = LabellingNode()
    async with NodeHarness(api, settings(status_interval=60), provider):
        assert node_of(api)["metadata"]["labels"]["disk"] == "ssd"
        api.patch("nodes", NODE, {"metadata": {"labels": {"team": "payments"}}})
        assert provider.callback is not None
        provider.labels = {"topology.kubernetes.io/region": "us", "gpu": "a100"}
        provider.callback(Node())

        def relabelled() -> bool:
            labels = node_of(api)["metadata"]["labels"]
            return labels.get("topology.kubernetes.io/region") == "us" and "disk" not in labels

        await eventually(relabelled, within=2)
        node = node_of(api)
        assert node["metadata"]["labels"]["gpu"] == "a100"
        assert node["metadata"]["labels"]["team"] == "payments", "an admin's label"
        assert node["metadata"]["labels"]["type"] == "virtual-kubelet", "the agent's own"
        managed = node["metadata"]["annotations"]["vkubelet.io/managed-labels"].split(",")
        assert "gpu" in managed and "disk" not in managed and "team" not in managed


class AnnotatingNode:
    """A node provider whose annotations, taints and cordon change after registration."""

    def __init__(self) -> None:
        self.annotations = {"example.com/free": "2"}
        self.taints: list[dict[str, str]] = []
        self.unschedulable: bool | None = None
        self.callback: Callable[[Node], None] | None = None

    def configure_node(self, node: Node) -> None:
        assert node.metadata is not None and node.spec is not None
        node.metadata.annotations = {**(node.metadata.annotations or {}), **self.annotations}
        node.spec.taints = [
            *(node.spec.taints or []),
            *(Taint(key=t["key"], effect=t["effect"]) for t in self.taints),
        ]
        if self.unschedulable is not None:
            node.spec.unschedulable = self.unschedulable

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self.callback = callback


async def test_provider_annotations_taints_and_cordon_follow_the_provider_and_leave_others_alone(
    api: FakeApiServer,
) -> None:
    provider = AnnotatingNode()  # (a fleet member's mirror of a lower node, say)
    async with NodeHarness(api, settings(status_interval=60), provider):
        assert node_of(api)["metadata"]["annotations"]["example.com/free"] == "2"
        api.patch(
            "nodes",
            NODE,
            {
                "metadata": {"annotations": {"team": "payments"}},
                "spec": {"taints": [*node_of(api)["spec"]["taints"], ADMIN_TAINT]},
            },
        )
        assert provider.callback is not None
        provider.annotations = {"example.com/other": "x"}
        provider.taints = [{"key": "example.com/backoff", "effect": "NoSchedule"}]
        provider.unschedulable = True
        provider.callback(Node())

        def followed() -> bool:
            node = node_of(api)
            return (
                "example.com/free" not in node["metadata"]["annotations"]
                and node["spec"].get("unschedulable") is True
                and any(t["key"] == "example.com/backoff" for t in node["spec"]["taints"])
            )

        await eventually(followed, within=2)
        node = node_of(api)
        assert node["metadata"]["annotations"]["example.com/other"] == "x"
        assert node["metadata"]["annotations"]["team"] == "payments", "an admin's annotation"
        assert "admin:NoSchedule" in {f"{t['key']}:{t['effect']}" for t in node["spec"]["taints"]}
        assert any(t["key"] == "virtual-kubelet.io/provider" for t in node["spec"]["taints"])

        # An admin's uncordon stands while the provider's statement does not change.
        api.patch("nodes", NODE, {"spec": {"unschedulable": False}})
        provider.taints = []
        provider.callback(Node())
        await eventually(
            lambda: (
                not any(t["key"] == "example.com/backoff" for t in node_of(api)["spec"]["taints"])
            ),
            within=2,
        )
        assert node_of(api)["spec"].get("unschedulable") is False
        taints = node_of(api)["spec"]["taints"]
        assert "admin:NoSchedule" in {f"{t['key']}:{t['effect']}" for t in taints}


ADMIN_TAINT = {"key": "admin", "effect": "NoSchedule"}


async def test_a_failing_ping_stops_lease_renewals_until_it_recovers(
    api: FakeApiServer, tmp_path: Path
) -> None:
    sick = tmp_path / "sick"
    mock = MockProvider(NODE, MockConfig(ping_fail_file=sick))
    async with NodeHarness(api, settings(), mock) as controller:
        await eventually(lambda: renewals(api) >= 2)
        sick.touch()
        await eventually(lambda: conditions(api)["Ready"]["status"] == "False", what="NotReady")
        assert conditions(api)["Ready"]["reason"] == "ProviderUnhealthy"
        assert "unhealthy" in conditions(api)["Ready"]["message"]
        stopped_at = renewals(api)
        lease = lease_of(api)
        assert lease is not None
        await always(lambda: renewals(api) <= stopped_at + 1, duration=0.4, what="no renewals")
        sick.unlink()
        await eventually(lambda: conditions(api)["Ready"]["status"] == "True", what="Ready again")
        await eventually(lambda: renewals(api) >= stopped_at + 3, what="renewals again")
        assert controller.healthy


class EveryOtherPingTimesOut:
    """A backend too busy to answer one ping in two (a burst), never down for two in a row."""

    def __init__(self) -> None:
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        if self.pings % 2:
            await asyncio.sleep(1)  # beyond the ping timeout

    def configure_node(self, node: Node) -> None:
        pass


async def test_one_slow_ping_at_a_time_never_stops_lease_renewals(api: FakeApiServer) -> None:
    busy = EveryOtherPingTimesOut()
    async with NodeHarness(api, settings(ping_timeout=0.05), busy) as controller:
        await eventually(lambda: busy.pings >= 2)
        await always(lambda: controller.healthy, duration=0.6, what="still healthy")
        assert busy.pings >= 6  # the window held several slow pings
        assert conditions(api)["Ready"]["status"] == "True"


async def test_a_deleted_node_is_registered_again(api: FakeApiServer) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())) as controller:
        old_uid = node_of(api)["metadata"]["uid"]
        api.delete("nodes", NODE)
        api.collect_garbage()  # the Lease, owned by the Node, goes with it
        assert lease_of(api) is None

        def registered_again() -> bool:
            node = api.get("nodes", NODE)
            lease = lease_of(api)
            return (
                node is not None
                and node["metadata"]["uid"] != old_uid
                and lease is not None
                and lease["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
            )

        await eventually(registered_again, within=3, what="the node and lease to be back")
        assert controller.uid == node_of(api)["metadata"]["uid"]
        assert conditions(api)["Ready"]["status"] == "True"
        assert node_of(api)["metadata"]["labels"]["type"] == "virtual-kubelet"


async def test_registration_waits_for_an_unreachable_apiserver(api: FakeApiServer) -> None:
    client = api.client()
    controller = NodeController(client, settings(), MockProvider(NODE, MockConfig()))
    with api.down():
        task = asyncio.create_task(controller.run())
        await asyncio.sleep(0.3)
        assert not task.done()
        assert not controller.registered.is_set()
    try:
        await asyncio.wait_for(controller.registered.wait(), 5)
        assert lease_of(api) is not None
        with api.down():  # a later outage is survived too
            await asyncio.sleep(0.2)
        before = renewals(api)
        await eventually(lambda: renewals(api) > before)
        assert not task.done()
    finally:
        await cancel_and_wait(task)
        await client.aclose()


async def test_one_agent_serves_several_nodes(api: FakeApiServer) -> None:
    nodes = [
        NodeSpec(settings(name="vk-a", labels={"zone": "a"})),
        NodeSpec(settings(name="vk-b", taints=[])),
    ]
    agent = Agent(AgentConfig(nodes=nodes, workers=4, kubelet_api=False), client=api.client())
    task = asyncio.create_task(agent.run())
    try:
        await eventually(
            lambda: lease_of(api, "vk-a") is not None and lease_of(api, "vk-b") is not None,
            what="both nodes registered",
        )
        assert node_of(api, "vk-a")["metadata"]["labels"]["zone"] == "a"
        assert node_of(api, "vk-b")["spec"].get("taints") in (None, [])
        api.create("pods", pod("on-a", node="vk-a"))
        api.create("pods", pod("on-b", node="vk-b"))
        await eventually(lambda: phase_of(api, "on-a") == phase_of(api, "on-b") == "Running")
        assert api.get("pods", "on-a", NS) is not None
        assert not task.done()
    finally:
        await cancel_and_wait(task)


class InstantPing:
    """A healthy backend whose ping answers at once."""

    async def ping(self) -> None:
        pass

    def configure_node(self, node: Node) -> None:
        pass


async def test_cancelling_the_node_controller_stops_it(api: FakeApiServer) -> None:
    client = api.client()
    try:
        for _ in range(20):
            controller = NodeController(client, settings(ping_interval=0.0), InstantPing())
            task = asyncio.create_task(controller.run())
            await asyncio.wait_for(controller.registered.wait(), 5)
            await asyncio.sleep(0.01)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not done:
                await cancel_and_wait(task)
            assert done, "the node controller ignored its cancellation"
    finally:
        await client.aclose()


# -- conditions (issue 9) -------------------------------------------------------------------------
async def test_conditions_use_the_kubelets_words_and_carry_both_times(api: FakeApiServer) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        found = conditions(api)
        assert found["Ready"]["message"] == "kubelet is posting ready status"
        assert found["MemoryPressure"]["reason"] == "KubeletHasSufficientMemory"
        assert found["MemoryPressure"]["message"] == "kubelet has sufficient memory available"
        assert found["DiskPressure"]["message"] == "kubelet has no disk pressure"
        assert found["PIDPressure"]["message"] == "kubelet has sufficient PID available"
        for condition in found.values():
            assert condition["lastHeartbeatTime"], condition
            assert condition["lastTransitionTime"], condition


class ReportsConditions:
    """A provider stating its own conditions, and pushing when they change."""

    def __init__(self, *stated: NodeCondition) -> None:
        self.stated = list(stated)
        self.callback: Callable[[Node], None] | None = None

    def node_conditions(self) -> list[NodeCondition]:
        return list(self.stated)

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self.callback = callback

    def change(self, *stated: NodeCondition) -> None:
        self.stated = list(stated)
        assert self.callback is not None
        self.callback(Node())


async def test_the_transition_time_changes_only_when_the_status_does(api: FakeApiServer) -> None:
    provider = ReportsConditions(NodeCondition("Accelerator", "True", "KVM", "KVM available"))
    async with NodeHarness(api, settings(status_interval=0.05), provider):
        first = conditions(api)["Accelerator"]
        await eventually(
            lambda: (
                conditions(api)["Accelerator"]["lastHeartbeatTime"] != first["lastHeartbeatTime"]
            ),
            what="a later heartbeat",
        )
        assert conditions(api)["Accelerator"]["lastTransitionTime"] == first["lastTransitionTime"]
        provider.change(NodeCondition("Accelerator", "False", "TCGFallback", "running under TCG"))
        await eventually(lambda: conditions(api)["Accelerator"]["status"] == "False")
        after = conditions(api)["Accelerator"]
        assert after["lastTransitionTime"] > first["lastTransitionTime"]
        assert (after["reason"], after["message"]) == ("TCGFallback", "running under TCG")


async def test_a_providers_not_ready_makes_the_node_not_ready_with_its_reason(
    api: FakeApiServer,
) -> None:
    provider = ReportsConditions(NodeCondition("Ready", "True", "LowerClusterReachable"))
    async with NodeHarness(api, settings(status_interval=60), provider):
        ready = conditions(api)["Ready"]
        assert (ready["status"], ready["reason"]) == ("True", "KubeletReady")
        provider.change(
            NodeCondition("Ready", "False", "LowerClusterUnreachable", "lower cluster unreachable")
        )
        await eventually(lambda: conditions(api)["Ready"]["status"] == "False", within=2)
        ready = conditions(api)["Ready"]
        assert (ready["reason"], ready["message"]) == (
            "LowerClusterUnreachable",
            "lower cluster unreachable",
        )


class ExplainsItsFailingPing(ReportsConditions):
    """A backend whose ping fails and which says why in its own Ready condition, as the
    cluster provider does when its lower apiserver does not answer."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    async def ping(self) -> None:
        if self.failing:
            raise ConnectionError("connection refused")

    def node_conditions(self) -> list[NodeCondition]:
        if not self.failing:
            return []
        return [NodeCondition("Ready", "False", "LowerClusterUnreachable", "lower cluster down")]


async def test_a_failing_ping_shows_the_providers_own_not_ready_reason(api: FakeApiServer) -> None:
    provider = ExplainsItsFailingPing()
    async with NodeHarness(api, settings(), provider):
        assert conditions(api)["Ready"]["status"] == "True"
        provider.failing = True
        await eventually(lambda: conditions(api)["Ready"]["status"] == "False", what="NotReady")
        ready = conditions(api)["Ready"]
        assert (ready["reason"], ready["message"]) == (
            "LowerClusterUnreachable",
            "lower cluster down",
        )
        provider.failing = False
        await eventually(lambda: conditions(api)["Ready"]["status"] == "True", what="Ready again")


class Serving:
    def __init__(self) -> None:
        self.serving = False

    def node_conditions(self) -> list[NodeCondition]:
        if self.serving:
            return []
        return [NodeCondition("Ready", "False", "KubeletNotServing", "kubelet API not serving yet")]


async def test_extra_conditions_are_merged_like_the_providers(api: FakeApiServer) -> None:
    extra = Serving()
    client = api.client()
    controller = NodeController(
        client,
        settings(status_interval=0.05),
        MockProvider(NODE, MockConfig()),
        extra_conditions=[extra],
    )
    task = asyncio.create_task(controller.run())
    try:
        await eventually(lambda: api.get("nodes", NODE) is not None, what="registration")
        ready = conditions(api)["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "KubeletNotServing")
        extra.serving = True
        await eventually(lambda: conditions(api)["Ready"]["status"] == "True", what="Ready")
    finally:
        await cancel_and_wait(task)
        await client.aclose()


async def test_the_transition_times_of_an_existing_node_survive_an_agent_restart(
    api: FakeApiServer,
) -> None:
    async with NodeHarness(api, settings(), MockProvider(NODE, MockConfig())):
        assert conditions(api)["Ready"]["lastTransitionTime"]
    long_ago = "2020-01-01T00:00:00Z"
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": long_ago}
    api.patch(
        "nodes", NODE, {"status": {"conditions": [ready]}}, strategic=True, subresource="status"
    )
    async with NodeHarness(api, settings(status_interval=0.05), MockProvider(NODE, MockConfig())):
        heartbeat = conditions(api)["Ready"]["lastHeartbeatTime"]
        await eventually(
            lambda: conditions(api)["Ready"]["lastHeartbeatTime"] != heartbeat,
            what="a later heartbeat",
        )
        assert conditions(api)["Ready"]["lastTransitionTime"] == long_ago


def test_merging_keeps_the_first_problem_and_otherwise_the_agents_view() -> None:
    own = [
        NodeCondition("Ready", "True", "KubeletReady"),
        NodeCondition("DiskPressure", "False", "Ok"),
    ]
    provider = [
        NodeCondition("Ready", "True", "ProviderReady"),
        NodeCondition("DiskPressure", "True", "DiskFull", "the backend's disk is full"),
        NodeCondition("Accelerator", "False", "TCGFallback"),
    ]
    extra = [
        NodeCondition("Ready", "False", "NotServing"),
        NodeCondition("DiskPressure", "False", "x"),
    ]
    merged = {c.type: c for c in merge_conditions(own, provider, extra)}
    assert merged["Ready"].reason == "NotServing"
    assert merged["DiskPressure"].reason == "DiskFull"
    assert merged["Accelerator"].status == "False"


async def test_a_condition_the_provider_no_longer_states_is_removed(api: FakeApiServer) -> None:
    provider = ReportsConditions(NodeCondition("Accelerator", "False", "TCGFallback"))
    async with NodeHarness(api, settings(status_interval=60), provider):
        assert "Accelerator" in conditions(api)
        provider.change()
        await eventually(lambda: "Accelerator" not in conditions(api), within=2)
        assert conditions(api)["Ready"]["status"] == "True"
