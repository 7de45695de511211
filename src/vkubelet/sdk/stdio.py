"""Relaying a client's stdio (`AttachIO`) to a process's streams, for exec and attach.

Every provider that runs a process for `kubectl exec` (a local subprocess, an SSH channel, a
CRI stream) copies the same three streams the same way; the details are where relays go wrong:

- stdin: copied until the client ends it, then the process's stdin is closed (EOF), so that
  `kubectl exec -i ... cat` ends; a client without stdin leaves the process an empty one.
- stdout/stderr: copied until the process closes them; each write waits for the client (the
  back-pressure: a slow client slows the process down rather than filling memory). With a TTY
  there is no stderr (a terminal merges it).
- terminal resizes: passed to a callback as they come.
- the relay ends when the outputs have ended; what still reads stdin or resizes is cancelled.

`forward_connection` is the same relay for `kubectl port-forward`: one byte stream to one
connection, both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from .capabilities import AttachIO, ByteStream, InputStream, OutputStream

__all__ = [
    "ProcessInput",
    "ProcessOutput",
    "forward_connection",
    "initial_size",
    "relay",
    "relay_process",
]

_CHUNK = 64 * 1024


class ProcessOutput(Protocol):
    """A process's stdout or stderr: asyncio's `StreamReader`, asyncssh's `SSHReader`..."""

    async def read(self, n: int = -1, /) -> bytes: ...


class ProcessInput(Protocol):
    """A process's stdin: asyncio's `StreamWriter`, asyncssh's `SSHWriter`..."""

    def write(self, data: bytes, /) -> None: ...

    async def drain(self) -> None: ...

    def write_eof(self) -> None: ...


class ConnectionInput(ProcessInput, Protocol):
    """The sending half of a forwarded connection: asyncio's `StreamWriter`, asyncssh's..."""

    def can_write_eof(self) -> bool: ...

    def close(self) -> None: ...


async def _copy_in(source: InputStream | None, target: ProcessInput) -> None:
    try:
        while source is not None and (data := await source.read()):
            target.write(data)
            await target.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError, AttributeError):
            target.write_eof()


async def _copy_out(source: ProcessOutput, target: OutputStream | None) -> None:
    while data := await source.read(_CHUNK):
        if target is not None:  # not asked for: read and dropped, so the process never blocks
            await target.write(data)


async def _resize(io: AttachIO, callback: Callable[[int, int], None]) -> None:
    async for size in io.resizes:
        callback(size.width, size.height)


async def initial_size(
    io: AttachIO, default: tuple[int, int] = (80, 24), wait: float = 0.5
) -> tuple[int, int]:
    """The client's window size (width, height) for a TTY, which clients send first, right
    away; `default` if none comes within `wait` seconds."""
    with contextlib.suppress(TimeoutError, StopAsyncIteration):
        size = await asyncio.wait_for(anext(io.resizes), wait)
        return size.width, size.height
    return default


async def relay(
    io: AttachIO,
    *,
    stdin: ProcessInput | None,
    stdout: ProcessOutput | None,
    stderr: ProcessOutput | None,
    resize: Callable[[int, int], None] | None = None,
) -> None:
    """Copy the client's stdin to `stdin` and `stdout`/`stderr` to the client until both
    outputs have ended (see the module's rules). A client that goes away makes a write raise
    (`OSError`), which ends the relay with that error; cancelling it stops every copy."""
    helpers: list[asyncio.Task[None]] = []
    if stdin is not None:
        helpers.append(asyncio.create_task(_copy_in(io.stdin, stdin)))
    if resize is not None and io.tty:
        helpers.append(asyncio.create_task(_resize(io, resize)))
    try:
        outputs = []
        if stdout is not None:
            outputs.append(_copy_out(stdout, io.stdout))
        if stderr is not None:
            outputs.append(_copy_out(stderr, io.stdout if io.tty else io.stderr))
        await asyncio.gather(*outputs)
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


async def relay_process(proc: asyncio.subprocess.Process, io: AttachIO) -> int:
    """Relay an asyncio subprocess (started with pipes for the streams to relay) and return its
    exit code once it has exited: -N if a signal N killed it, as `ContainerExec` expects. If the
    relay is cancelled or fails, the process is killed."""
    try:
        await relay(io, stdin=proc.stdin, stdout=proc.stdout, stderr=proc.stderr)
        return await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())


async def forward_connection(
    stream: ByteStream,
    reader: ProcessOutput,
    writer: ConnectionInput,
    *,
    linger: float | None = None,
) -> None:
    """Copy a port-forward `stream` to a connection and back, then close the connection.

    When the client finishes sending, the connection is half-closed (EOF) and the server
    decides when it ends; when the server closes first, the client may go on sending for
    `linger` seconds (None: until it is done; containerd gives it one second). A failure either
    way ends both directions with that error."""

    async def upstream() -> None:  # client -> server
        while data := await stream.read():
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def downstream() -> None:  # server -> client
        while data := await reader.read(_CHUNK):
            await stream.write(data)
        await stream.close()

    up, down = asyncio.create_task(upstream()), asyncio.create_task(downstream())
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if not any(task.exception() for task in done):
            await (asyncio.wait({up}, timeout=linger) if down in done else asyncio.wait({down}))
        for task in (down, up):
            if task.done() and (error := task.exception()) is not None:
                raise error
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        writer.close()
