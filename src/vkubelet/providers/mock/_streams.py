"""What `kubectl logs`, `kubectl attach` and `kubectl port-forward` reach in a mock pod.

- logs: a few lines the container "printed" when it started (its env too with the print-env
  annotation), then for a follower `mock: tick N` every tick until the pod stops.
- attach: a "main process" that echoes stdin upper-cased.
- port-forward: the port on 127.0.0.1, since the mock's pods "are" the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator

from ...sdk import ContainerLogOptions
from ...sdk.capabilities import AttachIO, ByteStream
from ...sdk.clock import now_rfc3339
from ...sdk.stdio import forward_connection
from ._records import MockContainer, MockPod, parse_time
from ._terminal import LineReader, Terminal, unless, wait

_FORWARD_LINGER = 1.0  # seconds a client may go on sending after the server closed (containerd's)


# -- logs -----------------------------------------------------------------------------------------
async def log_lines(
    mock: MockPod,
    container: MockContainer,
    options: ContainerLogOptions,
    stopped: asyncio.Event | None,
    tick: float,
) -> AsyncGenerator[bytes, None]:
    """The container's log as `options` select it (but for `limit_bytes`). With `stopped` (a
    follower of a running pod), a tick every `tick` seconds follows until that event is set."""
    lines = [
        f"mock: container {container.name} of {mock.namespace}/{mock.name} started",
        f"mock: image {container.image}",
    ]
    if mock.print_env:
        lines += [f"{name}={value}" for name, value in container.env]
    lines.append(f"mock: {len(lines) - 1} lines")
    if options.tail_lines is not None:
        lines = lines[-options.tail_lines :] if options.tail_lines else []
    written = mock.started or mock.created  # when the container "printed" these lines
    since = options.earliest()
    if since is not None and parse_time(written) < since:
        lines = []
    for line in lines:
        stamp = f"{written} " if options.timestamps else ""
        yield f"{stamp}{line}\n".encode()
    if stopped is None:
        return
    count = 0
    while not await wait(stopped, tick):
        count += 1
        stamp = f"{now_rfc3339()} " if options.timestamps else ""
        yield f"{stamp}mock: tick {count}\n".encode()


# -- attach ---------------------------------------------------------------------------------------
async def attach(container: str, io: AttachIO, stopped: asyncio.Event, tick: float) -> None:
    """The container's main process, until it ends or `stopped` is set."""
    async with Terminal(io) as terminal:
        main = _main_process(container, terminal, io.stdin is not None, tick)
        await unless(stopped, main)


async def _main_process(container: str, terminal: Terminal, has_stdin: bool, tick: float) -> None:
    """A line echo, or a ticker without stdin."""
    stdout = terminal.stdio.stdout
    if has_stdin:
        reader = LineReader(terminal.stdio.stdin)
        while line := await terminal.foreground(reader.readline()):
            await stdout.write(line.upper())
        return
    count = 0
    while True:
        count += 1
        await stdout.write(f"mock: {container} is running ({count})\n".encode())
        await asyncio.sleep(tick)


# -- port-forward ---------------------------------------------------------------------------------
async def forward(port: int, stream: ByteStream, pod: str) -> None:
    """Connect to `port` on 127.0.0.1 and copy both ways; `pod` names the pod in errors.

    When the server closes first the client gets a moment to finish, as containerd gives it;
    when the client finishes sending, the server decides when the connection ends."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
        raise ConnectionError(
            f"failed to connect to localhost:{port} inside the mock pod {pod}: "
            f"dial tcp4 127.0.0.1:{port}: connect: {reason.lower()}"
        ) from None

    try:
        await forward_connection(stream, reader, writer, linger=_FORWARD_LINGER)
    finally:
        with contextlib.suppress(OSError):
            await writer.wait_closed()
