"""Relaying a client's stdio to a process: stdin EOF, both outputs, back-pressure, resizes."""

from __future__ import annotations

import asyncio
import sys

from vkubelet.sdk.capabilities import AttachIO, TerminalSize
from vkubelet.sdk.stdio import initial_size, relay, relay_process


class Input:
    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def read(self, max_bytes: int = 65536) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class Output:
    def __init__(self, room: int | None = None) -> None:
        self.data = bytearray()
        self.room = asyncio.Semaphore(room) if room is not None else None

    async def write(self, data: bytes) -> None:
        if self.room is not None:
            await self.room.acquire()  # a slow client: one write per release
        self.data += data


async def spawn(code: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_stdin_reaches_the_process_and_its_end_ends_the_process() -> None:
    io = AttachIO(Input(b"hello ", b"world"), Output(), Output())
    proc = await spawn("import sys; sys.stdout.write(sys.stdin.read().upper())")
    assert await asyncio.wait_for(relay_process(proc, io), 10) == 0
    assert io.stdout.data == b"HELLO WORLD"  # type: ignore[union-attr]


async def test_without_stdin_the_process_reads_an_empty_input() -> None:
    io = AttachIO(None, Output(), Output())
    proc = await spawn("import sys; print(len(sys.stdin.read()))")
    assert await asyncio.wait_for(relay_process(proc, io), 10) == 0
    assert io.stdout.data == b"0\n"  # type: ignore[union-attr]


async def test_stdout_and_stderr_go_to_their_own_streams_and_the_exit_code_comes_back() -> None:
    io = AttachIO(None, Output(), Output())
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(7)"
    assert await asyncio.wait_for(relay_process(await spawn(code), io), 10) == 7
    assert io.stdout.data == b"out\n" and io.stderr.data == b"err\n"  # type: ignore[union-attr]


async def test_with_a_tty_stderr_is_merged_into_stdout() -> None:
    io = AttachIO(None, Output(), None, tty=True)
    code = "import sys; print('err', file=sys.stderr)"
    assert await asyncio.wait_for(relay_process(await spawn(code), io), 10) == 0
    assert io.stdout.data == b"err\n"  # type: ignore[union-attr]


async def test_a_process_killed_by_a_signal_reports_minus_the_signal() -> None:
    io = AttachIO(None, Output(), Output())
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert await asyncio.wait_for(relay_process(await spawn(code), io), 10) == -9


async def test_a_slow_client_slows_the_process_down_instead_of_filling_memory() -> None:
    stdout = Output(room=2)
    io = AttachIO(None, stdout, Output())
    code = "import sys\nfor _ in range(200): sys.stdout.write('x' * 65536); sys.stdout.flush()"
    proc = await spawn(code)
    task = asyncio.create_task(relay_process(proc, io))
    await asyncio.sleep(0.5)
    assert len(stdout.data) <= 2 * 65536  # two writes allowed, the rest waits in the pipe
    assert proc.returncode is None  # the process is blocked writing, not finished
    for _ in range(400):
        stdout.room.release()  # type: ignore[union-attr]
    assert await asyncio.wait_for(task, 10) == 0
    assert len(stdout.data) == 200 * 65536


async def test_cancelling_the_relay_kills_the_process() -> None:
    io = AttachIO(None, Output(), Output())
    proc = await spawn("import time; time.sleep(60)")
    task = asyncio.create_task(relay_process(proc, io))
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert proc.returncode is not None


async def test_terminal_resizes_are_passed_on_and_the_first_is_the_initial_size() -> None:
    io = AttachIO(None, Output(), None, tty=True)
    io.resizes.put(TerminalSize(100, 30))
    assert await initial_size(io) == (100, 30)
    assert await initial_size(io, wait=0.01) == (80, 24)
    sizes: list[tuple[int, int]] = []
    io.resizes.put(TerminalSize(120, 40))

    class Quiet:
        async def read(self, n: int = -1, /) -> bytes:
            await asyncio.sleep(0.1)
            return b""

    await relay(
        io, stdin=None, stdout=Quiet(), stderr=None, resize=lambda w, h: sizes.append((w, h))
    )
    assert sizes == [(120, 40)]
