"""port-forward over SPDY (many stream pairs on one connection) and over WebSocket channels."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator

import pytest

from vkubelet.kubelet import ServerConfig

from .harness import Kubelet, SpdyClient, StartKubelet, WsClient, start_echo_server

TARGET = "/portForward/default/web"
PROTOCOL = ["portforward.k8s.io"]


@pytest.fixture
async def echo_port(kubelet: Kubelet) -> AsyncIterator[int]:
    server = await start_echo_server()
    kubelet.provider.echo_ports[8080] = server.sockets[0].getsockname()[1]
    yield 8080
    server.close()
    await server.wait_closed()


async def open_pair(client: SpdyClient, request_id: int, port: int) -> tuple[int, int]:
    """As client-go does: the error stream first (and half-closed at once), then data."""
    error, data = 4 * request_id + 1, 4 * request_id + 3
    headers = {"port": str(port), "requestID": str(request_id)}
    await client.open(error, {**headers, "streamType": "error"})
    await client.send(error, b"", fin=True)
    await client.open(data, {**headers, "streamType": "data"})
    return error, data


async def test_many_concurrent_pairs_move_bytes_exactly(kubelet: Kubelet, echo_port: int) -> None:
    client = await SpdyClient.upgrade(kubelet.port, kubelet.context(), TARGET, PROTOCOL)
    payloads = {k: os.urandom(200_000 + k) for k in range(8)}
    pairs = {k: await open_pair(client, k, echo_port) for k in payloads}
    await client.wait_for(lambda: all(set(p) <= set(client.replies) for p in pairs.values()))
    # Interleave the pairs' frames, as concurrent connections would.
    for offset in range(0, max(map(len, payloads.values())), 32 * 1024):
        for k, payload in payloads.items():
            piece = payload[offset : offset + 32 * 1024]
            if piece:
                await client.send(pairs[k][1], piece, fin=offset + 32 * 1024 >= len(payload))
    await client.wait_for(
        lambda: all({error, data} <= client.fins for error, data in pairs.values()), within=10
    )
    for k, (error, data) in pairs.items():
        assert bytes(client.data[data]) == payloads[k], f"pair {k}"
        assert bytes(client.data[error]) == b""
    await client.close()


async def test_dial_failure_is_written_on_the_error_stream(kubelet: Kubelet) -> None:
    client = await SpdyClient.upgrade(kubelet.port, kubelet.context(), TARGET, PROTOCOL)
    error, data = await open_pair(client, 0, 9999)
    await client.wait_for(lambda: {error, data} <= client.fins)
    message = bytes(client.data[error]).decode()
    assert message.startswith("error forwarding port 9999 to pod web, uid uid-web:")
    assert "connection refused" in message
    await client.close()


async def test_invalid_stream_is_reset(kubelet: Kubelet) -> None:
    client = await SpdyClient.upgrade(kubelet.port, kubelet.context(), TARGET, PROTOCOL)
    await client.open(1, {"streamType": "error", "port": "not-a-port", "requestID": "0"})
    await client.wait_for(lambda: 1 in client.resets)
    await client.close()


async def test_half_open_pair_expires(start_kubelet: StartKubelet) -> None:
    kubelet = await start_kubelet(
        config=ServerConfig(host="127.0.0.1", stream_creation_timeout=0.2)
    )
    client = await SpdyClient.upgrade(kubelet.port, kubelet.context(), TARGET, PROTOCOL)
    await client.open(1, {"streamType": "error", "port": "8080", "requestID": "7"})
    await client.wait_for(lambda: 1 in client.fins, within=3)
    assert b"timed out waiting for streams of request 7" in client.data[1]
    await client.close()


async def test_websocket_port_forward_uses_channel_pairs(kubelet: Kubelet, echo_port: int) -> None:
    client = await WsClient.connect(
        kubelet.port,
        kubelet.context(),
        f"{TARGET}?port={echo_port}&port=9999",
        ["v4.channel.k8s.io"],
    )
    assert client.subprotocol == "v4.channel.k8s.io"
    port_prefix = struct.pack("<H", echo_port)
    # Greetings: each channel's first message is its port.
    await client.wait_for(lambda: len(client.messages) >= 4)
    assert client.messages[:4] == [
        b"\x00" + port_prefix,
        b"\x01" + port_prefix,
        b"\x02" + struct.pack("<H", 9999),
        b"\x03" + struct.pack("<H", 9999),
    ]
    await client.send(b"\x00ping")
    await client.wait_for(lambda: b"\x00ping" in client.messages)
    # The refused port reports on its error channel (3).
    await client.wait_for(lambda: any(m[:1] == b"\x03" and len(m) > 3 for m in client.messages))
    error = next(m for m in client.messages[4:] if isinstance(m, bytes) and m[:1] == b"\x03")
    assert b"connection refused" in error
    await client.close()


async def test_websocket_port_forward_without_port_is_400(kubelet: Kubelet) -> None:
    with pytest.raises(ConnectionError, match="400"):
        await WsClient.connect(kubelet.port, kubelet.context(), TARGET, ["v4.channel.k8s.io"])


async def test_port_forward_session_ends_cleanly_when_client_leaves(
    kubelet: Kubelet, echo_port: int
) -> None:
    client = await SpdyClient.upgrade(kubelet.port, kubelet.context(), TARGET, PROTOCOL)
    _error, data = await open_pair(client, 0, echo_port)
    await client.send(data, b"x")
    await client.wait_for(lambda: client.data[data] == b"x")
    await client.close()
    await asyncio.sleep(0.1)
    text = (await kubelet.get("/metrics")).text
    assert 'vkubelet_kubelet_active_streams{kind="portforward"' in text
    assert 'transport="spdy"} 0.0' in text
