"""`/portForward`: each forwarded TCP connection bridged to `PortForwarder.port_forward`.

Over SPDY one connection multiplexes many forwarded connections, each a (data, error) stream
pair; the sans-I/O `StreamPairer` matches them and this module adds what needs a clock and I/O:
the creation timeout of a half-open pair, one task per complete pair, and error reports on the
pair's error stream. Over WebSocket the ports come from the query and each gets one fixed
channel pair for the life of the WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..protocols.channel import port_channels, port_greetings
from ..protocols.portforward import (
    PORT_FORWARD_PROTOCOL,
    PairComplete,
    PairPending,
    StreamPairer,
    StreamRejected,
    forward_error_message,
    negotiate_spdy_portforward,
    negotiate_websocket_portforward,
    parse_port_query,
)
from ..protocols.remotecommand import HEADER_PROTOCOL_VERSION
from ..protocols.spdy import RstStatus
from ..sdk.capabilities import ByteStream, PortForwarder
from ..sdk.spdy import SpdyStream
from ..sdk.tasks import TaskSet
from ..sdk.websocket import WsChannel
from ._context import (
    Call,
    start_spdy_session,
    start_websocket_session,
    upgrade_kind,
    websocket_subprotocols,
)
from ._http import HttpError

log = logging.getLogger(__name__)


async def handle_port_forward(call: Call) -> None:
    forwarder = call.provider
    if not isinstance(forwarder, PortForwarder):
        raise call.missing(PortForwarder, "kubectl port-forward")
    transport = upgrade_kind(call.request)
    if transport is None:
        raise HttpError(400, "port-forward needs a connection upgrade to SPDY/3.1 or websocket")
    uid = await call.pod_uid()
    with call.track("portforward", transport):
        if transport == "spdy":
            await _serve_spdy(call, forwarder, uid)
        else:
            await _serve_websocket(call, forwarder, uid)


async def _forward(
    call: Call,
    forwarder: PortForwarder,
    uid: str,
    port: int,
    data: ByteStream,
    error: SpdyStream | WsChannel,
) -> None:
    """One forwarded connection; a failure is reported on its error stream, as the kubelet
    does, so that kubectl prints it and carries on with the other connections."""
    namespace, pod = call.params["namespace"], call.params["pod"]
    try:
        await forwarder.port_forward(namespace, pod, port, data)
    except Exception as exc:
        log.info("port-forward to %s/%s:%d failed: %s", namespace, pod, port, exc)
        message = forward_error_message(port, pod, uid, str(exc) or type(exc).__name__)
        await error.write_quietly(message.encode())


# --- SPDY ------------------------------------------------------------------------------------


async def _serve_spdy(call: Call, forwarder: PortForwarder, uid: str) -> None:
    offered = call.request.header_values(HEADER_PROTOCOL_VERSION)
    chosen = PORT_FORWARD_PROTOCOL if negotiate_spdy_portforward(offered) else None
    session = await start_spdy_session(call, chosen, offered, [PORT_FORWARD_PROTOCOL])
    config = call.config
    pairer = StreamPairer()
    timers: dict[str, asyncio.TimerHandle] = {}
    tasks = TaskSet("port-forward", logger=log)

    async def expire(request_id: str) -> None:
        timers.pop(request_id, None)
        expired = pairer.expire(request_id)
        if expired is None:
            return
        log.info("port-forward: %s", expired.reason)
        if expired.error_stream_id is not None and (err := session.stream(expired.error_stream_id)):
            await err.write_quietly(expired.reason.encode())
            await err.close()
            err.discard()
        if expired.data_stream_id is not None and (data := session.stream(expired.data_stream_id)):
            data.reset()

    def start_expiry(request_id: str) -> None:
        tasks.spawn(expire(request_id), name=f"expire {request_id}")

    async def run_pair(pair: PairComplete) -> None:
        data, error = session.stream(pair.data_stream_id), session.stream(pair.error_stream_id)
        if data is None or error is None:
            return  # the client reset one of them already
        try:
            await _forward(call, forwarder, uid, pair.port, data, error)
        finally:
            await data.close()
            await error.close()
            data.discard()
            error.discard()

    async def reject(stream: SpdyStream, result: StreamRejected) -> None:
        log.info("port-forward: rejecting stream %d: %s", stream.id, result.reason)
        stream.reset(RstStatus.PROTOCOL_ERROR)
        if result.error_stream_id is not None and (err := session.stream(result.error_stream_id)):
            await err.write_quietly(result.reason.encode())

    try:
        while (stream := await session.accept()) is not None:
            result = pairer.add_stream(stream.id, stream.headers)
            match result:
                case StreamRejected():
                    tasks.spawn(reject(stream, result), name=f"reject {stream.id}")
                case PairPending(request_id):
                    stream.reply()
                    if request_id not in timers:
                        timers[request_id] = asyncio.get_running_loop().call_later(
                            config.stream_creation_timeout, start_expiry, request_id
                        )
                case PairComplete():
                    stream.reply()
                    timer = timers.pop(result.request_id, None)
                    if timer is not None:
                        timer.cancel()
                    tasks.spawn(run_pair(result), name=f"forward {result.port}")
    finally:
        for timer in timers.values():
            timer.cancel()
        await tasks.aclose()
        await session.aclose(config.close_grace)


# --- WebSocket -------------------------------------------------------------------------------


async def _serve_websocket(call: Call, forwarder: PortForwarder, uid: str) -> None:
    try:
        ports = parse_port_query(call.request.query.get("port", []))
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None
    offered = websocket_subprotocols(call.request)
    negotiated = negotiate_websocket_portforward(offered)
    if negotiated is None:
        raise HttpError(
            400,
            f"unable to upgrade: unable to negotiate protocol: client supports {offered}",
        )
    name, framing = negotiated
    numbers = [port_channels(i) for i in range(len(ports))]
    session = await start_websocket_session(call, name, framing, [n for p in numbers for n in p])
    channels = [(session.channel(data), session.channel(error)) for data, error in numbers]
    tasks: list[asyncio.Task[None]] = []
    try:
        for message in port_greetings(ports, framing):
            await session.ws.send(message)
        tasks = [
            asyncio.create_task(_forward(call, forwarder, uid, port, data, error))
            for port, (data, error) in zip(ports, channels, strict=True)
        ]
        # A WebSocket carries its ports together: it ends when all of them have ended, or
        # when the client hangs up.
        hangup = asyncio.create_task(session.closed.wait())
        remaining: set[asyncio.Task[None]] = set(tasks)
        try:
            while remaining and not hangup.done():
                done, _ = await asyncio.wait(
                    {*remaining, hangup}, return_when=asyncio.FIRST_COMPLETED
                )
                remaining -= done
        finally:
            hangup.cancel()
    except OSError as exc:
        log.debug("WebSocket port-forward ended early: %s", exc)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.aclose(grace=call.config.close_grace)
