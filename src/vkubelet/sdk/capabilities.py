"""Optional provider capabilities behind kubectl's streaming verbs and node metrics.

A provider implements only the lifecycle in `provider.py`; each protocol here is something more
it may offer. The kubelet server checks them with `isinstance` per request, so a provider that
cannot, say, forward ports gets a clear 501 naming the missing capability instead of a request
that hangs or a generic error.

The byte streams are protocols rather than concrete classes because the kubelet server carries
them over several transports (SPDY streams, WebSocket channels, an in-memory buffer for `/run`);
a provider sees one small async interface whichever the client used. Every call may be cancelled
when the client goes away: providers should release what they hold in `finally` blocks.

Errors: raise `ProviderError("NotFound", message)` for an unknown pod or container (the client
gets a 404 where the protocol still allows a status code); any other exception is reported as an
internal error with its message.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..protocols.remotecommand import TerminalSize
from .provider import ContainerLogOptions, ContainerLogs

__all__ = [
    "AttachIO",
    "ByteStream",
    "ContainerAttach",
    "ContainerExec",
    "ContainerLogOptions",
    "ContainerLogs",
    "InputStream",
    "MetricsProvider",
    "OutputStream",
    "PortForwarder",
    "ResizeQueue",
    "StatsProvider",
    "TerminalSize",
]


class InputStream(Protocol):
    """Bytes the client sends (stdin, or the client side of a forwarded connection)."""

    async def read(self, max_bytes: int = 65536) -> bytes:
        """Up to `max_bytes`, waiting for at least one; b"" once the client has finished."""
        ...


class OutputStream(Protocol):
    """Bytes for the client. Writes wait while the client is slow (that is the back-pressure)
    and raise an `OSError` such as `BrokenPipeError` once the client has gone."""

    async def write(self, data: bytes) -> None: ...


class ByteStream(InputStream, OutputStream, Protocol):
    """Both directions of one forwarded connection."""

    async def close(self) -> None:
        """Half-close: the client learns that no more data comes. Reading may go on."""
        ...


class ResizeQueue:
    """Terminal sizes in the order the client sent them; iteration ends with the session.

    Only the most recent sizes matter to a terminal, so a provider that reads slowly (or never)
    costs at most `maxsize` entries: the oldest are dropped.
    """

    def __init__(self, maxsize: int = 16) -> None:
        self._sizes: deque[TerminalSize] = deque(maxlen=maxsize)
        self._closed = False
        self._changed = asyncio.Event()

    def put(self, size: TerminalSize) -> None:
        if not self._closed:
            self._sizes.append(size)
            self._changed.set()

    def close(self) -> None:
        self._closed = True
        self._changed.set()

    def __aiter__(self) -> AsyncIterator[TerminalSize]:
        return self

    async def __anext__(self) -> TerminalSize:
        while not self._sizes:
            if self._closed:
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()
        return self._sizes.popleft()


@dataclass(frozen=True, eq=False)
class AttachIO:
    """The stdio a client asked for. A stream the client did not request is None.

    With `tty`, stderr is always None (a terminal merges it into stdout) and the first resize
    usually arrives right away with the client's window size.
    """

    stdin: InputStream | None
    stdout: OutputStream | None
    stderr: OutputStream | None
    tty: bool = False
    resizes: ResizeQueue = field(default_factory=ResizeQueue)


@runtime_checkable
class ContainerExec(Protocol):
    """`kubectl exec` and `kubectl cp` (which is `tar` over exec)."""

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        """Run `command` in the container and return its exit code once it has exited.

        The client sees the code: 0 is success, anything else makes kubectl exit with it.
        The protocol carries 0..255: a negative code -N means "killed by signal N" and is
        reported as 128+N, as shells do, and larger codes as 255.

        A command that cannot be started is an ordinary outcome, as in a shell: raise
        `ProviderError("CommandNotFound", message)` (exit code 127) or
        `ProviderError("CommandNotExecutable", message)` (126) — or write the message to
        stderr and return the code yourself. kubectl prints the message and "command terminated
        with exit code 127". (A real kubelet reports an internal error instead, which kubectl
        1.30+ shows as "Internal error occurred: Internal error occurred: ... exec: "/nope":
        stat /nope: no such file or directory" and exit code 1.) Any other exception means the
        backend failed: the client gets its message as an internal error.
        """
        ...


@runtime_checkable
class ContainerAttach(Protocol):
    """`kubectl attach`: the container's main process's stdio rather than a new process."""

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        """Relay stdio until the client detaches (cancellation) or the process ends (return)."""
        ...


@runtime_checkable
class PortForwarder(Protocol):
    """`kubectl port-forward`: one call per forwarded TCP connection, many at once."""

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        """Connect to `port` in the pod and copy both ways until both directions have ended.

        Typically: copy `stream.read()` to the target until b"" and then shut the target's
        write side; copy the target to `stream.write()` until it ends, then `stream.close()`.
        Raise if the connection cannot be made; the client is shown the message.
        """
        ...


@runtime_checkable
class StatsProvider(Protocol):
    """`kubectl top` and the metrics-server read the kubelet's `/stats/summary`."""

    async def stats_summary(self) -> dict[str, Any]:
        """A `stats/v1alpha1` Summary: `{"node": {...}, "pods": [...]}` as the kubelet's JSON."""
        ...


@runtime_checkable
class MetricsProvider(Protocol):
    """The metrics-server (v0.6+) scrapes `/metrics/resource` instead of the summary."""

    async def metrics_resource(self) -> str:
        """Prometheus text exposition: `node_cpu_usage_seconds_total`, `container_*`, ..."""
        ...
