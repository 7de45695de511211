"""How the probe engine (`vkubelet.sdk.probes`) reaches a mock container: exec probes run in its
in-memory shell, against its filesystem and env (so `kubectl exec ... -- rm /tmp/ready` makes a
readiness probe fail); httpGet, tcpSocket and grpc connect to 127.0.0.1, as port-forward does,
since the mock's pods "are" this machine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from ...sdk.capabilities import AttachIO
from ...sdk.probes import ExecResult, ProbeReader, ProbeWriter
from ._fs import Filesystem
from ._records import MockContainer, MockPod
from ._shell import environment, run_command
from ._terminal import Collector

__all__ = ["MockProbes"]


class MockProbes:
    """The `ProbeTransport` of one mock pod."""

    def __init__(
        self,
        mock: MockPod,
        filesystem: Callable[[MockPod, MockContainer], Awaitable[Filesystem]],
        stopped: asyncio.Event,
    ) -> None:
        self._mock = mock
        self._filesystem = filesystem
        self._stopped = stopped

    def available(self) -> bool:
        return True

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        found = self._mock.container(container)
        output = Collector()
        io = AttachIO(stdin=None, stdout=output, stderr=output)
        fs = await self._filesystem(self._mock, found)
        env = environment(self._mock, found)
        code = await run_command(fs, env, self._mock.name, list(command), io, self._stopped)
        return ExecResult(code, bytes(output.data))

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]:
        return await asyncio.open_connection("127.0.0.1", port)
