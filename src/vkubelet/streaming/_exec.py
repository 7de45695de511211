"""exec and attach as a client: an `AttachIO` relayed to a process behind another apiserver.

Like kubectl (1.30+), we first ask for a WebSocket speaking ``v5.channel.k8s.io``, which the
apiserver translates for the kubelet, and fall back to SPDY/3.1 when the upgrade is refused
(an older apiserver, a kubelet, a proxy that drops WebSockets). Either way the session goes the
same: stdout and stderr are copied into the `AttachIO` as they arrive, stdin and terminal sizes
are sent as the caller produces them, stdin's end is passed on (v5's close signal, or SPDY's
half-close), and the exit status the server writes last is turned into an exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, Literal, Protocol

from ..protocols.remotecommand import (
    CLIENT_SPDY_EXEC_PROTOCOLS,
    CLIENT_WEBSOCKET_EXEC_PROTOCOLS,
    HEADER_PROTOCOL_VERSION,
    SPDY_EXEC_PROTOCOLS,
    WEBSOCKET_EXEC_PROTOCOLS,
    Channel,
    ExecProtocol,
    StreamType,
    decode_exit_status,
    encode_resize,
)
from ..sdk.capabilities import AttachIO, InputStream, OutputStream, ResizeQueue
from ..sdk.pipe import InboundPipe
from ..sdk.spdy import SpdySession, SpdyStream
from ..sdk.websocket import ChannelSession, WebSocket
from ._connect import Endpoint, upgrade
from ._errors import RemoteCommandError, StreamingError, UpgradeFailed
from ._spdy import client_session, open_stream, socket_transport, wait_replied
from ._websocket import open_websocket

log = logging.getLogger(__name__)

Transport = Literal["auto", "websocket", "spdy"]

SEND_CHUNK = 32 * 1024
MAX_STATUS = 64 * 1024


async def exec_command(
    endpoint: Endpoint,
    namespace: str,
    pod: str,
    container: str,
    command: Sequence[str],
    io: AttachIO,
    *,
    transport: Transport = "auto",
    stream_timeout: float = 30.0,
) -> int:
    """Run `command` in the container with `io` as its stdio; return its exit code.

    The streams requested are those `io` has (stderr only without a TTY). Raises
    `UpgradeFailed` when the server refuses (unknown pod: 404, unknown container: 400),
    `RemoteCommandError` when the command could not run, `StreamingError` when the connection
    fails. Cancelling the call closes the connection, which ends the remote session.
    """
    if not command:
        raise ValueError("exec needs a command")
    return await _remote_command(
        endpoint, "exec", namespace, pod, container, command, io, transport, stream_timeout
    )


async def attach(
    endpoint: Endpoint,
    namespace: str,
    pod: str,
    container: str,
    io: AttachIO,
    *,
    transport: Transport = "auto",
    stream_timeout: float = 30.0,
) -> int:
    """Attach `io` to the container's main process until the server ends the session (the
    process ended, or stdin ended and the runtime let go); return the exit code it reports
    (0 unless the server says otherwise). Errors as for `exec_command`."""
    return await _remote_command(
        endpoint, "attach", namespace, pod, container, (), io, transport, stream_timeout
    )


async def _remote_command(
    endpoint: Endpoint,
    kind: str,
    namespace: str,
    pod: str,
    container: str,
    command: Sequence[str],
    io: AttachIO,
    transport: Transport,
    stream_timeout: float,
) -> int:
    target = _target(endpoint, kind, namespace, pod, container, command, io)
    if transport != "spdy":
        try:
            ws, chosen = await open_websocket(endpoint, target, CLIENT_WEBSOCKET_EXEC_PROTOCOLS)
        except UpgradeFailed as exc:
            if transport == "websocket":
                raise
            log.debug("WebSocket %s refused (%s); falling back to SPDY", kind, exc)
        else:
            return await _over_websocket(ws, chosen, io)
    return await _over_spdy(endpoint, target, io, stream_timeout)


def _target(
    endpoint: Endpoint,
    kind: str,
    namespace: str,
    pod: str,
    container: str,
    command: Sequence[str],
    io: AttachIO,
) -> str:
    """The apiserver takes PodExecOptions (``stdin=true``...); the kubelet, which the
    apiserver calls, ``input=1``... with the container in the path."""
    wanted = (
        io.stdin is not None,
        io.stdout is not None,
        io.stderr is not None and not io.tty,
        io.tty,
    )
    commands = [("command", part) for part in command]
    if endpoint.kubelet:
        if not container:
            raise ValueError("a kubelet needs the container name")
        names = ("input", "output", "error", "tty")
        flags = [(name, "1") for name, on in zip(names, wanted, strict=True) if on]
        return endpoint.target([kind, namespace, pod, container], commands + flags)
    names = ("stdin", "stdout", "stderr", "tty")
    flags = [(name, "true") for name, on in zip(names, wanted, strict=True) if on]
    selector = [("container", container)] if container else []
    segments = ["api", "v1", "namespaces", namespace, "pods", pod, kind]
    return endpoint.target(segments, selector + commands + flags)


# --- WebSocket -------------------------------------------------------------------------------


async def _over_websocket(ws: WebSocket, subprotocol: str, io: AttachIO) -> int:
    protocol = WEBSOCKET_EXEC_PROTOCOLS[subprotocol]
    session = ChannelSession(ws, protocol.framing)
    # Only channels someone reads get a pipe: data for any other is dropped, not held.
    stdout = session.channel(Channel.STDOUT) if io.stdout is not None else None
    stderr = session.channel(Channel.STDERR) if io.stderr is not None and not io.tty else None
    error = session.channel(Channel.ERROR)
    stdin, resize = session.channel(Channel.STDIN), session.channel(Channel.RESIZE)
    for outbound in (stdin, resize):
        outbound.pipe.discard()  # we only send on them: anything arriving is dropped
    session.start()
    try:
        status = await _relay(
            io,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            resize=resize if io.tty else None,
            status=error.pipe,
        )
    finally:
        await session.aclose()
    if not status and session.error:
        raise StreamingError(session.error)
    return _exit_code(protocol, status)


# --- SPDY ------------------------------------------------------------------------------------


async def _over_spdy(endpoint: Endpoint, target: str, io: AttachIO, stream_timeout: float) -> int:
    headers = [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")]
    headers += [(HEADER_PROTOCOL_VERSION, name) for name in CLIENT_SPDY_EXEC_PROTOCOLS]
    upgraded = await upgrade(endpoint, "POST", target, headers)
    chosen = upgraded.headers.get(HEADER_PROTOCOL_VERSION.lower(), "")
    # A server that names no version speaks the first one (client-go's reading too).
    protocol = SPDY_EXEC_PROTOCOLS.get(chosen or "channel.k8s.io")
    if protocol is None:
        await upgraded.aclose()
        raise UpgradeFailed(101, "ProtocolMismatch", f"the server chose protocol {chosen!r}")
    client = client_session(socket_transport(upgraded))
    try:
        streams = _open_spdy_streams(client, io, protocol)
        await wait_replied(client, streams.values(), stream_timeout)
        status = await _relay(
            io,
            stdin=streams.get(StreamType.STDIN),
            stdout=streams.get(StreamType.STDOUT),
            stderr=streams.get(StreamType.STDERR),
            resize=streams.get(StreamType.RESIZE),
            status=streams[StreamType.ERROR].inbox,
        )
        if not streams[StreamType.ERROR].remote_fin and not status:
            raise StreamingError(client.error or "the connection ended before the exit status")
    finally:
        await client.aclose()
    return _exit_code(protocol, status)


def _open_spdy_streams(
    client: SpdySession, io: AttachIO, protocol: ExecProtocol
) -> dict[StreamType, SpdyStream]:
    """The error stream first, then the stdio ones, as client-go opens them."""
    wanted = [StreamType.ERROR]
    if io.stdin is not None:
        wanted.append(StreamType.STDIN)
    if io.stdout is not None:
        wanted.append(StreamType.STDOUT)
    if io.stderr is not None and not io.tty:
        wanted.append(StreamType.STDERR)
    if io.tty and protocol.supports_resize:
        wanted.append(StreamType.RESIZE)
    return {kind: open_stream(client, {"streamType": kind.value}) for kind in wanted}


# --- shared ----------------------------------------------------------------------------------


class _Source(Protocol):
    async def read(self, max_bytes: int = 65536) -> bytes: ...


class _Sink(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


async def _relay(
    io: AttachIO,
    *,
    stdin: _Sink | None,
    stdout: _Source | None,
    stderr: _Source | None,
    resize: _Sink | None,
    status: InboundPipe,
) -> bytes:
    """Copy both ways until the server has finished: output streams and the status ended.
    Returns the status bytes. The first failure (a caller's stream that broke) ends it all."""
    required: list[Coroutine[Any, Any, Any]] = [status.read_all(MAX_STATUS)]
    if stdout is not None and io.stdout is not None:
        required.append(_copy(stdout, io.stdout))
    if stderr is not None and io.stderr is not None and not io.tty:
        required.append(_copy(stderr, io.stderr))
    background: list[Coroutine[Any, Any, None]] = []
    if stdin is not None and io.stdin is not None:
        background.append(_send_stdin(io.stdin, stdin))
    if resize is not None:
        background.append(_send_resizes(io.resizes, resize))
    must = [asyncio.create_task(c) for c in required]
    extra = [asyncio.create_task(c) for c in background]
    try:
        pending = set(must)
        while pending:
            watched = pending | {task for task in extra if not task.done()}
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if (exc := task.exception()) is not None:
                    raise exc
            pending -= done
        result: bytes = must[0].result()
        return result
    finally:
        for task in must + extra:
            task.cancel()
        await asyncio.gather(*must, *extra, return_exceptions=True)


async def _copy(source: _Source, target: OutputStream) -> None:
    while data := await source.read():
        await target.write(data)


async def _send_stdin(source: InputStream, sink: _Sink) -> None:
    """Until the caller's stdin ends, then say so. Once the session is over the sink refuses
    writes, which simply ends the pump."""
    with contextlib.suppress(OSError):
        while data := await source.read():
            await sink.write(data)
        await sink.close()


async def _send_resizes(sizes: ResizeQueue, sink: _Sink) -> None:
    with contextlib.suppress(OSError):
        async for size in sizes:
            await sink.write(encode_resize(size))


def _exit_code(protocol: ExecProtocol, payload: bytes) -> int:
    status = decode_exit_status(protocol, payload)
    if status.exit_code is None:
        raise RemoteCommandError(status.message)
    return status.exit_code
