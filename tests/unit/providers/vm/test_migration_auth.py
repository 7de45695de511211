"""The target's migration ports take only connections that start with the migration's token:
others are refused and logged (the token never is), and what follows the token reaches QEMU
byte for byte (the stream's first bytes are QEMU's, not ours)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._migrate import IncomingMigration
from vkubelet.testing.harness import eventually

TOKEN = "5e" * 32


class FakeMonitor:
    """QMP as far as the target's side uses it; keeps a copy of each descriptor passed."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, Any]] = []
        self.fds: dict[str, int] = {}

    async def execute(self, command: str, arguments: Any = None) -> Any:
        self.commands.append((command, arguments))
        if command == "query-block":
            return [{"device": "disk0", "inserted": {"node-name": "n0", "ro": False}}]
        return {}

    async def pass_fd(self, name: str, fd: int) -> None:
        self.fds[name] = os.dup(fd)


async def _send(port: int, data: bytes, *, read: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(100), 5) if read else b""
    writer.close()
    return got


async def test_only_a_connection_with_the_token_reaches_the_target_qemu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    monitor = FakeMonitor()
    incoming = IncomingMigration(monitor, "127.0.0.1", TOKEN, tmp_path / "nbd.sock")  # type: ignore[arg-type]
    endpoint = await incoming.open()
    try:
        # The migration stream: a stranger, then a wrong token, are refused; QEMU is not told.
        await _send(endpoint.migration_port, b"QEVM\x00\x00\x00\x03")
        await _send(endpoint.migration_port, b"0" * 64 + b"\nQEVM")
        await eventually(lambda: caplog.text.count("refused") >= 2)
        assert "migrate-incoming" not in [c for c, _ in monitor.commands]
        # The right token: QEMU gets the connection, and reads the stream from its first byte.
        await _send(endpoint.migration_port, TOKEN.encode() + b"\nQEVM-stream")
        await eventually(lambda: "migrate-incoming" in [c for c, _ in monitor.commands])
        stream = socket.socket(fileno=monitor.fds["migration-in"])
        stream.settimeout(5)
        assert stream.recv(100) == b"QEVM-stream"
        stream.close()

        # The console history: only with the token.
        await _send(endpoint.console_port, b"stolen history")
        assert await incoming.history(0.3) == b""
        await _send(endpoint.console_port, TOKEN.encode() + b"\nthe history")
        assert await incoming.history(5) == b"the history"

        # NBD: relayed to QEMU's own (unix) server only after the token.
        server = socket.socket(fileno=monitor.fds["migration-nbd"])
        server.setblocking(False)
        loop = asyncio.get_running_loop()

        async def nbd_server() -> None:
            connection, _ = await loop.sock_accept(server)
            await loop.sock_sendall(connection, b"NBDMAGIC" + await loop.sock_recv(connection, 9))
            connection.close()

        serving = asyncio.create_task(nbd_server())
        assert await _send(endpoint.nbd_port, b"x" * 64 + b"\nhello", read=True) == b""
        reply = await _send(endpoint.nbd_port, TOKEN.encode() + b"\nhello nbd", read=True)
        assert reply == b"NBDMAGIChello nbd"
        await serving
        server.close()
    finally:
        await incoming.close()
    assert caplog.text.count("refused") == 4  # stream x2, console, NBD
    assert TOKEN not in caplog.text


async def test_a_target_without_a_token_does_not_open(tmp_path: Path) -> None:
    incoming = IncomingMigration(FakeMonitor(), "127.0.0.1", "", tmp_path / "nbd.sock")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="migration-token"):
        await incoming.open()
    await incoming.close()
