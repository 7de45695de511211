"""port-forward as a client, against our kubelet server (direct SPDY, as a kubelet offers it)
whose fake provider dials a local echo server."""

from __future__ import annotations

import asyncio
import hashlib
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from vkubelet.streaming import (
    Endpoint,
    PortForwardError,
    PortForwardSession,
    UpgradeFailed,
    port_forward,
)

from ..kubelet.harness import NAMESPACE, POD, Kubelet, start_echo_server
from .stdio import Loopback, SlowSink

ECHO_PORT = 8080


@pytest.fixture
async def echo(kubelet: Kubelet) -> AsyncIterator[asyncio.Server]:
    server = await start_echo_server()
    kubelet.provider.echo_ports[ECHO_PORT] = server.sockets[0].getsockname()[1]
    yield server
    server.close()
    await server.wait_closed()


def endpoint(kubelet: Kubelet) -> Endpoint:
    return Endpoint(f"https://127.0.0.1:{kubelet.port}", kubelet.context(), kubelet=True)


def payload(seed: int, size: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32)


async def test_ten_mib_go_there_and_back_byte_exact(kubelet: Kubelet, echo: asyncio.Server) -> None:
    data = payload(0, 10 * 1024 * 1024)
    stream = Loopback(data)
    async with asyncio.timeout(60):
        await port_forward(endpoint(kubelet), NAMESPACE, POD, ECHO_PORT, stream)
    assert len(stream.received) == len(data)
    assert bytes(stream.received) == data
    assert stream.closed  # the pod's side ended, and we said so


async def test_one_session_carries_many_connections_at_once(
    kubelet: Kubelet, echo: asyncio.Server
) -> None:
    streams = [Loopback(payload(i, 512 * 1024)) for i in range(8)]
    async with (
        asyncio.timeout(60),
        await PortForwardSession.connect(endpoint(kubelet), NAMESPACE, POD) as session,
    ):
        await asyncio.gather(*(session.forward(ECHO_PORT, s) for s in streams))
    assert all(bytes(s.received) == payload(i, 512 * 1024) for i, s in enumerate(streams))


async def test_a_port_nothing_listens_on_raises_the_far_sides_message(kubelet: Kubelet) -> None:
    with pytest.raises(PortForwardError) as failure:
        await port_forward(endpoint(kubelet), NAMESPACE, POD, 9, Loopback(b"x"))
    message = str(failure.value)
    assert message.startswith("error forwarding port 9 to pod web, uid uid-web:")
    assert "connection refused" in message


async def test_a_failed_connection_leaves_the_session_usable(
    kubelet: Kubelet, echo: asyncio.Server
) -> None:
    async with await PortForwardSession.connect(endpoint(kubelet), NAMESPACE, POD) as session:
        with pytest.raises(PortForwardError):
            await session.forward(9, Loopback(b"x"))
        stream = Loopback(b"still here")
        await session.forward(ECHO_PORT, stream)
        assert bytes(stream.received) == b"still here"


async def test_an_unknown_pod_is_an_upgrade_failure(kubelet: Kubelet) -> None:
    with pytest.raises(UpgradeFailed) as failure:
        await port_forward(endpoint(kubelet), NAMESPACE, "nope", ECHO_PORT, Loopback(b""))
    assert failure.value.not_found
    assert "pod default/nope is not running on node n1" in str(failure.value)


async def test_a_kubelet_has_no_websocket_tunnel(kubelet: Kubelet) -> None:
    with pytest.raises(ValueError, match="SPDY"):
        await PortForwardSession.connect(endpoint(kubelet), NAMESPACE, POD, transport="websocket")


async def test_reading_and_writing_a_forwarded_connection_directly(
    kubelet: Kubelet, echo: asyncio.Server
) -> None:
    async with await PortForwardSession.connect(endpoint(kubelet), NAMESPACE, POD) as session:
        conn = await session.open(ECHO_PORT)
        await conn.write(b"hello")
        received = b""
        async with asyncio.timeout(10):
            while received != b"hello":
                received += await conn.read()
        await conn.close()
        async with asyncio.timeout(10):
            assert await conn.read() == b""  # the echo server saw our end and hung up
            assert await conn.error() == ""


async def test_a_slow_reader_holds_the_sender_back_instead_of_being_buffered_for(
    kubelet: Kubelet, echo: asyncio.Server
) -> None:
    """24 MiB through a reader slower than the sender: without back-pressure the client (and
    the kubelet in this same process) would end up holding most of it."""
    size = 24 * 1024 * 1024
    stream = SlowSink(size, delay=0.002)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        async with asyncio.timeout(120):
            await port_forward(endpoint(kubelet), NAMESPACE, POD, ECHO_PORT, stream)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stream.received_bytes == size and stream.intact
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"
