"""A complete, small vkubelet provider: each container runs as a local process.

It shows what a real backend needs — lifecycle, push notifications, node configuration, restart
policy, logs and exec — with the SDK's helpers doing the kubelet's rules: `build_pod_status`
(phase, conditions, container states), `RestartBackoff`, CRI log files and `relay_process`. It
is an example, not a sandbox: the pod's command runs as the agent's user, without isolation.
Register it in your package with

    [project.entry-points."vkubelet.providers"]
    local = "local_provider:create"

and run `vkubelet run --provider local --nodename my-laptop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

from lightkube.models.core_v1 import Container, PodStatus
from lightkube.resources.core_v1 import Node, Pod

from vkubelet.sdk import (
    AttachIO,
    ContainerLogOptions,
    ProviderContext,
    ProviderError,
    ResolvedPod,
    TaskSet,
)
from vkubelet.sdk.backoff import supervise_container
from vkubelet.sdk.logs import LogWriter, copy_to_log, previous_not_found, read_log, run_log_path
from vkubelet.sdk.status import ContainerReport, Running, build_pod_status
from vkubelet.sdk.stdio import relay_process

PIPE = asyncio.subprocess.PIPE


class LocalPod:
    def __init__(self, resolved: ResolvedPod, logs: Path) -> None:
        self.pod, self.uid, self.logs = resolved.pod, resolved.uid, logs
        self.started = datetime.now(UTC)
        self.reports: dict[str, ContainerReport] = {}
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.stop = asyncio.Event()
        self.status: PodStatus | None = None
        self.task: asyncio.Task[None] | None = None


class LocalProvider:
    def __init__(self, node_name: str, host_ip: str) -> None:
        self.node_name, self.host_ip = node_name, host_ip
        self.logs = Path(tempfile.gettempdir()) / "vkubelet-local" / node_name
        self._pods: dict[str, LocalPod] = {}  # "namespace/name"
        self._notify: Callable[[Pod], None] = lambda pod: None
        self._tasks = TaskSet("local provider")

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    def configure_node(self, node: Node) -> None:
        assert node.status is not None
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": "8Gi", "pods": "20"}
        node.status.capacity, node.status.allocatable = capacity, dict(capacity)

    async def ping(self) -> None:
        return None  # a local machine is always reachable

    async def create_pod(self, resolved: ResolvedPod) -> None:
        spec = resolved.pod.spec
        assert spec is not None
        if any(not c.command for c in [*(spec.initContainers or []), *spec.containers]):
            raise ProviderError("CommandRequired", "the local provider runs `command`, not images")
        key = f"{resolved.namespace}/{resolved.name}"
        if key in self._pods and self._pods[key].uid == resolved.uid:
            return  # runs already
        local = self._pods[key] = LocalPod(resolved, self.logs / resolved.uid)
        self._report(local)
        run = self._run(local, spec.initContainers or [], spec.containers)
        local.task = self._tasks.spawn(run, name=key)  # its failures are logged

    async def _run(self, local: LocalPod, inits: list[Container], mains: list[Container]) -> None:
        for container in inits:  # one after the other, each until it succeeds
            if not await self._supervise(local, container, init=True):
                return
        await asyncio.gather(*(self._supervise(local, c, init=False) for c in mains))

    async def _supervise(self, local: LocalPod, c: Container, *, init: bool) -> bool:
        """Run `c` as the restart policy says, backing off like the kubelet; True on success."""
        meta = local.pod.metadata
        assert meta is not None and local.pod.spec is not None

        async def run(count: int) -> int:
            run_log_path(local.logs, c.name, count - 2).unlink(missing_ok=True)  # keep two runs
            log = LogWriter(run_log_path(local.logs, c.name, count))
            env = {e.name: e.value or "" for e in c.env or []}  # resolved: literal values
            argv = [*(c.command or []), *(c.args or [])]  # exec'd directly: no shell sees them
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdout=PIPE, stderr=PIPE
                )
            except OSError as e:  # no such command: the run fails, as a runtime's would
                log.write("stderr", f"{argv[0]}: {e.strerror}\n".encode())
                log.close()
                return 127
            local.procs[c.name] = proc
            if local.stop.is_set():  # deleted while it was starting
                proc.terminate()
            assert proc.stdout and proc.stderr
            out, err = (
                copy_to_log(proc.stdout, log, "stdout"),
                copy_to_log(proc.stderr, log, "stderr"),
            )
            await asyncio.gather(out, err)
            log.close()
            return await proc.wait()

        def report(state: ContainerReport) -> None:
            local.reports[c.name] = state
            self._report(local)

        names = (c.name, str(meta.name), str(meta.namespace), str(meta.uid))
        policy = local.pod.spec.restartPolicy
        return await supervise_container(
            run, report, restart_policy=policy, stop=local.stop, names=names, init=init
        )

    async def update_pod(self, resolved: ResolvedPod) -> None:
        return None  # processes cannot change their env or files in place

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        local = self._pods.get(f"{pod.metadata.namespace}/{pod.metadata.name}")  # type: ignore[union-attr]
        if local is None or local.stop.is_set() or local.task is None:
            return
        local.stop.set()
        for proc in local.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(local.task), grace_period_seconds)
        except TimeoutError:
            for proc in local.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await local.task
        self._report(local)  # every container terminated: the agent removes the pod
        del self._pods[f"{pod.metadata.namespace}/{pod.metadata.name}"]  # type: ignore[union-attr]
        shutil.rmtree(local.logs, ignore_errors=True)

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        local = self._pods.get(f"{namespace}/{name}")
        return None if local is None else self._pod(local)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = await self.get_pod(namespace, name)
        return None if pod is None else pod.status

    async def list_pods(self) -> list[Pod]:
        return [self._pod(local) for local in self._pods.values()]

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        local = self._local(namespace, pod, container)
        run = local.reports[container].restart_count if container in local.reports else 0
        if options.previous and run == 0:
            raise previous_not_found(container, pod)
        path = run_log_path(local.logs, container, run - options.previous)

        def running() -> bool:  # the run being read goes on, so following it goes on
            now = local.reports.get(container)
            return now is not None and now.restart_count == run and isinstance(now.state, Running)

        async for chunk in read_log(path, options, running=running):
            yield chunk

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        local = self._local(namespace, pod, container)
        spec = next(c for c in local.pod.spec.containers if c.name == container)  # type: ignore[union-attr]
        env = {e.name: e.value or "" for e in spec.env or []}  # the container's, resolved
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdin=PIPE, stdout=PIPE, stderr=PIPE
        )
        return await relay_process(proc, io)

    def _local(self, namespace: str, pod: str, container: str) -> LocalPod:
        local = self._pods.get(f"{namespace}/{pod}")
        if local is None or container not in [c.name for c in local.pod.spec.containers]:  # type: ignore[union-attr]
            raise ProviderError("NotFound", f"container {container} is not valid for pod {pod}")
        return local

    def _status(self, local: LocalPod) -> PodStatus:
        assert local.pod.spec is not None
        local.status = build_pod_status(
            local.pod.spec,
            local.reports,
            host_ip=self.host_ip,
            start_time=local.started,
            previous=local.status,
            terminating=local.stop.is_set(),
        )
        return local.status

    def _pod(self, local: LocalPod) -> Pod:
        return Pod(metadata=local.pod.metadata, spec=local.pod.spec, status=self._status(local))

    def _report(self, local: LocalPod) -> None:
        self._notify(self._pod(local))


def create(context: ProviderContext) -> LocalProvider:
    return LocalProvider(context.node_name, context.internal_ip)
