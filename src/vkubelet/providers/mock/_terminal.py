"""The stdio of an exec or attach session: stream adapters, and with a TTY, a terminal.

A terminal works as a container's pty would: it echoes what is typed, lets the line be edited,
sends LF as CR LF, turns ^C into an interrupt of the foreground command and tracks the window
size the client reports (`stty size`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ...sdk.capabilities import AttachIO, InputStream, OutputStream, TerminalSize
from ._fs import NoSpace

T = TypeVar("T")

CHUNK = 65536
_MAX_LINE = 1 << 20


async def wait(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` was set within `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def unless(event: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if `event` is set first (`work` is then cancelled)."""
    return (await race(event, work))[1]


async def race(event: asyncio.Event, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result) if `work` ends first, else (False, None) and `work` is cancelled."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


class BytesInput:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._offset = 0

    async def read(self, max_bytes: int = CHUNK) -> bytes:
        chunk = self._data[self._offset : self._offset + max_bytes]
        self._offset += len(chunk)
        return chunk


class Discard:
    async def write(self, data: bytes) -> None:
        pass


class Collector:
    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, data: bytes) -> None:
        self.data += data


class TtyOutput:
    """Output through a terminal: each LF goes out as CR LF (the pty's onlcr)."""

    def __init__(self, target: OutputStream) -> None:
        self._target = target

    async def write(self, data: bytes) -> None:
        await self._target.write(data.replace(b"\n", b"\r\n"))


async def write_all(out: OutputStream, data: bytes) -> None:
    for start in range(0, len(data), CHUNK):
        await out.write(data[start : start + CHUNK])


async def read_all(source: InputStream, limit: int) -> bytes:
    """All of `source`; NoSpace past `limit` bytes."""
    data = bytearray()
    while chunk := await source.read():
        data += chunk
        if len(data) > limit:
            raise NoSpace
    return bytes(data)


async def say(out: OutputStream, text: str) -> None:
    await out.write(f"{text}\n".encode())


class LineReader:
    """Lines from a stream, for a shell; commands it runs read the rest through it too."""

    def __init__(self, source: InputStream) -> None:
        self._source = source
        self._buffer = bytearray()

    async def read(self, max_bytes: int = CHUNK) -> bytes:
        if self._buffer:
            chunk = bytes(self._buffer[:max_bytes])
            del self._buffer[:max_bytes]
            return chunk
        return await self._source.read(max_bytes)

    async def readline(self) -> bytes:
        """The next line with its newline; at the end, what is left without one; b"" after."""
        while b"\n" not in self._buffer and len(self._buffer) < _MAX_LINE:
            data = await self._source.read()
            if not data:
                break
            self._buffer += data
        end = self._buffer.find(b"\n") + 1 or len(self._buffer)
        line = bytes(self._buffer[:end])
        del self._buffer[:end]
        return line


class LineDiscipline:
    """A pty in canonical mode, as a container's would be: it echoes what is typed, lets the
    line be edited (backspace, ^U), hands it over on Enter; ^D ends the input once (the next
    reader gets more) and ^C interrupts the foreground command."""

    def __init__(
        self, source: InputStream, echo: OutputStream, interrupt: Callable[[], None]
    ) -> None:
        self._source = source
        self._echo = echo
        self._interrupt = interrupt
        self._lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._pending = b""
        self._ended = False

    async def read(self, max_bytes: int = CHUNK) -> bytes:
        if not self._pending:
            if self._ended and self._lines.empty():
                return b""
            self._pending = await self._lines.get()
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def pump(self) -> None:
        line = bytearray()
        try:
            while data := await self._source.read():
                echo = bytearray()
                ready: list[bytes | None] = []  # lines to hand over, None: ^C; after the echo
                for byte in data:
                    if byte == 0x03:  # ^C
                        echo += b"^C\r\n"
                        line.clear()
                        ready.append(None)
                    elif byte == 0x04:  # ^D: the line so far, or end of input if there is none
                        ready.append(bytes(line))
                        line.clear()
                    elif byte in (0x7F, 0x08):  # erase one (UTF-8) character
                        if line:
                            while line and line[-1] & 0xC0 == 0x80:
                                del line[-1]
                            if line:
                                del line[-1]
                            echo += b"\b \b"
                    elif byte == 0x15:  # ^U: erase the line
                        echo += b"\b \b" * len(line.decode(errors="replace"))
                        line.clear()
                    elif byte in (0x0D, 0x0A):  # Enter (icrnl)
                        line += b"\n"
                        echo += b"\r\n"
                        ready.append(bytes(line))
                        line.clear()
                    elif byte < 0x20 and byte != 0x09:  # other control characters show as ^X
                        line.append(byte)
                        echo += b"^" + bytes([byte + 0x40])
                    else:
                        line.append(byte)
                        echo.append(byte)
                if echo:  # as a pty: the echo is out before a reader can answer the line
                    await self._echo.write(bytes(echo))
                for item in ready:
                    if item is None:
                        self._interrupt()
                    else:
                        self._lines.put_nowait(item)
        finally:
            if line:
                self._lines.put_nowait(bytes(line))
            self._ended = True
            self._lines.put_nowait(b"")


@dataclass(frozen=True, slots=True)
class Stdio:
    stdin: InputStream
    stdout: OutputStream
    stderr: OutputStream


class Terminal:
    """The stdio of one exec or attach session. With a TTY: a line discipline on stdin,
    stderr merged into stdout, LF sent as CR LF, ^C, and the window size as last resized."""

    def __init__(self, io: AttachIO) -> None:
        self._io = io
        self.tty = io.tty
        self.size: TerminalSize | None = None
        self._sized = asyncio.Event()
        self._foreground: list[asyncio.Event] = []  # innermost last: ^C interrupts that one
        self._pending_interrupt = False
        self._tasks: list[asyncio.Task[None]] = []
        raw = io.stdout if io.stdout is not None else Discard()
        self._discipline: LineDiscipline | None = None
        if io.tty:
            tty_out = TtyOutput(raw)
            if io.stdin is not None:
                self._discipline = LineDiscipline(io.stdin, raw, self._interrupt)
            stdin: InputStream = self._discipline or BytesInput(b"")
            self.stdio = Stdio(stdin, tty_out, tty_out)
        else:
            self.stdio = Stdio(
                io.stdin if io.stdin is not None else BytesInput(b""),
                raw,
                io.stderr if io.stderr is not None else Discard(),
            )

    async def __aenter__(self) -> Terminal:
        self._tasks.append(asyncio.create_task(self._track_size()))
        if self._discipline is not None:
            self._tasks.append(asyncio.create_task(self._discipline.pump()))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _track_size(self) -> None:
        async for size in self._io.resizes:
            self.size = size
            self._sized.set()

    async def window_size(self) -> tuple[int, int]:
        """(rows, columns); the client sends its size right away, so wait a moment for it."""
        if self.size is None:
            await wait(self._sized, 1.0)
        size = self.size
        return (0, 0) if size is None else (size.height, size.width)

    def _interrupt(self) -> None:
        if self._foreground:
            self._foreground[-1].set()

    async def foreground(self, work: Awaitable[T]) -> T | None:
        """`work`, unless ^C comes first: then it is cancelled and the result is None.
        Calls nest (a shell's command runs in the foreground of the shell's session). A ^C
        that came as `work` was ending anyway (typed right after Enter, say) goes to the
        next foreground work: the command that line starts."""
        if not self.tty:
            return await work
        interrupted = asyncio.Event()
        if self._pending_interrupt:
            self._pending_interrupt = False
            interrupted.set()
        self._foreground.append(interrupted)
        finished = True
        try:
            finished, result = await race(interrupted, work)
        finally:
            self._foreground.remove(interrupted)
            if finished and interrupted.is_set():
                self._pending_interrupt = True
        return result
