"""Run a provider against an in-memory apiserver: fast tests of a provider's behaviour.

`PodHarness` wires the agent's real pod controller, resolver and event recorder to
`vkubelet.testing.fakeapi.FakeApiServer`, so a test creates pods as the API would hold them and
watches the status, events and provider calls that follow, in milliseconds and without
processes:

    async def test_my_pod_runs() -> None:
        api = FakeApiServer()
        async with PodHarness(api, MyProvider()) as harness:
            harness.create_pod(pod_manifest("web", node=harness.node))
            await eventually(lambda: harness.phase("web") == "Running")

It proves what the provider does against the API's semantics the fake implements; that a feature
works against Kubernetes is for an integration test against a real control plane
(`kube_cluster`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar, overload

from ..kube import EventRecorder
from ..node import PodController, Resolver, ServiceCache
from .fakeapi import JSON, FakeApiServer

T = TypeVar("T")

NODE = "vk-test"
HOST_IP = "10.0.0.1"
ALLOCATABLE: JSON = {"cpu": "4", "memory": "16Gi", "pods": "110"}


# -- waiting ----------------------------------------------------------------------------------
@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    *,
    within: float = 5.0,
    what: str = "",
    interval: float = 0.01,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T], *, within: float = 5.0, what: str = "", interval: float = 0.01
) -> T: ...


async def eventually(
    check: Callable[[], Any], *, within: float = 5.0, what: str = "", interval: float = 0.01
) -> Any:
    """Poll `check` until it returns something truthy without failing an assert; return that.

    `check` may be a coroutine function, for conditions only an async call can see (what an
    exec into a pod prints, say). A longer `interval` suits a check that costs something (a
    `kubectl` process) or that blocks the loop the code under test runs on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: str = "never true"
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as e:
            last = str(e) or "assertion failed"
        else:
            if result:
                return result
            last = f"returned {result!r}"
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what or check}: {last}")
        await asyncio.sleep(interval)


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


# -- the pod controller, wired to the fake apiserver ------------------------------------------
class PodHarness:
    """A pod controller and event recorder for one node, started and stopped as a context."""

    def __init__(
        self, api: FakeApiServer, provider: Any, *, node: str = NODE, poll: float = 0.05
    ) -> None:
        self.api = api
        self.node = node
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

    # -- what a test does and reads ---------------------------------------------------------------
    def create_pod(self, manifest: JSON) -> JSON:
        namespace = manifest.get("metadata", {}).get("namespace", "default")
        return self.api.create("pods", manifest, namespace)

    def delete_pod(self, name: str, namespace: str = "default", grace: int | None = None) -> None:
        self.api.delete("pods", name, namespace, grace=grace)

    def status(self, name: str, namespace: str = "default") -> JSON:
        found = self.api.get("pods", name, namespace)
        assert found is not None, f"pod {namespace}/{name} does not exist"
        status: JSON = found.get("status") or {}
        return status

    def phase(self, name: str, namespace: str = "default") -> str | None:
        found = self.api.get("pods", name, namespace)
        return None if found is None else (found.get("status") or {}).get("phase")

    def events_for(self, name: str, namespace: str = "default") -> list[JSON]:
        return [
            e
            for e in self.api.objects("events", namespace)
            if e.get("involvedObject", {}).get("name") == name
        ]

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
        await cancel_and_wait(*self._tasks)
        await self.services.aclose()
        await self.controller.objects.aclose()
        await self.client.aclose()
        if crash is not None and exc is None:
            raise AssertionError("the pod controller crashed") from crash


def pod_manifest(
    name: str,
    *,
    node: str = NODE,
    namespace: str = "default",
    containers: list[JSON] | None = None,
    restart_policy: str | None = None,
    **spec: Any,
) -> JSON:
    """A pod bound to `node`, as the scheduler would leave it in the API."""
    body: JSON = {
        "nodeName": node,
        "containers": containers or [{"name": "app", "image": "registry.test/app:1"}],
        "enableServiceLinks": False,
        **spec,
    }
    if restart_policy is not None:
        body["restartPolicy"] = restart_policy
    return {"metadata": {"name": name, "namespace": namespace}, "spec": body}
