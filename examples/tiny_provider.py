"""A whole provider in 40 lines: each container's command runs as a process here (no isolation).

The SDK does the kubelet's work: `RunnerProvider` and its `PodRunner`s run init containers in
order, restart containers by the pod's restart policy with the kubelet's back-off, build the
pod's status, stop pods gracefully and serve `kubectl logs` from the CRI log files written here.
Try it: `vkubelet run --provider examples/tiny_provider.py --nodename tiny`.
"""

import asyncio
import tempfile
from pathlib import Path

from lightkube.models.core_v1 import Container

from vkubelet.sdk import ProviderContext, ResolvedPod, RunnerProvider
from vkubelet.sdk.logs import LogWriter, copy_to_log


class TinyProvider(RunnerProvider):
    def __init__(self, context: ProviderContext) -> None:
        logs = Path(tempfile.mkdtemp(prefix="vkubelet-tiny-"))
        super().__init__(host_ip=context.internal_ip, log_dir=logs)

    async def create_pod(self, resolved: ResolvedPod) -> None:
        processes: dict[str, asyncio.subprocess.Process] = {}

        async def run(c: Container, count: int) -> int:  # one run of a container: its exit code
            env = {e.name: e.value or "" for e in c.env or []}  # literal: the agent resolved them
            argv = [*(c.command or []), *(c.args or [])]  # exec'd directly: no shell sees them
            proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=-1, stderr=-1)
            processes[c.name] = proc
            log = LogWriter(self.log_path(resolved.uid, c.name, count))
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

        self.start_runner(resolved, run, signal)


create = TinyProvider  # the factory vkubelet calls with the ProviderContext
