"""Closing a streaming session; its inbound buffers are `vkubelet.sdk.pipe.InboundPipe`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


async def shut_down(
    reader: asyncio.Task[None] | None, end: Callable[[], None], writer: asyncio.StreamWriter
) -> None:
    """The last step of closing a streaming session (SPDY or WebSocket): stop its read loop,
    end every stream (`end`), then close the socket."""
    if reader is not None:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    end()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
