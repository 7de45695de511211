"""The pod controller against the fake apiserver: pods bound to the node run in the provider and
their status comes back; deletion is prompt; restarts adopt; referenced objects are followed;
one bad pod never stops the others."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
import pytest
from lightkube.models.core_v1 import PodIP, PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ContainerLogOptions, ProviderError
from vkubelet.node import ResolvedPod as ResolvedPodT
from vkubelet.node.resolve import FilesVolume
from vkubelet.providers.mock import PRINT_ENV_ANNOTATION, MockConfig, MockProvider
from vkubelet.sdk.capabilities import AttachIO
from vkubelet.testing.fakeapi import JSON, FakeApiServer

from .helpers import (
    HOST_IP,
    NODE,
    NS,
    PodHarness,
    PollingProvider,
    PushProvider,
    always,
    cancel_and_wait,
    configmap,
    event_reasons,
    events_for,
    eventually,
    phase_of,
    pod,
    status_of,
    status_patches,
    terminated_status,
)


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


@pytest.fixture
def mock() -> MockProvider:
    return MockProvider(NODE, MockConfig(), host_ip=HOST_IP)


@pytest.fixture
async def mock_node(api: FakeApiServer, mock: MockProvider) -> AsyncIterator[PodHarness]:
    async with PodHarness(api, mock) as harness:
        yield harness


@pytest.fixture
def push() -> PushProvider:
    return PushProvider()


@pytest.fixture
async def push_node(api: FakeApiServer, push: PushProvider) -> AsyncIterator[PodHarness]:
    async with PodHarness(api, push) as harness:
        yield harness


def uid_of(api: FakeApiServer, name: str) -> str:
    found = api.get("pods", name, NS)
    assert found is not None
    return str(found["metadata"]["uid"])


def running(api: FakeApiServer, name: str) -> bool:
    return phase_of(api, name) == "Running"


async def logs(mock: MockProvider, name: str, container: str = "app") -> list[str]:
    lines = mock.container_logs(NS, name, container, ContainerLogOptions())
    return [line.decode().rstrip("\n") async for line in lines]


# -- creation and status --------------------------------------------------------------------------
async def test_a_pod_bound_to_the_node_is_created_in_the_provider_and_reported_running(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    api.create("pods", pod("elsewhere", node="other-node"))
    await eventually(lambda: running(api, "web"), what="web Running")
    status = status_of(api, "web")
    assert status["hostIP"] == HOST_IP
    assert ipaddress.ip_address(status["podIP"]) in ipaddress.ip_network("10.244.0.0/16")
    assert status["startTime"]
    [container] = status["containerStatuses"]
    assert container["name"] == "app" and container["ready"] is True
    assert "running" in container["state"]
    ready = {c["type"]: c["status"] for c in status["conditions"]}
    assert ready["Ready"] == "True" and ready["ContainersReady"] == "True"
    assert mock.creates == 1
    assert phase_of(api, "elsewhere") == "Pending"
    await eventually(lambda: "Created" in event_reasons(api, "web"), what="a Created event")
    # the status patch carries the pod's UID as a precondition
    patch = api.calls_to("PATCH", "/pods/web/status$")[-1]
    assert patch.body["metadata"]["uid"] == uid_of(api, "web")


async def test_env_is_resolved_before_the_provider_sees_the_pod(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    api.create("configmaps", configmap("settings", {"mode": "fast"}))
    raw = pod(
        "env",
        containers=[
            {
                "name": "app",
                "image": "registry.test/app:1",
                "resources": {"limits": {"cpu": "2"}},
                "env": [
                    {
                        "name": "MODE",
                        "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}},
                    },
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {
                        "name": "CPUS",
                        "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}},
                    },
                    {"name": "GREETING", "value": "$(NAME) runs in $(MODE) mode"},
                ],
            }
        ],
    )
    raw["metadata"]["annotations"] = {PRINT_ENV_ANNOTATION: "true"}
    api.create("pods", raw)
    await eventually(lambda: running(api, "env"))
    env = dict(line.split("=", 1) for line in await logs(mock, "env") if "=" in line)
    assert env["MODE"] == "fast"
    assert env["NAME"] == "env"
    assert env["CPUS"] == "2"
    assert env["GREETING"] == "env runs in fast mode"
    assert env["POD_IP"] == status_of(api, "env")["podIP"]  # the IP the pod actually got


async def test_status_is_not_rewritten_when_nothing_changed(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"))
    writes = status_patches(api, "web")
    assert writes == 1
    for _ in range(3):
        push.report(f"{NS}/web")  # the provider says the same thing again
    api.patch("pods", "web", {"metadata": {"labels": {"tier": "front"}}}, NS)  # a spec-side sync
    await eventually(lambda: push.count("update") == 1)
    await asyncio.sleep(0.2)
    assert status_patches(api, "web") == writes


async def test_a_status_change_is_written(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"))
    running_pod = push.pods[f"{NS}/web"]
    status = msgspec.to_builtins(running_pod.status)
    status["containerStatuses"][0]["restartCount"] = 1
    running_pod.status = msgspec.convert(status, PodStatus)
    push.report(f"{NS}/web")
    await eventually(lambda: status_of(api, "web")["containerStatuses"][0]["restartCount"] == 1)


async def test_a_new_host_address_replaces_the_old_one_in_the_pods_status(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    """A replica that takes over elsewhere reports another hostIP: a merge by address would
    keep both, which the API refuses (one IP per family)."""
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"))
    assert [h["ip"] for h in status_of(api, "web")["hostIPs"]] == [HOST_IP]
    running_pod = push.pods[f"{NS}/web"]
    status = msgspec.to_builtins(running_pod.status)
    status["hostIP"], status["hostIPs"] = "10.0.0.99", [{"ip": "10.0.0.99"}]
    running_pod.status = msgspec.convert(status, PodStatus)
    push.report(f"{NS}/web")
    await eventually(lambda: status_of(api, "web")["hostIP"] == "10.0.0.99")
    assert status_of(api, "web")["hostIPs"] == [{"ip": "10.0.0.99"}]


async def test_a_condition_that_turns_true_loses_the_reason_it_had_while_false(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"))
    running_pod = push.pods[f"{NS}/web"]

    def report_ready(ready: str, reason: str | None) -> None:
        status = msgspec.to_builtins(running_pod.status)
        ready_condition = {"type": "Ready", "status": ready}
        if reason:
            ready_condition |= {"reason": reason, "message": "containers with unready status"}
        status["conditions"] = [ready_condition]
        running_pod.status = msgspec.convert(status, PodStatus)
        push.report(f"{NS}/web")

    def ready_condition() -> dict[str, str]:
        found = [c for c in status_of(api, "web").get("conditions", []) if c["type"] == "Ready"]
        return found[0] if found else {}

    report_ready("False", "ContainersNotReady")
    await eventually(lambda: ready_condition().get("reason") == "ContainersNotReady")
    report_ready("True", None)
    await eventually(lambda: ready_condition().get("status") == "True")
    assert "reason" not in ready_condition() and "message" not in ready_condition()


async def test_a_status_changed_by_someone_else_is_restored_at_the_next_report(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"))
    # the node-lifecycle controller marks the pods of a NotReady node not ready
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    api.patch("pods", "web", not_ready, NS, strategic=True, subresource="status")
    push.report(f"{NS}/web")  # the node is back; the provider says what it said before

    def ready() -> str:
        return str({c["type"]: c["status"] for c in status_of(api, "web")["conditions"]}["Ready"])

    await eventually(lambda: ready() == "True", what="Ready restored")


async def test_the_mock_start_delay_reports_pending_then_running(api: FakeApiServer) -> None:
    mock = MockProvider(NODE, MockConfig(start_delay=0.3), host_ip=HOST_IP)
    async with PodHarness(api, mock):
        api.create("pods", pod("slow"))

        def waiting() -> bool:
            statuses = status_of(api, "slow").get("containerStatuses") or []
            return bool(statuses) and "waiting" in statuses[0]["state"]

        await eventually(waiting, what="ContainerCreating first")
        assert phase_of(api, "slow") == "Pending"
        await eventually(lambda: running(api, "slow"))


async def test_a_polling_provider_gets_its_status_written(api: FakeApiServer) -> None:
    provider = PollingProvider()
    async with PodHarness(api, provider, poll=0.05):
        api.create("pods", pod("web"))
        await eventually(lambda: running(api, "web"), what="Running through polling")


async def test_many_pods_start_without_a_throttle(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    for i in range(200):
        api.create("pods", pod(f"p-{i}"))
    await eventually(
        lambda: all(running(api, f"p-{i}") for i in range(200)), within=10, what="200 pods"
    )
    assert mock.creates == 200


# -- deletion -------------------------------------------------------------------------------------
async def test_graceful_deletion_removes_the_pod_as_soon_as_its_containers_stopped(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web", grace=30))
    await eventually(lambda: running(api, "web"))
    loop = asyncio.get_running_loop()
    start = loop.time()
    api.delete("pods", "web", NS)  # graceful: the API sets deletionTimestamp, grace 30 s
    await eventually(lambda: api.get("pods", "web", NS) is None, what="the pod to be gone")
    assert loop.time() - start < 2.0, "not after the 30 s grace period"
    assert push.deleted_grace[f"{NS}/web"] == 30
    assert f"{NS}/web" not in push.pods
    final = api.calls_to("DELETE", "/pods/web$")[-1]
    assert final.body["gracePeriodSeconds"] == 0
    assert "Killing" in event_reasons(api, "web")


async def test_graceful_deletion_with_the_mock_provider(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    api.create("pods", pod("web", grace=30))
    await eventually(lambda: running(api, "web"))
    api.delete("pods", "web", NS)
    await eventually(lambda: api.get("pods", "web", NS) is None, within=2)
    assert await mock.get_pod(NS, "web") is None


class StopsOnRequest(PushProvider):
    """Accepts delete_pod at once; the containers stop when the test says so."""

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        self.calls.append(("delete", key))

    def stop(self, key: str) -> None:
        stopping = self.pods[key]
        status = terminated_status(msgspec.to_builtins(stopping.status))
        stopping.status = msgspec.convert(status, PodStatus)
        self._report(stopping)


async def test_a_terminating_pod_stays_while_its_containers_run(api: FakeApiServer) -> None:
    provider = StopsOnRequest()
    async with PodHarness(api, provider):
        api.create("pods", pod("web", grace=30))
        await eventually(lambda: running(api, "web"))
        api.delete("pods", "web", NS)
        await eventually(lambda: provider.count("delete") == 1)
        await always(lambda: api.get("pods", "web", NS) is not None, duration=0.3)
        provider.stop(f"{NS}/web")
        await eventually(lambda: api.get("pods", "web", NS) is None)


async def test_force_delete_stops_the_pod_in_the_provider(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web", grace=30))
    await eventually(lambda: running(api, "web"))
    api.delete("pods", "web", NS, grace=0)  # the object is gone at once
    await eventually(lambda: f"{NS}/web" not in push.pods, what="the provider to stop it")
    assert push.deleted_grace[f"{NS}/web"] == 0


async def test_a_pod_deleted_before_it_ever_ran_is_removed_at_once(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    raw = pod("stuck")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "x"}}}
    ]
    api.create("pods", raw)
    await eventually(lambda: "MandatoryConfigMapNotFound" in event_reasons(api, "stuck"))
    api.delete("pods", "stuck", NS)
    await eventually(lambda: api.get("pods", "stuck", NS) is None, within=2)
    assert push.count("create") == 0


# -- restarts -------------------------------------------------------------------------------------
async def test_a_restarted_agent_adopts_running_pods_without_creating_them(
    api: FakeApiServer, mock: MockProvider
) -> None:
    async with PodHarness(api, mock):
        api.create("pods", pod("web"))
        await eventually(lambda: running(api, "web"))
    writes = status_patches(api, "web")
    async with PodHarness(api, mock) as second:
        await asyncio.sleep(0.3)
        assert second.controller.creates == 0
        assert second.controller.updates == 0
        assert second.controller.deletes == 0
    assert mock.creates == 1
    assert running(api, "web")
    assert status_patches(api, "web") == writes, "an unchanged status is not written again"


SCHEDULED = {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}


async def test_a_restarted_agent_does_not_rewrite_the_unchanged_status_of_a_scheduled_pod(
    api: FakeApiServer, push: PushProvider
) -> None:
    """The API's status holds a condition this provider never reports (the scheduler's
    PodScheduled), so its digest differs from the adopted pod's report: a restart rewrote
    every pod's status, a thousand writes on a node of a thousand pods. (The built-in
    providers report PodScheduled themselves.)"""
    api.create("pods", pod("web"))
    api.patch("pods", "web", SCHEDULED, NS, strategic=True, subresource="status")
    async with PodHarness(api, push):
        await eventually(lambda: running(api, "web"))
    writes = status_patches(api, "web")
    async with PodHarness(api, push) as second:
        await eventually(lambda: second.controller.ready.is_set())
        await always(lambda: status_patches(api, "web") == writes, duration=0.5)
    assert running(api, "web")


async def test_a_status_changed_while_the_agent_was_down_is_written_after_a_restart(
    api: FakeApiServer, push: PushProvider
) -> None:
    """What the node lifecycle controller does to the pods of a node whose lease expired."""
    api.create("pods", pod("web"))
    api.patch("pods", "web", SCHEDULED, NS, strategic=True, subresource="status")
    async with PodHarness(api, push):
        await eventually(lambda: running(api, "web"))
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    api.patch("pods", "web", not_ready, NS, strategic=True, subresource="status")

    def conditions() -> dict[str, str]:
        return {c["type"]: c["status"] for c in status_of(api, "web")["conditions"]}

    async with PodHarness(api, push):
        await eventually(
            lambda: (
                conditions() == {"PodScheduled": "True", "Ready": "True", "ContainersReady": "True"}
            ),
            what="the provider's Ready condition back in the API",
        )


class CountingMock(MockProvider):
    def __init__(self) -> None:
        super().__init__(NODE, MockConfig(), host_ip=HOST_IP)
        self.get_pods = 0

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        self.get_pods += 1
        return await super().get_pod(namespace, name)


async def test_adoption_takes_what_each_pod_was_given_from_the_list_not_a_call_per_pod(
    api: FakeApiServer,
) -> None:
    provider = CountingMock()
    names = [f"web-{i}" for i in range(5)]
    async with PodHarness(api, provider):
        for name in names:
            api.create("pods", pod(name))
        await eventually(lambda: all(running(api, n) for n in names))
    api.patch("pods", "web-0", {"metadata": {"labels": {"tier": "gold"}}}, NS)  # agent down
    provider.get_pods = 0
    async with PodHarness(api, provider) as second:
        await eventually(lambda: second.controller.updates == 1, what="web-0's update")
        await always(lambda: second.controller.updates == 1, duration=0.3)
        assert provider.get_pods == 0
    assert provider.creates == len(names)


async def test_the_api_pods_are_listed_before_the_node_registers_but_adopted_only_after(
    api: FakeApiServer, push: PushProvider
) -> None:
    web = api.create("pods", pod("web"))
    push.add_running(pod("web"), uid=web["metadata"]["uid"])
    listed: list[bool] = []
    original = push.list_pods

    async def list_pods() -> list[Pod]:
        listed.append(True)
        return await original()

    push.list_pods = list_pods  # type: ignore[method-assign]
    harness = PodHarness(api, push)
    registered = asyncio.Event()
    run = asyncio.create_task(harness.controller.run(after=registered))
    try:
        await eventually(lambda: harness.controller.reflector.synced.is_set())
        await always(lambda: not listed and not harness.controller.ready.is_set(), duration=0.3)
        registered.set()
        await eventually(lambda: harness.controller.ready.is_set())
        assert listed == [True]
        assert harness.controller.states[f"{NS}/web"].uid == web["metadata"]["uid"]
    finally:
        await cancel_and_wait(run)
        await harness.client.aclose()


async def test_a_restart_with_a_fresh_provider_process_adopts_by_uid(api: FakeApiServer) -> None:
    web = api.create("pods", pod("web"))
    provider = PushProvider()  # the backend kept running the pod while the agent was down
    provider.add_running(pod("web"), uid=web["metadata"]["uid"])
    async with PodHarness(api, provider):
        await eventually(lambda: running(api, "web"), what="the status of the running pod")
        await asyncio.sleep(0.2)
    assert provider.count("create") == 0
    assert provider.count("delete") == 0
    assert provider.count("update") == 0


class AdoptingProvider(PushProvider):
    """Keeps per-pod state in memory: an `AdoptsPods` provider."""

    async def adopt_pod(self, pod: ResolvedPodT) -> None:
        self.calls.append(("adopt", f"{pod.namespace}/{pod.name}"))


async def test_a_provider_that_adopts_pods_is_handed_each_adopted_pod_once(
    api: FakeApiServer,
) -> None:
    web = api.create("pods", pod("web"))
    provider = AdoptingProvider()
    provider.add_running(pod("web"), uid=web["metadata"]["uid"])
    async with PodHarness(api, provider):
        await eventually(lambda: provider.count("adopt", f"{NS}/web") == 1, what="handed back")
        await always(lambda: provider.count("adopt") == 1, duration=0.5)
    assert (provider.count("create"), provider.count("update")) == (0, 0)


async def test_provider_pods_unknown_to_the_api_are_deleted_only_if_provably_ours(
    api: FakeApiServer,
) -> None:
    provider = PushProvider()
    provider.add_running(pod("orphan"), uid="uid-orphan")  # ours, the API has no such pod
    provider.add_running(pod("foreign", node="other-node"), uid="uid-foreign", node="other-node")
    async with PodHarness(api, provider):
        await eventually(lambda: f"{NS}/orphan" not in provider.pods)
        await asyncio.sleep(0.1)
    assert f"{NS}/foreign" in provider.pods
    assert provider.count("delete", f"{NS}/foreign") == 0
    assert provider.deleted_grace[f"{NS}/orphan"] == 0


async def test_a_provider_pod_whose_name_now_has_a_new_uid_is_replaced_on_start(
    api: FakeApiServer,
) -> None:
    api.create("pods", pod("db-0"))  # a StatefulSet re-created it while the agent was down
    provider = PushProvider()
    provider.add_running(pod("db-0"), uid="uid-of-the-old-pod")
    async with PodHarness(api, provider):
        await eventually(lambda: running(api, "db-0"))
    running_pod = provider.pods[f"{NS}/db-0"]
    assert running_pod.metadata is not None
    assert running_pod.metadata.uid == uid_of(api, "db-0")
    assert provider.calls.index(("delete", f"{NS}/db-0")) < provider.calls.index(
        ("create", f"{NS}/db-0")
    )


# -- referenced objects ---------------------------------------------------------------------------
def with_config_volume(name: str, configmap_name: str = "conf") -> JSON:
    raw = pod(name, volumes=[{"name": "conf", "configMap": {"name": configmap_name}}])
    raw["spec"]["containers"][0]["volumeMounts"] = [{"name": "conf", "mountPath": "/etc/conf"}]
    return raw


def volume_file(push: PushProvider, key: str, volume: str, path: str) -> bytes | None:
    resolved = push.resolved.get(key)
    found = resolved.volumes.get(volume) if resolved else None
    if not isinstance(found, FilesVolume) or path not in found.files:
        return None
    return found.files[path].data


async def test_a_configmap_change_seen_by_a_volume_reaches_the_provider(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("configmaps", configmap("conf", {"level": "info"}))
    api.create("pods", with_config_volume("web"))
    await eventually(lambda: running(api, "web"))
    assert volume_file(push, f"{NS}/web", "conf", "level") == b"info"
    api.patch("configmaps", "conf", {"metadata": {"labels": {"unrelated": "edit"}}}, NS)
    await asyncio.sleep(0.2)
    assert push.count("update") == 0, "a change that is not in the data is not pushed"
    api.patch("configmaps", "conf", {"data": {"level": "debug"}}, NS)
    await eventually(lambda: push.count("update") == 1, what="update_pod")
    assert volume_file(push, f"{NS}/web", "conf", "level") == b"debug"
    assert push.count("create") == 1
    # one watch per referenced object, named exactly
    watches = api.calls_to("GET", f"/namespaces/{NS}/configmaps$", watch=True)
    assert watches and all(w.params["fieldSelector"] == "metadata.name=conf" for w in watches)


async def test_a_missing_mandatory_configmap_holds_the_pod_until_it_appears(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    raw = pod("web")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "level"}}}
    ]
    api.create("pods", raw)

    def waiting_reason() -> str | None:
        statuses = status_of(api, "web").get("containerStatuses") or []
        return statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None

    await eventually(lambda: waiting_reason() == "CreateContainerConfigError")
    assert phase_of(api, "web") == "Pending"
    await eventually(lambda: "MandatoryConfigMapNotFound" in event_reasons(api, "web"))
    warning = next(e for e in events_for(api, "web") if e["reason"] == "MandatoryConfigMapNotFound")
    assert warning["type"] == "Warning"
    assert push.count("create") == 0

    api.create("configmaps", configmap("conf", {"level": "debug"}))
    await eventually(lambda: running(api, "web"), what="the pod to start once the map exists")
    resolved = push.resolved[f"{NS}/web"].pod
    assert resolved.spec is not None
    env = {e.name: e.value for e in resolved.spec.containers[0].env or []}
    assert env["LEVEL"] == "debug"
    assert "waiting" not in status_of(api, "web")["containerStatuses"][0]["state"]


async def test_a_projected_service_account_token_is_requested_for_the_pod(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    raw = pod(
        "web",
        volumes=[
            {
                "name": "token",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "path": "token",
                                "audience": "vault",
                                "expirationSeconds": 3600,
                            }
                        }
                    ]
                },
            }
        ],
    )
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    assert volume_file(push, f"{NS}/web", "token", "token") == b"token-default-1"
    [request] = api.calls_to("POST", f"/namespaces/{NS}/serviceaccounts/default/token$")
    assert request.body["spec"]["audiences"] == ["vault"]
    assert request.body["spec"]["boundObjectRef"]["uid"] == uid_of(api, "web")


class _Out:
    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, data: bytes) -> None:
        self.data += data


async def exec_output(mock: MockProvider, name: str, *command: str) -> bytes:
    out = _Out()
    io_ = AttachIO(stdin=None, stdout=out, stderr=out)
    io_.resizes.close()
    async with asyncio.timeout(5):
        await mock.exec_in_container(NS, name, "app", list(command), io_)
    return bytes(out.data)


def token_pod(name: str, seconds: int = 3600) -> JSON:
    source = {"serviceAccountToken": {"path": "token", "expirationSeconds": seconds}}
    mount = {"name": "sa", "mountPath": "/var/run/secrets/sa"}
    app = {"name": "app", "image": "registry.test/app:1", "volumeMounts": [mount]}
    volume = {
        "name": "sa",
        "projected": {
            "sources": [
                source,
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ]
        },
    }
    return pod(name, containers=[app], volumes=[volume])


async def test_a_mock_pod_starts_without_a_token_request_and_gets_its_token_on_first_exec(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    token_path = f"/namespaces/{NS}/serviceaccounts/default/token$"
    api.create("pods", token_pod("web"))
    await eventually(lambda: running(api, "web"))
    assert api.calls_to("POST", token_path) == []
    # The volume's other files are there from the start; the token joins them when asked for.
    assert await exec_output(mock, "web", "cat", "/var/run/secrets/sa/namespace") == NS.encode()
    assert await exec_output(mock, "web", "cat", "/var/run/secrets/sa/token") == b"token-default-1"
    [request] = api.calls_to("POST", token_path)
    assert request.body["spec"]["boundObjectRef"]["uid"] == uid_of(api, "web")
    # Until 80 % of its lifetime has passed, the same token: no request per exec.
    assert await exec_output(mock, "web", "cat", "/var/run/secrets/sa/token") == b"token-default-1"
    assert len(api.calls_to("POST", token_path)) == 1


async def test_a_pod_the_mock_has_no_ip_for_waits_and_says_why(api: FakeApiServer) -> None:
    small = MockProvider(NODE, MockConfig(pod_cidr="10.9.0.0/30"), host_ip=HOST_IP)  # 2 hosts
    async with PodHarness(api, small):
        for name in ("a", "b", "c"):
            api.create("pods", pod(name))
        await eventually(lambda: running(api, "a") and running(api, "b"))

        def waiting() -> str:
            statuses = status_of(api, "c").get("containerStatuses") or [{}]
            return str(statuses[0].get("state", {}).get("waiting", {}).get("reason"))

        await eventually(lambda: waiting() == "OutOfPodIPs", what="c waiting for an IP")
        assert "OutOfPodIPs" in event_reasons(api, "c")
        api.delete("pods", "a", NS, grace=0)
        await eventually(lambda: running(api, "c"), within=15, what="c started on a's IP")


async def test_the_ip_of_a_pod_that_never_started_is_freed_when_it_is_deleted(
    api: FakeApiServer,
) -> None:
    """Its IP is reserved before its settings are resolved (`status.podIP` may be in its env):
    a pod held by a missing ConfigMap, then deleted, must not keep it."""
    small = MockProvider(NODE, MockConfig(pod_cidr="10.9.0.0/30"), host_ip=HOST_IP)  # 2 hosts
    async with PodHarness(api, small):
        broken = pod("broken")
        broken["spec"]["containers"][0]["env"] = [
            {"name": "L", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "l"}}}
        ]
        api.create("pods", broken)
        await eventually(lambda: "MandatoryConfigMapNotFound" in event_reasons(api, "broken"))
        api.delete("pods", "broken", NS, grace=0)
        for name in ("a", "b"):
            api.create("pods", pod(name))
        await eventually(lambda: running(api, "a") and running(api, "b"), what="both got an IP")


async def test_an_on_demand_token_mounted_by_sub_path_is_a_file(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    raw = token_pod("web")
    mounts = raw["spec"]["containers"][0]["volumeMounts"]
    mounts.append({"name": "sa", "mountPath": "/etc/vault-token", "subPath": "token"})
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    assert await exec_output(mock, "web", "cat", "/etc/vault-token") == b"token-default-1"


async def test_an_on_demand_token_is_renewed_at_use_and_never_causes_an_update(
    api: FakeApiServer, mock: MockProvider, mock_node: PodHarness
) -> None:
    api.create("pods", token_pod("web", seconds=1))
    await eventually(lambda: running(api, "web"))
    first = await exec_output(mock, "web", "cat", "/var/run/secrets/sa/token")
    assert first == b"token-default-1"

    async def renewed() -> bool:
        return await exec_output(mock, "web", "cat", "/var/run/secrets/sa/token") != first

    # 80 % of a second, at most: each exec asks again once it is due.
    await eventually(renewed, what="the token renewed at an exec")
    # A renewal is the provider's business: the pod it was given did not change.
    await always(lambda: mock_node.controller.updates == 0, duration=1.5)


async def test_service_link_variables_follow_a_service_created_after_the_first_pod(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    def linked(name: str) -> JSON:
        raw = pod(name)
        raw["spec"]["enableServiceLinks"] = True
        return raw

    def env_of(name: str) -> dict[str, str]:
        resolved = push.resolved[f"{NS}/{name}"]
        assert resolved.pod.spec is not None
        (container,) = resolved.pod.spec.containers
        return {e.name: e.value or "" for e in container.env or []}

    api.create("pods", linked("a"))
    await eventually(lambda: running(api, "a"))
    service = {"clusterIP": "10.96.0.9", "ports": [{"port": 5432, "protocol": "TCP"}]}
    api.create("services", {"metadata": {"name": "db", "namespace": NS}, "spec": service})
    # Pods until one sees the Service (the agent's Services watch catches up): the variables
    # derived once for the namespace must not stay as they were before it.
    for i in range(50):
        api.create("pods", linked(f"b{i}"))
        await eventually(partial(running, api, f"b{i}"))
        if "DB_SERVICE_HOST" in env_of(f"b{i}"):
            break
    else:
        raise AssertionError("no pod ever got the new Service's variables")
    assert env_of(f"b{i}")["DB_SERVICE_HOST"] == "10.96.0.9"
    assert "DB_SERVICE_HOST" not in env_of("a")


async def test_a_pod_replaced_under_the_same_name_gets_a_token_bound_to_itself(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    source = {"serviceAccountToken": {"path": "token"}}
    raw = pod("web", volumes=[{"name": "t", "projected": {"sources": [source]}}])
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    first = uid_of(api, "web")
    # Deleted and created again at once: the agent may see only the new pod under the name.
    api.delete("pods", "web", NS, grace=0)
    api.create("pods", raw)
    second = uid_of(api, "web")
    await eventually(lambda: push.resolved[f"{NS}/web"].uid == second, what="the new pod")
    bound = [
        r.body["spec"]["boundObjectRef"]["uid"]
        for r in api.calls_to("POST", f"/namespaces/{NS}/serviceaccounts/default/token$")
    ]
    assert bound == [first, second]
    assert volume_file(push, f"{NS}/web", "t", "token") == b"token-default-2"


async def test_a_short_lived_token_is_refreshed_and_handed_to_the_provider(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    source = {"serviceAccountToken": {"path": "token", "expirationSeconds": 1}}
    api.create("pods", pod("web", volumes=[{"name": "t", "projected": {"sources": [source]}}]))
    await eventually(lambda: running(api, "web"))
    first = volume_file(push, f"{NS}/web", "t", "token")
    await eventually(lambda: push.count("update") >= 1, within=4, what="a refresh")
    assert volume_file(push, f"{NS}/web", "t", "token") not in (None, first)


# -- failures -------------------------------------------------------------------------------------
async def test_a_provider_error_fails_the_pod_with_its_reason_and_other_pods_run(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    push.create_failures[f"{NS}/bad"] = [
        ProviderError("UnsupportedField", "hostNetwork is not supported by this backend")
    ]
    api.create("pods", pod("bad"))
    api.create("pods", pod("good"))
    await eventually(lambda: phase_of(api, "bad") == "Failed")
    status = status_of(api, "bad")
    assert status["reason"] == "UnsupportedField"
    assert status["message"] == "hostNetwork is not supported by this backend"
    await eventually(lambda: "UnsupportedField" in event_reasons(api, "bad"))
    event = next(e for e in events_for(api, "bad") if e["reason"] == "UnsupportedField")
    assert event["type"] == "Warning"
    await eventually(lambda: running(api, "good"))
    await asyncio.sleep(0.2)
    assert push.count("create", f"{NS}/bad") == 1, "a permanent error is not retried"
    assert push_node.crashed() is None


async def test_a_plain_exception_from_the_provider_is_retried(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    push.create_failures[f"{NS}/web"] = [RuntimeError("backend busy"), TimeoutError()]
    api.create("pods", pod("web"))
    await eventually(lambda: running(api, "web"), what="Running after retries")
    assert push.count("create", f"{NS}/web") == 3
    await eventually(lambda: "ProviderCreateFailed" in event_reasons(api, "web"))


async def test_a_transient_create_container_error_is_the_containers_waiting_reason_until_it_runs(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    full = ProviderError("CreateContainerError", "no space left on device", permanent=False)
    push.create_failures[f"{NS}/web"] = [full] * 3
    api.create("pods", pod("web"))

    def waiting() -> dict[str, Any]:
        statuses = status_of(api, "web").get("containerStatuses") or [{}]
        found: dict[str, Any] = statuses[0].get("state", {}).get("waiting", {})
        return found

    await eventually(lambda: waiting().get("reason") == "CreateContainerError")
    assert waiting()["message"] == "no space left on device"
    assert phase_of(api, "web") == "Pending"
    await eventually(lambda: running(api, "web"), what="Running once the creation succeeds")


async def test_the_mock_failure_ratio_fails_pods_with_its_reason(api: FakeApiServer) -> None:
    mock = MockProvider(NODE, MockConfig(failure_ratio=1.0), host_ip=HOST_IP)
    async with PodHarness(api, mock):
        api.create("pods", pod("unlucky"))
        await eventually(lambda: phase_of(api, "unlucky") == "Failed")
        assert status_of(api, "unlucky")["reason"] == "MockFailure"


async def test_the_apiserver_going_away_does_not_lose_a_deletion(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("web"))
    api.create("pods", pod("kept"))
    await eventually(lambda: running(api, "web") and running(api, "kept"))
    with api.down():
        api.delete("pods", "web", NS, grace=0)
        api.patch("pods", "kept", {"spec": {"activeDeadlineSeconds": 60}}, NS)
        await asyncio.sleep(0.3)
    await eventually(lambda: f"{NS}/web" not in push.pods, within=5)
    await eventually(lambda: push.count("update", f"{NS}/kept") == 1, within=5)
    assert push_node.crashed() is None


# -- bugs -----------------------------------------------------------------------------------------
class AcknowledgesLater(PushProvider):
    """Reports Running from inside create_pod, then takes a moment before returning (as any
    provider that does I/O after starting the pod would)."""

    async def _started(self, pod: Pod) -> None:
        self._report(pod)
        await asyncio.sleep(0.05)


async def test_a_status_pushed_while_create_pod_is_still_running_is_written(
    api: FakeApiServer,
) -> None:
    provider = AcknowledgesLater()
    async with PodHarness(api, provider):
        api.create("pods", pod("web"))
        await eventually(lambda: provider.count("create") == 1)
        await eventually(lambda: running(api, "web"), within=2)


async def test_a_pod_replaced_by_a_same_name_pod_while_disconnected_is_restarted(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("pods", pod("db-0"))
    await eventually(lambda: running(api, "db-0"))
    old_uid = uid_of(api, "db-0")
    with api.down():
        api.delete("pods", "db-0", NS, grace=0)
        api.create("pods", pod("db-0"))  # the StatefulSet controller re-creates it
        api.compact()  # ...and the agent's resourceVersion is too old to resume from
        await asyncio.sleep(0.2)
    new_uid = uid_of(api, "db-0")
    await eventually(
        lambda: (
            (p := push.pods.get(f"{NS}/db-0")) is not None
            and p.metadata is not None
            and p.metadata.uid == new_uid
        ),
        within=3,
        what="the new pod to run in the provider",
    )
    await eventually(lambda: running(api, "db-0"))
    assert old_uid in push.deleted_uids, "the old pod must be stopped"


class ReportsStopLater(PushProvider):
    """Stops a pod in the background and reports the terminated status a little later."""

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        self.calls.append(("delete", key))
        old = self.pods.pop(key, None)
        if old is None or old.metadata.uid != pod.metadata.uid:  # type: ignore[union-attr]
            if old is not None:
                self.pods[key] = old
            return
        old.status = msgspec.convert(terminated_status(msgspec.to_builtins(old.status)), PodStatus)
        asyncio.get_running_loop().call_later(0.3, self._report, old)


async def test_a_late_report_about_a_deleted_pod_does_not_change_its_successor(
    api: FakeApiServer,
) -> None:
    provider = ReportsStopLater()
    async with PodHarness(api, provider):
        api.create("pods", pod("db-0"))
        await eventually(lambda: running(api, "db-0"))
        api.delete("pods", "db-0", NS, grace=0)
        await eventually(lambda: provider.count("delete") == 1)
        await asyncio.sleep(0.05)
        api.create("pods", pod("db-0"))  # the successor, same name, new UID
        await eventually(lambda: running(api, "db-0"))
        await asyncio.sleep(0.5)  # the old pod's terminated report arrives meanwhile
        assert phase_of(api, "db-0") == "Running"


async def test_a_failed_provider_delete_is_retried(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    push.delete_failures[f"{NS}/web"] = [RuntimeError("backend timeout")]
    api.create("pods", pod("web", grace=30))
    await eventually(lambda: running(api, "web"))
    api.delete("pods", "web", NS)
    await eventually(lambda: push.count("delete") == 1)
    await eventually(lambda: api.get("pods", "web", NS) is None, within=3)


async def test_a_polling_provider_that_keeps_stopped_pods_gets_them_removed(
    api: FakeApiServer,
) -> None:
    provider = PollingProvider()
    provider.forget_on_delete = False
    async with PodHarness(api, provider, poll=0.05):
        api.create("pods", pod("web", grace=30))
        await eventually(lambda: running(api, "web"))
        api.delete("pods", "web", NS)
        await eventually(lambda: api.get("pods", "web", NS) is None, within=3)


async def test_a_polling_provider_that_forgets_stopped_pods_gets_them_removed(
    api: FakeApiServer,
) -> None:
    provider = PollingProvider()  # forget_on_delete: the pod is gone once stopped
    async with PodHarness(api, provider, poll=0.05):
        api.create("pods", pod("web", grace=1))
        await eventually(lambda: running(api, "web"))
        api.delete("pods", "web", NS)
        await eventually(lambda: api.get("pods", "web", NS) is None, within=4)


async def test_deleting_a_configmap_a_running_pod_uses_keeps_it_running(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("configmaps", configmap("conf", {"level": "info"}))
    raw = pod("web")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "level"}}}
    ]
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    api.delete("configmaps", "conf", NS)
    await eventually(lambda: "MandatoryConfigMapNotFound" in event_reasons(api, "web"))
    await always(lambda: running(api, "web"), duration=0.3, what="the pod shown Running")


async def test_the_waiting_status_is_written_once_while_a_configmap_is_missing(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    raw = pod("web")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "level"}}}
    ]
    api.create("pods", raw)
    await eventually(lambda: status_patches(api, "web") >= 1)
    await asyncio.sleep(1.0)  # several retries (back-off 0.05, 0.1, 0.2, 0.4 s)
    assert status_patches(api, "web") == 1


async def test_an_orphan_the_provider_cannot_delete_does_not_stop_the_node(
    api: FakeApiServer,
) -> None:
    provider = PushProvider()
    provider.add_running(pod("orphan"), uid="uid-orphan")
    provider.delete_failures[f"{NS}/orphan"] = [
        ProviderError("BackendError", "cannot stop it right now", permanent=False)
    ]
    async with PodHarness(api, provider):
        api.create("pods", pod("web"))
        await eventually(lambda: running(api, "web"))


async def test_unreadable_services_do_not_hang_the_pod_workers(api: FakeApiServer) -> None:
    api.fail("GET", "^/api/v1/services$", status=403, times=None)
    provider = PushProvider()
    async with PodHarness(api, provider):
        api.create("pods", pod("web"))
        await asyncio.sleep(0.3)
        api.delete("pods", "web", NS)
        await eventually(lambda: api.get("pods", "web", NS) is None, within=3)


async def test_an_unchanged_status_of_a_scheduled_pod_is_not_rewritten_by_polling(
    api: FakeApiServer,
) -> None:
    provider = PollingProvider()
    async with PodHarness(api, provider, poll=0.05):
        api.create("pods", pod("web"))
        # what the scheduler writes when it binds a pod
        scheduled = {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
        api.patch("pods", "web", scheduled, NS, strategic=True, subresource="status")
        await eventually(lambda: running(api, "web"))
        writes = status_patches(api, "web")
        await asyncio.sleep(0.5)  # about ten polls, nothing changes
        assert status_patches(api, "web") == writes


async def test_a_configmap_edited_while_the_agent_was_down_reaches_the_provider(
    api: FakeApiServer, push: PushProvider
) -> None:
    api.create("configmaps", configmap("conf", {"level": "info"}))
    api.create("pods", with_config_volume("web"))
    async with PodHarness(api, push):
        await eventually(lambda: running(api, "web"))
    api.patch("configmaps", "conf", {"data": {"level": "debug"}}, NS)  # while the agent is down
    async with PodHarness(api, push):
        await eventually(
            lambda: volume_file(push, f"{NS}/web", "conf", "level") == b"debug",
            within=2,
            what="the edit to reach the provider",
        )
    assert push.count("create") == 1


async def test_an_update_made_while_the_agent_was_down_survives_a_transient_resolution_failure(
    api: FakeApiServer, push: PushProvider
) -> None:
    """Found by the churn test: after a restart, an adopted pod whose first resolution failed
    (Services not yet read) was taken as up to date and its update never delivered."""
    api.create("pods", pod("web"))
    async with PodHarness(api, push):
        await eventually(lambda: running(api, "web"))
    api.patch("pods", "web", {"metadata": {"labels": {"tier": "gold"}}}, NS)  # agent down
    api.fail("GET", "^/api/v1/services$", status=503, times=None)
    async with PodHarness(api, push):
        await asyncio.sleep(2.5)  # the first resolution gives up waiting for the Services
        api._faults.clear()
        await eventually(
            lambda: push.count("update") == 1, within=5, what="the update to reach the provider"
        )
    assert push.count("create") == 1


async def test_a_change_to_an_unused_key_does_not_update_the_provider(
    api: FakeApiServer, push: PushProvider, push_node: PodHarness
) -> None:
    api.create("configmaps", configmap("conf", {"used": "1", "unused": "1"}))
    raw = pod("web")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "USED", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "used"}}}
    ]
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    api.patch("configmaps", "conf", {"data": {"unused": "2"}}, NS)
    await asyncio.sleep(0.3)
    assert push.count("update") == 0


# -- the status poll and status writes (issue 9) --------------------------------------------
class DetectsOverlap(PollingProvider):
    """A polling backend whose every call takes a moment and which records any two calls for
    the same pod that overlap (the provider contract promises they never do)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: dict[str, str] = {}
        self.overlaps: list[tuple[str, str, str]] = []

    async def _enter(self, what: str, key: str) -> None:
        if key in self.in_flight:
            self.overlaps.append((key, self.in_flight[key], what))
        self.in_flight[key] = what
        await asyncio.sleep(0.02)

    def _leave(self, key: str) -> None:
        self.in_flight.pop(key, None)

    async def create_pod(self, pod: ResolvedPodT) -> None:
        key = f"{pod.namespace}/{pod.name}"
        await self._enter("create", key)
        try:
            await super().create_pod(pod)
        finally:
            self._leave(key)

    async def update_pod(self, pod: ResolvedPodT) -> None:
        key = f"{pod.namespace}/{pod.name}"
        await self._enter("update", key)
        try:
            await super().update_pod(pod)
        finally:
            self._leave(key)

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        key = f"{namespace}/{name}"
        await self._enter("get", key)
        try:
            return await super().get_pod(namespace, name)
        finally:
            self._leave(key)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        key = f"{namespace}/{name}"
        await self._enter("status", key)
        try:
            return await super().get_pod_status(namespace, name)
        finally:
            self._leave(key)


async def test_the_status_poll_never_overlaps_another_call_for_the_same_pod(
    api: FakeApiServer,
) -> None:
    provider = DetectsOverlap()
    async with PodHarness(api, provider, poll=0.01):
        api.create("pods", pod("web"))
        await eventually(lambda: running(api, "web"), what="web Running")
        for i in range(10):  # each label change is an update_pod while the poll runs on
            api.patch("pods", "web", {"metadata": {"labels": {"round": str(i)}}}, NS)
            await eventually(partial(_updated_at_least, provider, i + 1), what=f"update {i}")
    assert provider.overlaps == []


def _updated_at_least(provider: PollingProvider, times: int) -> bool:
    return provider.count("update") >= times


class FailingStatus(PollingProvider):
    def __init__(self) -> None:
        super().__init__()
        self.status_calls = 0

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        self.status_calls += 1
        raise RuntimeError("backend lost the pod's status")


async def test_status_poll_failures_are_logged_once_in_a_while_not_swallowed(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    provider = FailingStatus()
    caplog.set_level(logging.DEBUG, logger="vkubelet.node._podcontroller")
    async with PodHarness(api, provider, poll=0.01) as harness:
        api.create("pods", pod("web"))
        await eventually(lambda: provider.status_calls >= 20, what="many failed polls")
        assert harness.crashed() is None
    failures = [r for r in caplog.records if "get_pod_status failed" in r.getMessage()]
    assert any("backend lost the pod's status" in r.getMessage() for r in failures)
    assert sum(r.levelno == logging.WARNING for r in failures) == 1  # then rate-limited
    assert len(failures) > 1  # the later ones at debug level


class PushesWhileListing(PushProvider):
    """After an agent restart: `list_pods` answers with the status it had when the call began
    (Pending), and the backend pushes the newer Running status while the call is under way."""

    async def list_pods(self) -> list[Pod]:
        stale = []
        for running_pod in self.pods.values():
            copy_ = msgspec.convert(msgspec.to_builtins(running_pod), Pod)
            copy_.status = msgspec.convert({"phase": "Pending"}, PodStatus)
            stale.append(copy_)
        for running_pod in self.pods.values():
            self._report(running_pod)  # lost if nobody listens yet
        return stale


async def test_a_status_pushed_before_adoption_finishes_is_written(api: FakeApiServer) -> None:
    provider = PushesWhileListing()
    created = api.create("pods", pod("web"))
    provider.add_running(pod("web"), uid=created["metadata"]["uid"])
    async with PodHarness(api, provider):
        await eventually(lambda: running(api, "web"), within=2, what="the pushed Running")
    assert provider.count("create") == 0


async def test_a_status_write_the_api_refused_is_written_again(api: FakeApiServer) -> None:
    provider = PushProvider()
    api.fail("PATCH", "/pods/web/status$", status=409)
    async with PodHarness(api, provider):
        api.create("pods", pod("web", containers=[_needs_configmap()]))

        def waiting_reason() -> str | None:
            statuses = status_of(api, "web").get("containerStatuses") or []
            return statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None

        await eventually(
            lambda: waiting_reason() == "CreateContainerConfigError",
            what="the waiting status, written again after a refused write",
        )


def _needs_configmap() -> JSON:
    ref = {"configMapKeyRef": {"name": "absent", "key": "k"}}
    return {"name": "app", "image": "registry.test/app:1", "env": [{"name": "K", "valueFrom": ref}]}


class LearnsItsAddressLater(PushProvider):
    """A backend (a VM, a lower cluster) that knows the pod's IP only after it started: the
    first report has none, a later push brings `podIPs` alone."""

    async def _started(self, pod: Pod) -> None:
        assert pod.status is not None
        pod.status.podIP = None
        pod.status.podIPs = None
        self._report(pod)

    def address_known(self, key: str, ip: str) -> None:
        found = self.pods[key]
        assert found.status is not None
        found.status.podIPs = [PodIP(ip=ip)]
        self._report(found)


async def test_a_pod_ip_reported_after_creation_reaches_the_api_and_keeps_the_env(
    api: FakeApiServer,
) -> None:
    provider = LearnsItsAddressLater()
    field = {"fieldRef": {"fieldPath": "status.podIP"}}
    container = {"name": "app", "image": "i", "env": [{"name": "MY_IP", "valueFrom": field}]}
    async with PodHarness(api, provider):
        api.create("pods", pod("vm", containers=[container]))
        await eventually(lambda: running(api, "vm"))
        assert "podIP" not in status_of(api, "vm")
        provider.address_known(f"{NS}/vm", "192.0.2.7")
        await eventually(lambda: status_of(api, "vm").get("podIP") == "192.0.2.7")
        assert status_of(api, "vm")["podIPs"] == [{"ip": "192.0.2.7"}]
        # A provider without PodNetwork: the env got the address known at start (the node's,
        # as for a host-network pod), and a later address does not restart the container.
        env = provider.resolved[f"{NS}/vm"].pod.spec.containers[0].env  # type: ignore[union-attr]
        assert [(e.name, e.value) for e in env or []] == [("MY_IP", HOST_IP)]
        api.patch("pods", "vm", {"metadata": {"labels": {"touch": "1"}}}, NS)
        await eventually(lambda: provider.count("update") == 1, what="the label update")
        env = provider.resolved[f"{NS}/vm"].pod.spec.containers[0].env  # type: ignore[union-attr]
        assert [(e.name, e.value) for e in env or []] == [("MY_IP", HOST_IP)]
