"""A complete, small vkubelet provider: each container runs as a local process.

It shows every part of the provider API a real backend needs — lifecycle, push notifications,
node configuration and health — in about a hundred lines. It is an example, not a sandbox: the
pod's command runs as the agent's user, without isolation. Register it in your package with

    [project.entry-points."vkubelet.providers"]
    local = "local_provider:create"

and run `vkubelet run --provider local --nodename my-laptop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Node, Pod

from vkubelet.node import ProviderContext, ProviderError, ResolvedPod


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class LocalProvider:
    def __init__(self, node_name: str, host_ip: str) -> None:
        self.node_name = node_name
        self.host_ip = host_ip
        self._pods: dict[str, dict[str, Any]] = {}  # "ns/name" -> pod dict with a live status
        self._procs: dict[str, list[asyncio.subprocess.Process]] = {}
        self._notify: Callable[[Pod], None] = lambda pod: None
        self._waiters: set[asyncio.Task[None]] = set()

    # PodNotifier: the agent passes a callback; we call it whenever a status changes.
    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    # NodeProvider: what the node offers, and whether the backend is healthy.
    def configure_node(self, node: Node) -> None:
        assert node.status is not None
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": "8Gi", "pods": "20"}
        node.status.capacity = capacity
        node.status.allocatable = dict(capacity)

    async def ping(self) -> None:
        return None  # a local machine is always reachable

    # PodLifecycleHandler
    async def create_pod(self, resolved: ResolvedPod) -> None:
        pod = msgspec.to_builtins(resolved.pod)
        key = f"{resolved.namespace}/{resolved.name}"
        containers = pod["spec"]["containers"]
        if any(not c.get("command") for c in containers):
            raise ProviderError("CommandRequired", "the local provider runs `command`, not images")
        procs = []
        for container in containers:
            env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
            # Arguments go to exec directly: no shell ever sees pod fields.
            procs.append(
                await asyncio.create_subprocess_exec(
                    *container["command"],
                    *container.get("args", []),
                    env=env,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        self._procs[key] = procs
        pod["status"] = {
            "phase": "Running",
            "hostIP": self.host_ip,
            "podIP": self.host_ip,
            "startTime": _now(),
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": _now()}},
                }
                for c in containers
            ],
        }
        self._pods[key] = pod
        self._report(key)
        for index, proc in enumerate(procs):
            task = asyncio.create_task(self._wait(key, index, proc))
            self._waiters.add(task)  # keep a reference, or the loop may drop the task
            task.add_done_callback(self._waiters.discard)

    async def _wait(self, key: str, index: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        pod = self._pods.get(key)
        if pod is None:
            return
        status = pod["status"]["containerStatuses"][index]
        started = status["state"].get("running", {}).get("startedAt", _now())
        status["ready"] = False
        status["state"] = {
            "terminated": {
                "exitCode": code,
                "startedAt": started,
                "finishedAt": _now(),
                "reason": "Completed" if code == 0 else "Error",
            }
        }
        states = [s["state"] for s in pod["status"]["containerStatuses"]]
        if all("terminated" in s for s in states):
            failed = any(s["terminated"]["exitCode"] != 0 for s in states)
            pod["status"]["phase"] = "Failed" if failed else "Succeeded"
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        self._report(key)

    async def update_pod(self, resolved: ResolvedPod) -> None:
        return None  # processes cannot change their env or files in place

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        procs = self._procs.pop(key, [])
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        try:
            async with asyncio.timeout(grace_period_seconds):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        await asyncio.sleep(0)  # let the _wait tasks report the terminations
        self._pods.pop(key, None)

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        pod = self._pods.get(f"{namespace}/{name}")
        return None if pod is None else msgspec.convert(pod, Pod)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = await self.get_pod(namespace, name)
        return None if pod is None else pod.status

    async def list_pods(self) -> list[Pod]:
        return [msgspec.convert(p, Pod) for p in self._pods.values()]

    def _report(self, key: str) -> None:
        self._notify(msgspec.convert(self._pods[key], Pod))


def create(context: ProviderContext) -> LocalProvider:
    return LocalProvider(context.node_name, context.internal_ip)
