"""kubectl's streaming verbs on a VM: exec through the guest agent, attach to the serial
console, port-forward to the guest's address.

The guest agent's `guest-exec` takes a command's stdin whole at its start and returns its output
whole at its end: so stdin is read to its end first, and there is no terminal (`-t` is refused
with a message saying what to use instead). The serial console is a byte stream both ways, which
is what `attach -it` wants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from ...sdk import AttachIO, ByteStream, forward_connection
from ._backend import MachineHandle

__all__ = ["TTY_REFUSED", "attach_console", "exec_through_agent", "forward_tcp"]

TTY_REFUSED = (
    "kubectl exec -t is not supported by the VM provider (commands run through the QEMU guest "
    "agent, which has no terminal); use kubectl attach -it for the serial console, or exec "
    "without -t"
)
_CHUNK = 65536


async def exec_through_agent(machine: MachineHandle, command: Sequence[str], io: AttachIO) -> int:
    """A command without a terminal (the caller refuses `-t` with `TTY_REFUSED`)."""
    chunks = []
    while io.stdin is not None and (data := await io.stdin.read()):
        chunks.append(data)
    output = await machine.exec(list(command), stdin=b"".join(chunks))
    if io.stdout is not None and output.stdout:
        await io.stdout.write(output.stdout)
    if io.stderr is not None and output.stderr:
        await io.stderr.write(output.stderr)
    return output.exit_code


async def attach_console(socket: Path, io: AttachIO) -> None:
    """Relay the console both ways until the client goes (or the console closes)."""
    reader, writer = await asyncio.open_unix_connection(str(socket))

    async def upstream() -> None:
        while io.stdin is not None and (data := await io.stdin.read()):
            writer.write(data)
            await writer.drain()

    up = asyncio.create_task(upstream())
    try:
        while data := await reader.read(_CHUNK):
            if io.stdout is not None:
                await io.stdout.write(data)
    finally:
        up.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await up
        writer.close()


async def forward_tcp(address: str, port: int, stream: ByteStream) -> None:
    """One forwarded connection, copied both ways until both directions have ended."""
    reader, writer = await asyncio.open_connection(address, port)
    await forward_connection(stream, reader, writer)
