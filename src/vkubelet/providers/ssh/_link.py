"""One multiplexed SSH connection per device, kept up with back-off and a health probe.

Every request to a device (starting a pod, a status sweep, `kubectl exec`, a forwarded port)
is a channel on the same connection: a connect costs ~40 ms and a channel ~3 ms. sshd limits
the sessions (not the forwarded ports) of one connection (`MaxSessions`, 10 by default), so
sessions queue on a semaphore rather than fail with "open failed".

Scripts go to the device as `sh -s` with the script on stdin: the SSH command line is a
constant, so neither pod fields nor secrets ever appear in it (or in the device's process list).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import asyncssh

from ...sdk.retry import Backoff
from ._inventory import DeviceConfig

log = logging.getLogger(__name__)

__all__ = ["Completed", "DeviceLink", "Unreachable"]


class Unreachable(ConnectionError):
    """The device cannot be reached right now; the request may be retried later."""


@dataclass(frozen=True)
class Completed:
    exit_status: int
    stdout: bytes
    stderr: bytes

    def check(self, what: str) -> bytes:
        if self.exit_status != 0:
            detail = self.stderr.decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"{what} failed (exit {self.exit_status}): {detail}")
        return self.stdout


async def connect(config: DeviceConfig) -> asyncssh.SSHClientConnection:
    """Open the connection as the inventory says: host keys verified unless told otherwise."""
    known_hosts: str | None = None
    if not config.insecure_ignore_host_key:
        assert config.known_hosts is not None
        known_hosts = str(config.known_hosts)
    return await asyncssh.connect(
        config.address,
        config.port,
        username=config.user,
        client_keys=[str(config.identity_file)] if config.identity_file else None,
        agent_path=() if not config.agent else None,  # None: $SSH_AUTH_SOCK
        known_hosts=known_hosts,
        connect_timeout=config.connect_timeout,
        # A link that goes silent is noticed by the health probe; keepalives end the
        # connection for good so that channels waiting on it fail instead of hanging.
        keepalive_interval=5,
        keepalive_count_max=3,
        config=[],  # never read ~/.ssh/config: the inventory is the whole truth
    )


class DeviceLink:
    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self._conn: asyncssh.SSHClientConnection | None = None
        self._up = asyncio.Event()
        # One session is kept for the device's event stream.
        self._sessions = asyncio.Semaphore(max(1, config.max_sessions - 1))
        self.last_error: str | None = "not connected yet"
        self.on_connected: list[Callable[[], None]] = []

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def wait_connected(self) -> None:
        await self._up.wait()

    # -- keeping the connection ---------------------------------------------------------------
    async def maintain(self) -> None:
        """Connect, probe every `pingInterval`, reconnect with back-off: runs until cancelled."""
        # No jitter: devices reconnect each on their own, and "retrying in <max>s" in the log
        # says that the link waits its longest.
        backoff = Backoff(
            initial=self.config.reconnect_initial, cap=self.config.reconnect_max, jitter=0.0
        )
        try:
            while True:
                try:
                    conn = await connect(self.config)
                except (OSError, asyncssh.Error, TimeoutError) as e:
                    self.last_error = _describe(e)
                    delay = backoff.next_delay()
                    log.warning(
                        "device %s (%s:%d) unreachable: %s; retrying in %.0fs",
                        self.config.name,
                        self.config.address,
                        self.config.port,
                        self.last_error,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                self._conn = conn
                self.last_error = None
                self._up.set()
                log.info("device %s connected", self.config.name)
                for callback in self.on_connected:
                    callback()
                try:
                    await self._watch(conn)
                finally:
                    self._up.clear()
                    self._conn = None
                    conn.close()
                log.warning("device %s disconnected: %s", self.config.name, self.last_error)
        finally:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    async def _watch(self, conn: asyncssh.SSHClientConnection) -> None:
        """Return when the connection has closed or the device stopped answering."""
        closed = asyncio.ensure_future(conn.wait_closed())
        try:
            while True:
                done, _ = await asyncio.wait({closed}, timeout=self.config.ping_interval)
                if done:
                    self.last_error = "connection closed"
                    return
                try:
                    async with asyncio.timeout(min(5.0, self.config.ping_interval + 2)):
                        result = await conn.run("true", check=False)
                    if result.exit_status != 0:
                        raise RuntimeError(f"`true` exited {result.exit_status}")
                except (OSError, asyncssh.Error, TimeoutError, RuntimeError) as e:
                    self.last_error = f"health probe failed: {_describe(e)}"
                    return
        finally:
            closed.cancel()

    async def ping(self) -> None:
        if self._conn is None:
            raise Unreachable(f"device {self.config.name}: {self.last_error}")

    def _connection(self) -> asyncssh.SSHClientConnection:
        if self._conn is None:
            raise Unreachable(f"device {self.config.name} is unreachable: {self.last_error}")
        return self._conn

    # -- requests -----------------------------------------------------------------------------
    async def run(self, script: str, *, deadline: float = 30.0) -> Completed:
        """Run a POSIX sh script on the device (`sh -s`, script on stdin)."""
        conn = self._connection()
        try:
            async with self._sessions, asyncio.timeout(deadline):
                result = await conn.run("sh -s", input=script.encode(), encoding=None, check=False)
        except (OSError, asyncssh.Error) as e:
            raise Unreachable(f"device {self.config.name}: {_describe(e)}") from e
        except TimeoutError as e:
            raise Unreachable(f"device {self.config.name}: no answer in {deadline:g}s") from e
        status = result.exit_status if result.exit_status is not None else 255
        return Completed(status, _bytes(result.stdout), _bytes(result.stderr))

    @contextlib.asynccontextmanager
    async def process(
        self,
        command: str,
        *,
        term_size: tuple[int, int] | None = None,
        stdin: bool = True,
        reserved: bool = False,
    ) -> AsyncIterator[asyncssh.SSHClientProcess[bytes]]:
        """A long-lived session (exec, attach, logs -f). `term_size` (cols, rows) asks for a PTY.

        `reserved`: use the session kept for the device's own event stream.
        """
        conn = self._connection()
        semaphore = contextlib.nullcontext() if reserved else self._sessions
        async with semaphore:
            try:
                proc = await conn.create_process(
                    command,
                    encoding=None,
                    term_type="xterm" if term_size else None,
                    term_size=term_size,
                    stdin=asyncssh.PIPE if stdin else asyncssh.DEVNULL,
                )
            except (OSError, asyncssh.Error) as e:
                raise Unreachable(f"device {self.config.name}: {_describe(e)}") from e
            try:
                yield proc
            finally:
                proc.close()

    async def open_connection(
        self, host: str, port: int
    ) -> tuple[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes]]:
        """A TCP connection from the device to host:port (direct-tcpip; not a session)."""
        conn = self._connection()
        try:
            reader, writer = await conn.open_connection(host, port, encoding=None)
        except asyncssh.ChannelOpenError as e:
            raise ConnectionRefusedError(
                f"device {self.config.name}: cannot connect to {host}:{port}: {e.reason}"
            ) from e
        except (OSError, asyncssh.Error) as e:
            raise Unreachable(f"device {self.config.name}: {_describe(e)}") from e
        return reader, writer

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncssh.HostKeyNotVerifiable):
        return f"host key not verified ({e.reason}): check knownHosts"
    if isinstance(e, asyncssh.PermissionDenied):
        return f"authentication refused ({e.reason}): check user and key"
    if isinstance(e, asyncssh.Error):
        return e.reason
    if isinstance(e, TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


def _bytes(value: object) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    assert isinstance(value, bytes | bytearray)
    return bytes(value)
