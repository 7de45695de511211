"""How the probe engine (`vkubelet.sdk.probes`) reaches a device's containers.

A kubelet probes the containers of its own machine; here the agent probes across the device's
SSH link. An exec probe is a command in the container's environment, in an SSH session; httpGet,
tcpSocket and grpc connect from the device itself (a direct-tcpip channel), so that a server
which only listens on the device's loopback answers as it would answer a kubelet on the device.
A probe that cannot tell because the device is unreachable counts neither way: the node is
NotReady already, and a container must not be restarted because a network link failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from ...sdk.probes import ExecResult, ProbeKind, ProbeReader, ProbeUnknown, ProbeWriter
from . import _remote
from ._link import Completed, Unreachable

__all__ = ["DEFAULT_HOST", "DeviceProbes", "Link"]

DEFAULT_HOST = "127.0.0.1"  # the pod IP is the device's, but loopback is sure to be served


class Link(Protocol):
    """What probes need of a `DeviceLink` (unit tests pass an in-memory one)."""

    @property
    def connected(self) -> bool: ...

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed: ...

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]: ...


class DeviceProbes:
    """The `ProbeTransport` of one pod on a device, and its restart callback."""

    def __init__(
        self,
        link: Link,
        root: str,
        uid: str,
        *,
        exec_line: Callable[[str, list[str]], str] | None = None,
    ) -> None:
        self._link = link
        self._root = root
        self._uid = uid
        # The command line of an exec in a container (a runtime container's differs).
        self._exec_line = exec_line or (
            lambda container, argv: _remote.exec_command(root, uid, container, argv)
        )

    def available(self) -> bool:
        return self._link.connected

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        """The command, killed on the device if it outlasts `limit` seconds: the engine only gives
        up on it, and a probe that hangs every period would pile up processes.
        (No `timeout` command: busybox's took other options before 1.30.)"""
        line = self._exec_line(container, list(command))
        seconds = max(1, math.ceil(limit))
        script = (
            f"{line} </dev/null &\n"
            "p=$!\n"
            f"(sleep {seconds}; kill -KILL $p) >/dev/null 2>&1 &\n"
            "k=$!\n"
            "wait $p\n"
            "c=$?\n"
            "kill $k 2>/dev/null\n"
            "exit $c\n"
        )
        try:
            result = await self._link.run(script, deadline=limit + 5)
        except Unreachable as e:
            raise ProbeUnknown(str(e)) from None
        return ExecResult(result.exit_status, result.stdout + result.stderr)

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]:
        try:
            return await self._link.open_connection(host, port)
        except Unreachable as e:
            raise ProbeUnknown(str(e)) from None

    async def restart(self, container: str, grace_seconds: int, kind: ProbeKind) -> None:
        """End the run; the device's supervisor restarts the container as the policy says."""
        script = _remote.restart_container_script(self._root, self._uid, container, grace_seconds)
        (await self._link.run(script)).check(f"restarting container {container}")
