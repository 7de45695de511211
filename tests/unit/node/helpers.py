"""Shared pieces of the node agent's unit tests (and the agent's, which run the same nodes):
polling, node settings and the Node and Lease as the fake apiserver holds them, pod builders,
scripted providers and a pod controller wired to the fake apiserver."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.node import NodeSettings, ProviderError, ResolvedPod
from vkubelet.node._nodecontroller import LEASE_NAMESPACE
from vkubelet.testing.fakeapi import JSON, FakeApiServer, now_rfc3339
from vkubelet.testing.harness import PodHarness as PodHarness
from vkubelet.testing.harness import always as always
from vkubelet.testing.harness import cancel_and_wait as cancel_and_wait
from vkubelet.testing.harness import eventually as eventually

T = TypeVar("T")

NODE = "vk-test"
NS = "shop"
HOST_IP = "10.0.0.1"
ALLOCATABLE: JSON = {"cpu": "4", "memory": "16Gi", "pods": "110"}


# -- the node -------------------------------------------------------------------------------
def settings(**overrides: object) -> NodeSettings:
    values: dict[str, object] = {
        "name": NODE,
        "provider": "mock",
        "renew_interval": 0.05,
        "status_interval": 0.2,
        "ping_interval": 0.02,
        "ping_timeout": 0.2,
    }
    values.update(overrides)
    return NodeSettings(**values)  # type: ignore[arg-type]


def node_of(api: FakeApiServer, name: str = NODE) -> JSON:
    found = api.get("nodes", name)
    assert found is not None, f"node {name} does not exist"
    return found


def lease_of(api: FakeApiServer, name: str = NODE) -> JSON | None:
    return api.get("leases", name, LEASE_NAMESPACE)


def conditions(api: FakeApiServer, name: str = NODE) -> dict[str, JSON]:
    return {c["type"]: c for c in node_of(api, name)["status"].get("conditions") or []}


# -- objects ----------------------------------------------------------------------------------
def pod(
    name: str,
    *,
    node: str = NODE,
    namespace: str = NS,
    containers: list[JSON] | None = None,
    volumes: list[JSON] | None = None,
    grace: int | None = None,
    restart_policy: str | None = None,
) -> JSON:
    spec: JSON = {
        "nodeName": node,
        "containers": containers or [{"name": "app", "image": "registry.test/app:1"}],
        "enableServiceLinks": False,
    }
    if volumes is not None:
        spec["volumes"] = volumes
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if restart_policy is not None:
        spec["restartPolicy"] = restart_policy
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def configmap(name: str, data: dict[str, str], *, namespace: str = NS) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace}, "data": dict(data)}


def status_of(api: FakeApiServer, name: str, namespace: str = NS) -> JSON:
    found = api.get("pods", name, namespace)
    assert found is not None, f"pod {namespace}/{name} does not exist"
    status: JSON = found.get("status") or {}
    return status


def phase_of(api: FakeApiServer, name: str, namespace: str = NS) -> str | None:
    found = api.get("pods", name, namespace)
    return None if found is None else (found.get("status") or {}).get("phase")


def events_for(api: FakeApiServer, name: str, namespace: str = NS) -> list[JSON]:
    return [
        e
        for e in api.objects("events", namespace)
        if e.get("involvedObject", {}).get("name") == name
    ]


def event_reasons(api: FakeApiServer, name: str, namespace: str = NS) -> set[str]:
    return {str(e.get("reason")) for e in events_for(api, name, namespace)}


def status_patches(api: FakeApiServer, name: str, namespace: str = NS) -> int:
    return len(api.calls_to("PATCH", f"/namespaces/{namespace}/pods/{name}/status$"))


# -- providers --------------------------------------------------------------------------------
def running_status(pod: Pod, ip: str = "10.244.0.9") -> JSON:
    assert pod.spec is not None
    started = now_rfc3339()
    return {
        "phase": "Running",
        "hostIP": HOST_IP,
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "startTime": started,
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "ContainersReady", "status": "True"},
        ],
        "containerStatuses": [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod.spec.containers
        ],
    }


def terminated_status(status: JSON) -> JSON:
    done = copy.deepcopy(status)
    done["phase"] = "Succeeded"
    for c in done.get("containerStatuses") or []:
        c["ready"] = False
        c["started"] = False
        c["state"] = {
            "terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now_rfc3339()}
        }
    for condition in done.get("conditions") or []:
        condition["status"] = "False"
    return done


class PollingProvider:
    """A scripted backend without push notifications; the agent polls `get_pod_status`.

    Pods start Running at once. Failures are scripted per pod key (namespace/name): each entry
    of `create_failures`/`delete_failures` is raised by one call, in order.
    """

    def __init__(self, node: str = NODE) -> None:
        self.node = node
        self.pods: dict[str, Pod] = {}
        self.calls: list[tuple[str, str]] = []
        self.resolved: dict[str, ResolvedPod] = {}
        self.create_failures: dict[str, list[Exception]] = {}
        self.delete_failures: dict[str, list[Exception]] = {}
        self.deleted_grace: dict[str, int] = {}
        self.deleted_uids: list[str] = []  # UIDs of pods actually stopped
        self.forget_on_delete = True  # a stopped pod disappears (False: it stays, terminated)

    def count(self, method: str, key: str | None = None) -> int:
        return sum(1 for m, k in self.calls if m == method and (key is None or k == key))

    def add_running(self, api_pod: JSON, *, uid: str, node: str | None = None) -> Pod:
        """A pod the backend already runs (as after an agent restart)."""
        raw = copy.deepcopy(api_pod)
        raw["metadata"]["uid"] = uid
        raw["spec"]["nodeName"] = node or self.node
        typed = msgspec.convert(raw, Pod)
        typed.status = msgspec.convert(running_status(typed), PodStatus)
        self.pods[_key(typed)] = typed
        return typed

    def _fail(self, failures: dict[str, list[Exception]], key: str) -> None:
        scripted = failures.get(key)
        if scripted:
            raise scripted.pop(0)

    async def create_pod(self, pod: ResolvedPod) -> None:
        key = f"{pod.namespace}/{pod.name}"
        self.calls.append(("create", key))
        self._fail(self.create_failures, key)
        typed = msgspec.convert(msgspec.to_builtins(pod.pod), Pod)
        typed.status = msgspec.convert(running_status(typed), PodStatus)
        self.pods[key] = typed
        self.resolved[key] = pod
        await self._started(typed)

    async def _started(self, pod: Pod) -> None:
        pass

    async def update_pod(self, pod: ResolvedPod) -> None:
        key = f"{pod.namespace}/{pod.name}"
        self.calls.append(("update", key))
        if key not in self.pods:
            raise ProviderError("NotFound", f"{key} is not running", permanent=False)
        self.resolved[key] = pod

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = _key(pod)
        self.calls.append(("delete", key))
        self._fail(self.delete_failures, key)
        running = self.pods.get(key)
        if running is None or running.metadata.uid != pod.metadata.uid:  # type: ignore[union-attr]
            return
        self.deleted_grace[key] = grace_period_seconds
        self.deleted_uids.append(str(pod.metadata.uid))  # type: ignore[union-attr]
        running.status = msgspec.convert(
            terminated_status(msgspec.to_builtins(running.status)), PodStatus
        )
        self._report(running)
        if self.forget_on_delete:
            del self.pods[key]

    def _report(self, pod: Pod) -> None:
        pass

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        return self.pods.get(f"{namespace}/{name}")

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        found = self.pods.get(f"{namespace}/{name}")
        return None if found is None else found.status

    async def list_pods(self) -> list[Pod]:
        return list(self.pods.values())


class PushProvider(PollingProvider):
    """The same backend, pushing every status change (a `PodNotifier`)."""

    def __init__(self, node: str = NODE) -> None:
        super().__init__(node)
        self._callback: Callable[[Pod], None] | None = None

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._callback = callback

    def _report(self, pod: Pod) -> None:
        if self._callback is not None:
            self._callback(copy.deepcopy(pod))

    async def _started(self, pod: Pod) -> None:
        self._report(pod)

    def report(self, key: str) -> None:
        """Push the pod's current status again (an unchanged report)."""
        self._report(self.pods[key])


def _key(pod: Pod) -> str:
    meta = pod.metadata
    assert meta is not None
    return f"{meta.namespace}/{meta.name}"
