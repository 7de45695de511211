"""The guest agent client against a fake agent on a unix socket (QGA framing, as QEMU relays it)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._qga import (
    GuestAgent,
    GuestAgentError,
    GuestAgentUnavailable,
)

Handler = Callable[[str, dict[str, Any]], Any]


class FakeAgent:
    """Answers like qemu-ga: 0xFF-delimited sync replies, one JSON line per command."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handlers: dict[str, Handler] = {}
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.stale = b""  # written to a new connection first, like leftovers in the channel
        self.silent = False  # a guest whose agent has not started yet
        self.server: asyncio.Server | None = None
        self.connections = 0

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.write(self.stale)
        buffer = b""
        try:
            while data := await reader.read(65536):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if self.silent:
                        continue
                    self._answer(line.replace(b"\xff", b""), writer)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    def _answer(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        message = json.loads(line)
        command, arguments = message["execute"], message.get("arguments", {})
        self.received.append((command, arguments))
        if command == "guest-sync-delimited":
            writer.write(b"\xff" + json.dumps({"return": arguments["id"]}).encode() + b"\n")
            return
        if command == "guest-shutdown":
            return  # no reply on success
        handler = self.handlers.get(command)
        if handler is None:
            reply: dict[str, Any] = {
                "error": {"class": "CommandNotFound", "desc": f"{command} not found"}
            }
        else:
            reply = {"return": handler(command, arguments)}
        writer.write(json.dumps(reply).encode() + b"\n")

    def commands(self) -> list[str]:
        return [c for c, _ in self.received if c != "guest-sync-delimited"]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[FakeAgent]:
    fake = FakeAgent(tmp_path / "qga.sock")
    await fake.start()
    yield fake
    await fake.stop()


async def test_stale_bytes_in_the_channel_are_discarded_by_the_delimited_sync(
    agent: FakeAgent,
) -> None:
    agent.stale = b'{"return": {"pid": 99}}\n{"error": {"class": "GenericError", "desc": "x"}}\n'
    agent.handlers["guest-ping"] = lambda c, a: {}
    client = GuestAgent(agent.path, timeout=2)
    await client.wait_ready(5)
    await client.ping()
    assert agent.commands() == ["guest-ping"]
    await client.close()


async def test_wait_ready_gives_up_when_the_agent_never_answers(agent: FakeAgent) -> None:
    agent.silent = True
    client = GuestAgent(agent.path)
    with pytest.raises(GuestAgentUnavailable):
        await client.wait_ready(0.6)
    await client.close()


async def test_wait_ready_waits_for_the_socket_to_appear(tmp_path: Path) -> None:
    fake = FakeAgent(tmp_path / "late.sock")
    client = GuestAgent(fake.path)
    waiting = asyncio.create_task(client.wait_ready(5))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await fake.start()
    await waiting
    await client.close()
    await fake.stop()


async def test_exec_sends_argv_and_stdin_and_returns_decoded_output_and_exit_code(
    agent: FakeAgent,
) -> None:
    polls = []

    def status(_: str, arguments: dict[str, Any]) -> dict[str, Any]:
        polls.append(arguments["pid"])
        if len(polls) < 3:
            return {"exited": False}
        return {
            "exited": True,
            "exitcode": 3,
            "out-data": base64.b64encode(b"web-0\n").decode(),
            "err-data": base64.b64encode(b"oops").decode(),
        }

    agent.handlers["guest-exec"] = lambda c, a: {"pid": 42}
    agent.handlers["guest-exec-status"] = status
    client = GuestAgent(agent.path)
    result = await client.exec(["sh", "-c", "cat; exit 3"], stdin=b"in put")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"web-0\n", b"oops")
    _, exec_args = next(r for r in agent.received if r[0] == "guest-exec")
    assert exec_args["path"] == "sh" and exec_args["arg"] == ["-c", "cat; exit 3"]
    assert base64.b64decode(exec_args["input-data"]) == b"in put"
    assert exec_args["capture-output"] is True
    assert polls == [42, 42, 42]
    await client.close()


async def test_exec_killed_by_a_signal_reports_128_plus_the_signal(agent: FakeAgent) -> None:
    agent.handlers["guest-exec"] = lambda c, a: {"pid": 7}
    agent.handlers["guest-exec-status"] = lambda c, a: {"exited": True, "signal": 9}
    result = await GuestAgent(agent.path).exec(["sleep", "100"])
    assert (result.exit_code, result.signal) == (137, 9)


async def test_exec_timeout_kills_the_guest_process(agent: FakeAgent) -> None:
    pids = iter([5, 6])
    agent.handlers["guest-exec"] = lambda c, a: {"pid": next(pids)}
    agent.handlers["guest-exec-status"] = lambda c, a: {"exited": False}
    client = GuestAgent(agent.path)
    with pytest.raises(TimeoutError):
        await client.exec(["sleep", "100"], timeout=0.3)
    kills = [a for c, a in agent.received if c == "guest-exec" and a["path"] == "kill"]
    assert [k["arg"] for k in kills] == [["-KILL", "5"]]


async def test_agent_errors_raise_with_the_error_class(agent: FakeAgent) -> None:
    client = GuestAgent(agent.path)
    with pytest.raises(GuestAgentError) as caught:
        await client.call("guest-no-such-thing")
    assert caught.value.error_class == "CommandNotFound"
    agent.handlers["guest-ping"] = lambda c, a: {}
    await client.ping()  # the channel is still usable after an error
    await client.close()


async def test_a_lost_connection_is_reopened_and_resynced_on_the_next_call(
    agent: FakeAgent,
) -> None:
    agent.handlers["guest-info"] = lambda c, a: {"version": "7.2.22"}
    client = GuestAgent(agent.path)
    assert (await client.info())["version"] == "7.2.22"
    assert client._writer is not None
    client._writer.transport.abort()  # the connection drops (QEMU restarted its chardev)
    with pytest.raises(GuestAgentUnavailable):
        await client.info()
    assert (await client.info())["version"] == "7.2.22"
    assert agent.connections == 2
    await client.close()


async def test_shutdown_does_not_wait_for_a_reply_and_the_next_call_resyncs(
    agent: FakeAgent,
) -> None:
    agent.handlers["guest-ping"] = lambda c, a: {}
    client = GuestAgent(agent.path, timeout=1)
    await client.shutdown()
    await client.ping()
    assert agent.commands() == ["guest-shutdown", "guest-ping"]
    assert ("guest-shutdown", {"mode": "powerdown"}) in agent.received
    await client.close()


async def test_network_interfaces_are_parsed(agent: FakeAgent) -> None:
    agent.handlers["guest-network-get-interfaces"] = lambda c, a: [
        {"name": "lo", "ip-addresses": [{"ip-address": "127.0.0.1", "prefix": 8}]},
        {
            "name": "eth0",
            "hardware-address": "52:54:00:00:00:01",
            "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "10.88.0.2", "prefix": 24}],
        },
    ]
    interfaces = await GuestAgent(agent.path).network_interfaces()
    eth0 = next(i for i in interfaces if i.name == "eth0")
    assert eth0.mac == "52:54:00:00:00:01" and eth0.addresses == (("10.88.0.2", 24),)
