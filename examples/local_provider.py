"""A complete, small vkubelet provider: each container runs as a local process.

It shows what a real backend needs — lifecycle, push notifications, node configuration, restart
policy, probes, logs and exec — with the SDK doing the kubelet's rules: `RunnerProvider` and
`PodRunner` (init containers, restart policy and back-off, the pod's status, graceful stop, logs
from CRI log files), `PodProbes` (liveness, readiness and startup probes) and `relay_process`
(exec's stdio). It is an example, not a sandbox: the pod's command runs as the agent's user,
without isolation. Register it in your package with

    [project.entry-points."vkubelet.providers"]
    local = "local_provider:create"

and run `vkubelet run --provider local --nodename my-laptop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lightkube.models.core_v1 import Container
from lightkube.resources.core_v1 import Node

from vkubelet.sdk import (
    AttachIO,
    ProviderContext,
    ProviderError,
    ResolvedPod,
    RunnerProvider,
)
from vkubelet.sdk.logs import LogWriter, copy_to_log
from vkubelet.sdk.probes import ExecResult, ProbeReader, ProbeWriter
from vkubelet.sdk.stdio import relay_process

PIPE = asyncio.subprocess.PIPE


def _env(container: Container) -> dict[str, str]:
    return {e.name: e.value or "" for e in container.env or []}  # literal: the agent resolved them


class LocalTransport:
    """How probes reach a local container: exec runs here with its env, TCP goes to localhost."""

    def __init__(self, containers: Sequence[Container]) -> None:
        self._containers = {c.name: c for c in containers}

    def available(self) -> bool:
        return True  # this machine is always there

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        env = _env(self._containers[container])
        proc = await asyncio.create_subprocess_exec(*command, env=env, stdout=PIPE, stderr=PIPE)
        try:
            async with asyncio.timeout(limit):
                out, err = await proc.communicate()
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        return ExecResult(proc.returncode or 0, out + err)

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]:
        return await asyncio.open_connection("127.0.0.1", port)


class LocalProvider(RunnerProvider):
    def __init__(self, context: ProviderContext) -> None:
        logs = Path(tempfile.mkdtemp(prefix=f"vkubelet-local-{context.node_name}-"))  # 0700, ours
        super().__init__(host_ip=context.internal_ip, log_dir=logs, events=context.events)

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
        runner = self.runners.get(f"{resolved.namespace}/{resolved.name}")
        if runner is not None and runner.pod.metadata and runner.pod.metadata.uid == resolved.uid:
            return  # runs already
        processes: dict[str, asyncio.subprocess.Process] = {}

        async def run(c: Container, count: int) -> int:
            self.log_path(resolved.uid, c.name, count - 2).unlink(missing_ok=True)  # keep two
            log = LogWriter(self.log_path(resolved.uid, c.name, count))
            argv = [*(c.command or []), *(c.args or [])]  # exec'd directly: no shell sees them
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=_env(c), stdout=PIPE, stderr=PIPE
                )
            except OSError as e:  # no such command: the run fails, as a runtime's would
                log.write("stderr", f"{argv[0]}: {e.strerror}\n".encode())
                log.close()
                return 127
            processes[c.name] = proc
            assert proc.stdout is not None and proc.stderr is not None
            await asyncio.gather(
                copy_to_log(proc.stdout, log, "stdout"), copy_to_log(proc.stderr, log, "stderr")
            )
            log.close()
            return await proc.wait()

        def signal(name: str, signum: int) -> None:
            if (proc := processes.get(name)) is None or proc.returncode is not None:
                raise ProcessLookupError(name)  # not started yet, or exited: the runner retries
            proc.send_signal(signum)

        self.start_runner(resolved, run, signal, probe_transport=LocalTransport(spec.containers))

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        runner = self.runners.get(f"{namespace}/{pod}")
        spec = runner.pod.spec if runner is not None else None
        found = [c for c in spec.containers if c.name == container] if spec else []
        if not found:
            raise ProviderError("NotFound", f"container {container} is not valid for pod {pod}")
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, env=_env(found[0]), stdin=PIPE, stdout=PIPE, stderr=PIPE
            )
        except OSError as e:
            raise ProviderError("CommandNotFound", f"{command[0]}: {e.strerror}") from e
        return await relay_process(proc, io)


create = LocalProvider  # the factory vkubelet calls with the ProviderContext
