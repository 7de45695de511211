"""A small asyncio client for the QEMU guest agent (QGA) over its virtio-serial chardev socket.

Our own client rather than `qemu.qmp`: that library speaks QMP (server greeting, capability
negotiation, asynchronous events), while the guest agent has no greeting and its channel can hold
stale bytes from an earlier client (an agent that was killed mid-command, a guest that just booted
and finds a queue of our earlier attempts). The QGA answer to that is `guest-sync-delimited`: we
send 0xFF (the guest's parser resets), the agent answers 0xFF + `{"return": id}`, and everything
before that 0xFF is discarded. After a timeout the channel state is unknown, so the next command
resynchronises first. Commands are serialised: the agent handles one at a time. Methods take
per-call timeouts (ASYNC109 waived): a deadline for the guest, the contract's signatures.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...sdk.retry import Backoff

_DELIMITER = b"\xff"
_LIMIT = 64 * 1024 * 1024  # guest-exec-status carries all output at once, base64


class GuestAgentError(Exception):
    """The guest agent answered with an error."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"{command}: {error_class}: {desc}")
        self.error_class = error_class


class GuestAgentUnavailable(ConnectionError):
    """No answer from the guest agent (socket absent, guest not booted, agent not running)."""


@dataclass(frozen=True)
class ExecOutput:
    exit_code: int  # 128 + signal when the process was killed by a signal, like a shell
    stdout: bytes
    stderr: bytes
    signal: int | None = None
    truncated: bool = False


@dataclass(frozen=True)
class GuestInterface:
    name: str
    mac: str | None
    addresses: tuple[tuple[str, int], ...]  # (address, prefix length)


def encode(command: str, arguments: Mapping[str, Any] | None = None) -> bytes:
    message: dict[str, Any] = {"execute": command}
    if arguments:
        message["arguments"] = dict(arguments)
    return json.dumps(message).encode() + b"\n"


def exec_output(status: Mapping[str, Any]) -> ExecOutput:
    """An ExecOutput from a `guest-exec-status` reply whose `exited` is true."""
    signal = status.get("signal")
    code = status.get("exitcode")
    if code is None:
        code = 128 + int(signal) if signal is not None else 255
    return ExecOutput(
        exit_code=int(code),
        stdout=base64.b64decode(status.get("out-data", "")),
        stderr=base64.b64decode(status.get("err-data", "")),
        signal=int(signal) if signal is not None else None,
        truncated=bool(status.get("out-truncated") or status.get("err-truncated")),
    )


class GuestAgent:
    """One connection to one guest's agent; reconnects and resynchronises when needed."""

    def __init__(self, socket_path: Path, *, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._synced = False
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        writer, self._reader, self._writer, self._synced = self._writer, None, None, False
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until the agent answers a sync (it starts late in boot), or GuestAgentUnavailable."""
        deadline = time.monotonic() + timeout
        attempt = 0.2
        async with self._lock:
            while True:
                try:
                    await self._sync(attempt)
                    return
                except (GuestAgentUnavailable, OSError):
                    if time.monotonic() + attempt > deadline:
                        raise GuestAgentUnavailable(
                            f"guest agent at {self.socket_path}: no answer within {timeout:g} s"
                        ) from None
                    if self._writer is None:  # QEMU not listening yet
                        await asyncio.sleep(0.05)
                    attempt = min(attempt * 1.5, 1.0)

    async def wait_ready_unless(
        self,
        gone: Coroutine[Any, Any, object],
        timeout: float,  # noqa: ASYNC109
        why: str,
    ) -> None:
        """`wait_ready`, given up (GuestAgentUnavailable saying `why`) as soon as `gone`
        returns: a machine that ended will never answer, and its pod should not wait out the
        whole boot timeout to say so."""
        ready = asyncio.create_task(self.wait_ready(timeout))
        ended = asyncio.create_task(gone)
        try:
            done, _ = await asyncio.wait({ready, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if ready in done:
            ready.result()
            return
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError, GuestAgentUnavailable):
            await ready
        raise GuestAgentUnavailable(why)

    async def call(
        self,
        command: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Run one command; returns its `return` value."""
        async with self._lock:
            return await self._call(command, arguments, timeout or self.timeout)

    async def ping(self) -> None:
        await self.call("guest-ping")

    async def info(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("guest-info")
        return result

    async def shutdown(self, mode: str = "powerdown") -> None:
        """Ask the guest to power off. QGA sends no reply on success, so none is awaited."""
        async with self._lock:
            if not self._synced:
                await self._sync(self.timeout)
            assert self._writer is not None
            self._writer.write(encode("guest-shutdown", {"mode": mode}))
            await self._writer.drain()
            self._synced = False  # an error reply may still arrive; the next call resyncs

    async def network_interfaces(self) -> list[GuestInterface]:
        raw = await self.call("guest-network-get-interfaces")
        return [
            GuestInterface(
                name=i["name"],
                mac=i.get("hardware-address"),
                addresses=tuple(
                    (a["ip-address"], int(a["prefix"])) for a in i.get("ip-addresses", [])
                ),
            )
            for i in raw
        ]

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ExecOutput:
        """Run argv in the guest (no shell: argv as given), wait for it, return its output.

        On timeout the process is killed (`kill -KILL` through the agent, best effort) and
        TimeoutError raised.
        """
        if not argv:
            raise ValueError("exec: empty argv")
        arguments: dict[str, Any] = {
            "path": argv[0],
            "arg": list(argv[1:]),
            "capture-output": True,
        }
        if stdin:
            arguments["input-data"] = base64.b64encode(stdin).decode()
        pid = int((await self.call("guest-exec", arguments))["pid"])
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = Backoff(initial=0.02, cap=0.25, factor=1.5, jitter=0.0)
        while True:
            left = self.timeout if deadline is None else max(0.5, deadline - time.monotonic())
            status = await self.call(
                "guest-exec-status", {"pid": pid}, timeout=min(self.timeout, left)
            )
            if status.get("exited"):
                return exec_output(status)
            delay = pause.next_delay()
            if deadline is not None and time.monotonic() + delay > deadline:
                with contextlib.suppress(GuestAgentError, GuestAgentUnavailable, TimeoutError):
                    await self.call("guest-exec", {"path": "kill", "arg": ["-KILL", str(pid)]})
                raise TimeoutError(f"exec {argv[0]}: still running after {timeout:g} s")
            await asyncio.sleep(delay)

    # -- the channel --------------------------------------------------------------------------

    async def _connect(self) -> None:
        if self._writer is not None:
            return
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                self.socket_path, limit=_LIMIT
            )
        except OSError as e:
            raise GuestAgentUnavailable(f"guest agent socket {self.socket_path}: {e}") from None
        self._synced = False

    async def _sync(self, timeout: float) -> None:  # noqa: ASYNC109
        await self._connect()
        assert self._reader is not None and self._writer is not None
        token = secrets.randbelow(2**31) + 1
        self._writer.write(_DELIMITER + encode("guest-sync-delimited", {"id": token}))
        try:
            await self._writer.drain()
            async with asyncio.timeout(timeout):
                while True:
                    await self._reader.readuntil(_DELIMITER)
                    line = await self._reader.readline()
                    if not line:
                        raise EOFError
                    with contextlib.suppress(ValueError):
                        if json.loads(line).get("return") == token:
                            self._synced = True
                            return
        except TimeoutError:
            raise GuestAgentUnavailable(f"guest agent: no sync within {timeout:g} s") from None
        except (EOFError, asyncio.IncompleteReadError, OSError):
            await self.close()
            raise GuestAgentUnavailable("guest agent: connection closed") from None

    async def _call(self, command: str, arguments: Mapping[str, Any] | None, timeout: float) -> Any:  # noqa: ASYNC109
        if not self._synced:
            await self._sync(timeout)
        assert self._reader is not None and self._writer is not None
        self._synced = False  # until the reply is read, the channel state is unknown
        try:
            self._writer.write(encode(command, arguments))
            await self._writer.drain()
            async with asyncio.timeout(timeout):
                while True:
                    line = (await self._reader.readline()).lstrip(_DELIMITER).strip()
                    if not line:
                        if self._reader.at_eof():
                            raise EOFError
                        continue
                    reply = json.loads(line)
                    break
        except TimeoutError:
            raise TimeoutError(f"guest agent: {command} unanswered after {timeout:g} s") from None
        except (EOFError, OSError, ValueError):
            await self.close()
            raise GuestAgentUnavailable(f"guest agent: connection lost during {command}") from None
        self._synced = True
        if "error" in reply:
            error = reply["error"]
            raise GuestAgentError(command, error.get("class", "?"), error.get("desc", ""))
        return reply.get("return")
