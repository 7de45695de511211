"""Shared pieces of the node agent's unit tests: polling, pod builders, scripted providers and a
pod controller wired to the fake apiserver."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ProviderError, ResolvedPod
from vkubelet.node._events import EventRecorder
from vkubelet.node._podcontroller import PodController
from vkubelet.node._resolution import Resolver, ServiceCache

from .fakeapi import JSON, FakeApiServer, now_rfc3339

T = TypeVar("T")

NODE = "vk-test"
NS = "shop"
HOST_IP = "10.0.0.1"
ALLOCATABLE: JSON = {"cpu": "4", "memory": "16Gi", "pods": "110"}


# -- waiting ----------------------------------------------------------------------------------
async def eventually(check: Callable[[], T], *, within: float = 5.0, what: str = "") -> T:
    """Poll `check` until it returns something truthy without failing an assert; return that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: str = "never true"
    while True:
        try:
            result = check()
        except AssertionError as e:
            last = str(e) or "assertion failed"
        else:
            if result:
                return result
            last = f"returned {result!r}"
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what or check}: {last}")
        await asyncio.sleep(0.01)


async def always(check: Callable[[], object], *, duration: float, what: str = "") -> None:
    """Assert that `check` holds (truthy, no failed assert) for `duration` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    while loop.time() < deadline:
        assert check(), f"no longer true: {what or check}"
        await asyncio.sleep(0.01)


async def cancel_and_wait(*tasks: asyncio.Task[Any]) -> None:
    """Cancel `tasks` and wait for them to end.

    On Python 3.11 `asyncio.wait_for` swallows a cancellation that arrives as the awaited call
    completes, and the node controller's loops use it: such a loop runs on, and its TaskGroup
    waits for it forever. The suite reports that bug with its own test; here the stragglers are
    cancelled directly so that the other tests can still stop the agent.
    """
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    for _ in range(100):
        if not pending:
            break
        _, pending = await asyncio.wait(pending, timeout=0.05)
        for straggler in asyncio.all_tasks():
            name = getattr(straggler.get_coro(), "__qualname__", "")
            if name.startswith("NodeController.") and not straggler.done():
                straggler.cancel()
    assert not pending, f"tasks would not stop: {pending}"
    await asyncio.gather(*tasks, return_exceptions=True)


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


# -- the pod controller, wired to the fake apiserver ------------------------------------------
class PodHarness:
    """A pod controller and event recorder for one node, started and stopped as a context."""

    def __init__(
        self, api: FakeApiServer, provider: Any, *, node: str = NODE, poll: float = 0.05
    ) -> None:
        self.api = api
        self.provider = provider
        self.client = api.client()
        self.events = EventRecorder(self.client, component="vkubelet", host=node)
        self.services = ServiceCache(self.client)
        client, services = self.client, self.services
        self.controller = PodController(
            client,
            node,
            provider,
            self.events,
            lambda objects: Resolver(
                client,
                objects,
                provider,
                services,
                host_ip=HOST_IP,
                allocatable=lambda: dict(ALLOCATABLE),
            ),
            workers=4,
            status_poll_interval=poll,
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> PodHarness:
        self._tasks = [
            asyncio.create_task(self.events.run(), name="events"),
            asyncio.create_task(self.controller.run(), name="pod controller"),
        ]
        await eventually(self._ready, what="the pod controller to be ready")
        return self

    def _ready(self) -> bool:
        for task in self._tasks:
            if task.done():
                task.result()  # a crash fails the test here, with its traceback
        return self.controller.ready.is_set()

    def crashed(self) -> BaseException | None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        crash = self.crashed()
        tasks = list(self._tasks)
        services = self.services._task
        if services is not None:
            tasks.append(services)
        await cancel_and_wait(*tasks)
        await self.controller.objects.aclose()
        await self.client.aclose()
        if crash is not None and exc is None:
            raise AssertionError("the pod controller crashed") from crash
