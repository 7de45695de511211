"""A thin wrapper on PyPI `qemu.qmp` for the few QMP calls the machine needs.

It adds what every caller would otherwise repeat: one lazily (re)connected client per QEMU, errors
folded into `MonitorUnavailable` when QEMU is gone, and a `quit` that tolerates QEMU closing the
socket before it answers (the reply and the EOF race; both mean the job is done).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qemu.qmp import (
    ConnectError,
    EventListener,
    ExecInterruptedError,
    ExecuteError,
    QMPClient,
    QMPError,
    Runstate,
    StateError,
)

__all__ = ["EventListener", "ExecuteError", "Monitor", "MonitorUnavailable"]

# qemu.qmp logs every dropped connection as an error; for a VM that powers off that is the norm.
logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)


# How long QEMU may take to greet a new QMP connection (it answers in milliseconds when alive).
CONNECT_SECONDS = 10.0


class MonitorUnavailable(ConnectionError):
    """QEMU's monitor socket does not answer (QEMU not running, or exiting)."""


class Monitor:
    def __init__(self, socket_path: Path, name: str = "vkubelet") -> None:
        self.socket_path = socket_path
        self._name = name
        self._client = QMPClient(name)
        self._lock = asyncio.Lock()
        self._commands = asyncio.Lock()  # one command at a time (see pass_fd)

    async def connect(self) -> None:
        async with self._lock:
            if self._client.runstate == Runstate.RUNNING:
                return
            if self._client.runstate != Runstate.IDLE:
                with contextlib.suppress(Exception):
                    await self._client.disconnect()  # raises what ended the last session
            try:
                async with asyncio.timeout(CONNECT_SECONDS):
                    await self._client.connect(str(self.socket_path))
            except TimeoutError:
                # A stopped or wedged QEMU accepts the connection and never greets: without a
                # limit every caller (a pod's status, a stop) would wait on it forever. (The
                # client cleans up the session it was cancelled in.)
                self._client = QMPClient(self._name)
                raise MonitorUnavailable(
                    f"QMP {self.socket_path}: no greeting within {CONNECT_SECONDS:g} s"
                ) from None
            except (ConnectError, StateError, AssertionError) as e:
                # AssertionError: qemu.qmp 0.0.6 trips its own state assertion when QEMU dies
                # during the greeting; the client is not reusable after that, so start afresh.
                self._client = QMPClient(self._name)
                raise MonitorUnavailable(
                    f"QMP {self.socket_path}: {e or type(e).__name__}"
                ) from None

    async def execute(self, command: str, arguments: Mapping[str, Any] | None = None) -> Any:
        await self.connect()
        async with self._commands:
            return await self._execute(command, arguments)

    async def _execute(self, command: str, arguments: Mapping[str, Any] | None) -> Any:
        try:
            return await self._client.execute(command, arguments)
        except ExecuteError:
            raise
        except (QMPError, EOFError, OSError, AssertionError) as e:
            raise MonitorUnavailable(f"QMP {command}: {e}") from None

    async def add_fd(self, fd: int) -> int:
        """Hand QEMU an open file (SCM_RIGHTS) as a new fd set; returns its id (a node opens it as
        `/dev/fdset/<id>`). For files QEMU cannot open by path: it runs in the VM's network
        namespace's own mount namespace, which does not see what is mounted after it started."""
        reply = await self._send_fd(fd, "add-fd", None, "add-fd")
        return int(reply["fdset-id"])

    async def pass_fd(self, name: str, fd: int) -> None:
        """Hand QEMU an open file descriptor (SCM_RIGHTS, then `getfd`) under `name`: a socket
        the agent opened where QEMU cannot (QEMU runs inside the VM's network namespace)."""
        await self._send_fd(fd, "getfd", {"fdname": name}, f"getfd {name}")

    async def _send_fd(
        self, fd: int, command: str, arguments: Mapping[str, Any] | None, what: str
    ) -> Any:
        """Send `fd`, then the `command` that claims it."""
        await self.connect()
        # QEMU keeps a passed descriptor only until its next read of the socket: nothing may
        # come between it and the command that claims it.
        async with self._commands:
            try:
                self._client.send_fd_scm(fd)
            except (QMPError, OSError, AssertionError) as e:
                raise MonitorUnavailable(f"QMP {what}: {e}") from None
            return await self._execute(command, arguments)

    async def status(self) -> str:
        """The run state: running, paused, shutdown, guest-panicked, ..."""
        reply = await self.execute("query-status")
        return str(reply["status"])

    def listen(self, names: Iterable[str]) -> EventListener:
        """Register a listener now (before querying state, so no event falls in between)."""
        listener = EventListener(tuple(names))
        self._client.register_listener(listener)
        return listener

    def forget(self, listener: EventListener) -> None:
        with contextlib.suppress(Exception):
            self._client.remove_listener(listener)

    async def quit(self) -> None:
        """Ask QEMU to exit; the reply may be lost to its EOF, which is fine."""
        with contextlib.suppress(MonitorUnavailable, ExecInterruptedError):
            await self.execute("quit")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.disconnect()
