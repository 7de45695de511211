"""`/exec`, `/attach` and `/run`: a provider's process behind SPDY streams or WebSocket channels.

Whatever the transport, a session goes the same way: negotiate a protocol version, switch
protocols, wait (within the creation timeout) for the streams the query announced, hand them to
the provider as an `AttachIO`, and once it returns write the exit status the way that version
expects. If the client hangs up first, the provider's call is cancelled and nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ..protocols.remotecommand import (
    HEADER_PROTOCOL_VERSION,
    SPDY_EXEC_PROTOCOLS,
    WEBSOCKET_EXEC_PROTOCOLS,
    Channel,
    ExecProtocol,
    ResizeDecoder,
    ResizeError,
    StreamOptions,
    StreamType,
    encode_exit_status,
    encode_internal_error,
    negotiate_spdy_exec,
    negotiate_websocket_exec,
    stream_type,
)
from ..protocols.spdy import RstStatus
from ..sdk.capabilities import (
    AttachIO,
    ContainerAttach,
    ContainerExec,
    InputStream,
    OutputStream,
    ResizeQueue,
)
from ..sdk.provider import ProviderError
from ..sdk.spdy import SpdySession, SpdyStream
from ._context import (
    Call,
    start_spdy_session,
    start_websocket_session,
    upgrade_kind,
    websocket_subprotocols,
)
from ._http import HttpError

log = logging.getLogger(__name__)

Runner = Callable[[AttachIO], Coroutine[Any, Any, int]]

# A command that cannot be started is reported as a shell reports it (ContainerExec's contract).
START_FAILURES = {"CommandNotFound": 127, "CommandNotExecutable": 126}

_TRUE = ("1", "true")


def stream_options(call: Call) -> StreamOptions:
    """`input`, `output`, `error` and `tty` as the kubelet reads them; "true" counts as "1"."""
    query = {
        name: ["1" if (call.request.param(name) or "").lower() in _TRUE else "0"]
        for name in ("input", "output", "error", "tty")
    }
    try:
        return StreamOptions.from_query(query)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None


def exit_status(code: int) -> int:
    """Fit a provider's exit code into the 0..255 the client can receive."""
    if code < 0:
        code = 128 - code  # -N: killed by signal N, as a shell reports it
    return min(code, 255)


async def handle_exec(call: Call) -> None:
    provider = call.provider
    if not isinstance(provider, ContainerExec):
        raise call.missing(ContainerExec, "kubectl exec")
    command = call.request.query.get("command", [])
    if not command:
        raise HttpError(400, "you must specify at least one command for the container")
    ns, pod, container = call.params["namespace"], call.params["pod"], call.params["container"]

    async def run(io: AttachIO) -> int:
        return await provider.exec_in_container(ns, pod, container, command, io)

    await _serve(call, "exec", run)


async def handle_attach(call: Call) -> None:
    provider = call.provider
    if not isinstance(provider, ContainerAttach):
        raise call.missing(ContainerAttach, "kubectl attach")
    ns, pod, container = call.params["namespace"], call.params["pod"], call.params["container"]

    async def run(io: AttachIO) -> int:
        await provider.attach_to_container(ns, pod, container, io)
        return 0

    await _serve(call, "attach", run)


async def _serve(call: Call, kind: str, run: Runner) -> None:
    options = stream_options(call)
    transport = upgrade_kind(call.request)
    if transport is None:
        raise HttpError(400, f"{kind} needs a connection upgrade to SPDY/3.1 or websocket")
    await call.pod_uid(call.params["container"])
    with call.track(kind, transport):
        if transport == "spdy":
            await _serve_spdy(call, options, run)
        else:
            await _serve_websocket(call, options, run)


# --- SPDY ------------------------------------------------------------------------------------


async def _serve_spdy(call: Call, options: StreamOptions, run: Runner) -> None:
    offered = call.request.header_values(HEADER_PROTOCOL_VERSION)
    protocol = negotiate_spdy_exec(offered)
    session = await start_spdy_session(
        call, protocol.name if protocol else None, offered, list(SPDY_EXEC_PROTOCOLS)
    )
    assert protocol is not None  # start_spdy_session refused the request otherwise
    config = call.config
    refuser: asyncio.Task[None] | None = None
    streams: dict[StreamType, SpdyStream] = {}
    grace = 0.0  # nothing worth waiting for unless we get to report a status
    try:
        found = await _await_streams(session, options, protocol, config.stream_creation_timeout)
        if found is None:
            return
        streams = found
        refuser = asyncio.create_task(_refuse_late_streams(session))
        io, pump = _attach_io(
            options,
            stdin=streams.get(StreamType.STDIN),
            stdout=streams.get(StreamType.STDOUT),
            stderr=streams.get(StreamType.STDERR),
            resize=streams.get(StreamType.RESIZE),
        )
        try:
            status = await _outcome(protocol, run, io, session.closed)
        finally:
            await _stop(pump)
        if status is None:
            return  # the client went away
        for kind in (StreamType.STDOUT, StreamType.STDERR):
            if kind in streams:
                await streams[kind].close()
        error = streams[StreamType.ERROR]
        if status:
            await error.write_quietly(status)
        for stream in streams.values():
            await stream.close()
        grace = config.close_grace
    finally:
        await _stop(refuser)
        for stream in streams.values():
            stream.discard()
        await session.aclose(grace)


async def _await_streams(
    session: SpdySession, options: StreamOptions, protocol: ExecProtocol, within: float
) -> dict[StreamType, SpdyStream] | None:
    """The streams the request announced, each replied to; None if they did not all come."""
    wanted = {StreamType.ERROR}
    if options.stdin:
        wanted.add(StreamType.STDIN)
    if options.stdout:
        wanted.add(StreamType.STDOUT)
    if options.stderr:
        wanted.add(StreamType.STDERR)
    if options.tty and protocol.supports_resize:
        wanted.add(StreamType.RESIZE)
    streams: dict[StreamType, SpdyStream] = {}
    try:
        async with asyncio.timeout(within):
            while not wanted <= streams.keys():
                stream = await session.accept()
                if stream is None:
                    return None
                kind = stream_type(stream.headers)
                if kind in streams:
                    stream.reset(RstStatus.PROTOCOL_ERROR)
                    continue
                # client-go waits for a reply to every stream it opens, so unexpected ones
                # (an unknown type, stderr with a TTY) are answered and then ignored.
                stream.reply()
                if kind in wanted:
                    streams[kind] = stream
                else:
                    log.debug("ignoring unexpected %r stream", stream.headers.get("streamtype"))
                    stream.discard()
    except TimeoutError:
        log.info("client did not create its streams within %.0fs", within)
        for stream in streams.values():
            stream.discard()
        return None
    return streams


async def _refuse_late_streams(session: SpdySession) -> None:
    while (stream := await session.accept()) is not None:
        stream.reset(RstStatus.REFUSED_STREAM)


# --- WebSocket -------------------------------------------------------------------------------


async def _serve_websocket(call: Call, options: StreamOptions, run: Runner) -> None:
    offered = websocket_subprotocols(call.request)
    protocol = negotiate_websocket_exec(offered)
    if protocol is None:
        raise HttpError(
            400,
            f"unable to upgrade: unable to negotiate protocol: client supports {offered}, "
            f"server accepts {[p for p in WEBSOCKET_EXEC_PROTOCOLS if p]}",
        )
    inputs = ((Channel.STDIN, options.stdin), (Channel.RESIZE, options.tty))
    inbound = [channel for channel, on in inputs if on]
    session = await start_websocket_session(call, protocol.name, protocol.framing, inbound)
    try:
        # An empty message on each output channel tells the client the session is ready.
        for channel, wanted in (
            (Channel.STDOUT, options.stdout),
            (Channel.STDERR, options.stderr),
            (Channel.ERROR, True),
        ):
            if wanted:
                await session.send(channel, b"")
        io, pump = _attach_io(
            options,
            stdin=session.channel(Channel.STDIN) if options.stdin else None,
            stdout=session.channel(Channel.STDOUT) if options.stdout else None,
            stderr=session.channel(Channel.STDERR) if options.stderr else None,
            resize=session.channel(Channel.RESIZE) if options.tty else None,
        )
        try:
            status = await _outcome(protocol, run, io, session.closed)
        finally:
            await _stop(pump)
        if status:
            with contextlib.suppress(OSError):
                await session.send(Channel.ERROR, status)
    except OSError as exc:
        log.debug("WebSocket exec ended early: %s", exc)
    finally:
        await session.aclose(grace=call.config.close_grace)


# --- shared ----------------------------------------------------------------------------------


def _attach_io(
    options: StreamOptions,
    *,
    stdin: InputStream | None,
    stdout: OutputStream | None,
    stderr: OutputStream | None,
    resize: InputStream | None,
) -> tuple[AttachIO, asyncio.Task[None] | None]:
    resizes = ResizeQueue()
    pump = None
    if resize is not None:
        pump = asyncio.create_task(_pump_resizes(resize, resizes))
    else:
        resizes.close()
    io = AttachIO(
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        tty=options.tty,
        resizes=resizes,
    )
    return io, pump


async def _pump_resizes(source: InputStream, queue: ResizeQueue) -> None:
    decoder = ResizeDecoder()
    try:
        while data := await source.read():
            for size in decoder.feed(data):
                queue.put(size)
    except ResizeError as exc:
        log.info("ignoring further terminal resizes: %s", exc)
    finally:
        queue.close()


async def _outcome(
    protocol: ExecProtocol, run: Runner, io: AttachIO, hangup: asyncio.Event
) -> bytes | None:
    """Run the provider's call until it ends or the client hangs up (None: nothing to report).
    Returns what to write on the error stream (b"" for success under v1-v3)."""
    work = asyncio.create_task(run(io))
    gone = asyncio.create_task(hangup.wait())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return None
    exc = work.exception()
    if exc is None:
        return encode_exit_status(protocol, exit_status(work.result()))
    if isinstance(exc, OSError) and hangup.is_set():
        return None  # the provider noticed the hang-up first
    if isinstance(exc, ProviderError) and exc.reason in START_FAILURES:
        await _say(io.stderr or io.stdout, exc.message)
        return encode_exit_status(protocol, START_FAILURES[exc.reason])
    # An ordinary failure (the backend refused or failed): one line in the log, the message to
    # the client; the traceback only at debug level, for a provider's author.
    level = logging.INFO if isinstance(exc, ProviderError) else logging.WARNING
    log.log(level, "exec/attach failed: %s: %s", type(exc).__name__, exc)
    log.debug("exec/attach failure", exc_info=exc)
    return encode_internal_error(protocol, f"error executing command in container: {exc}")


async def _say(stream: OutputStream | None, message: str) -> None:
    if stream is not None and message:
        with contextlib.suppress(OSError):
            await stream.write(message.rstrip("\n").encode() + b"\n")


async def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- /run ------------------------------------------------------------------------------------


class _Collector:
    """stdout and stderr of `/run`, kept up to a limit (the rest is dropped)."""

    def __init__(self, limit: int) -> None:
        self.data = bytearray()
        self._limit = limit

    async def write(self, data: bytes) -> None:
        room = self._limit - len(self.data)
        if room > 0:
            self.data += data[:room]


async def handle_run(call: Call) -> None:
    """The kubelet's legacy one-shot exec: output in the response body."""
    provider = call.provider
    if not isinstance(provider, ContainerExec):
        raise call.missing(ContainerExec, "/run")
    command = [part for part in (call.request.param("cmd") or "").split(" ") if part]
    if not command:
        raise HttpError(400, 'query parameter "cmd" is required')
    container = call.params["container"]
    await call.pod_uid(container)
    output = _Collector(call.config.run_output_limit)
    io = AttachIO(stdin=None, stdout=output, stderr=output, tty=False)
    io.resizes.close()
    try:
        code = await provider.exec_in_container(
            call.params["namespace"], call.params["pod"], container, command, io
        )
    except ProviderError as exc:
        if exc.reason not in START_FAILURES:
            raise
        await _say(output, exc.message)
        code = START_FAILURES[exc.reason]
    if code == 0:
        await call.exchange.respond(200, bytes(output.data))
    else:
        message = f"command terminated with non-zero exit code: {exit_status(code)}\n"
        await call.exchange.respond(500, bytes(output.data) + message.encode())
