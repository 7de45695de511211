"""A device without SSH: a `DeviceLink` stand-in that runs the provider's scripts with the local
sh in a temporary HOME, opens its "direct-tcpip" connections locally, and can be switched off."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from vkubelet.providers.ssh._link import Completed, Unreachable


class LocalLink:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.connected = True
        self.on_connected: list[Callable[[], None]] = []
        self.scripts: list[str] = []
        self._procs: list[asyncio.subprocess.Process] = []
        self._up = asyncio.Event()
        self._up.set()

    @property
    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "PATH": os.environ["PATH"], "VKUBELET_BACKOFF_BASE": "1"}

    async def maintain(self) -> None:
        for callback in self.on_connected:
            callback()
        await asyncio.Event().wait()

    async def wait_connected(self) -> None:
        await self._up.wait()

    async def ping(self) -> None:
        if not self.connected:
            raise Unreachable("the device is down")

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed:
        if not self.connected:
            raise Unreachable("the device is down")
        self.scripts.append(script)
        proc = await self._spawn("sh", "-s")
        # Like an SSH channel, the process does not end because its caller gave up on it.
        out, err = await asyncio.shield(proc.communicate(script.encode()))
        assert proc.returncode is not None
        return Completed(proc.returncode, out, err)

    @contextlib.asynccontextmanager
    async def process(self, command: str, **_: Any) -> AsyncIterator[asyncio.subprocess.Process]:
        if not self.connected:
            raise Unreachable("the device is down")
        proc = await self._spawn("sh", "-c", command)
        try:
            yield proc
        finally:
            _kill(proc)

    async def open_connection(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if not self.connected:
            raise Unreachable("the device is down")
        return await asyncio.open_connection(host, port)

    def close(self) -> None:
        pass

    async def _spawn(self, *argv: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=self.home,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    async def aclose(self) -> None:
        """Kill every process group this link started, and anything that carries its HOME."""
        for proc in self._procs:
            _kill(proc)
            await proc.wait()
        _kill_carrying(f"HOME={self.home}".encode())


def _kill_carrying(needle: bytes) -> None:
    """Kill the processes with `needle` in their environment: the ones a test started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
