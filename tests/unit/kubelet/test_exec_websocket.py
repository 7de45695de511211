"""exec over WebSocket `channel.k8s.io`, as non-kubectl clients (the Python client) speak it."""

from __future__ import annotations

import base64
import json

import pytest

from .harness import Kubelet, WsClient

EXEC = "/exec/default/web/app"


async def test_v4_exec_sends_ready_output_and_status(kubelet: Kubelet) -> None:
    client = await WsClient.connect(
        kubelet.port,
        kubelet.context(),
        f"{EXEC}?command=fail&command=4&output=1&error=1",
        ["v4.channel.k8s.io"],
    )
    assert client.subprotocol == "v4.channel.k8s.io"
    messages = await client.receive_all()
    await client.close()
    assert messages[:3] == [b"\x01", b"\x02", b"\x03"]  # empty "ready" messages
    by_channel: dict[int, bytes] = {}
    for message in messages:
        assert isinstance(message, bytes)
        by_channel[message[0]] = by_channel.get(message[0], b"") + message[1:]
    assert by_channel[1] == b"partial\n"
    assert by_channel[2] == b"oops\n"
    status = json.loads(by_channel[3])
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"]["causes"][0]["message"] == "4"
    assert client.closed is not None and client.closed.code == 1000


async def test_base64_exec_uses_text_frames(kubelet: Kubelet) -> None:
    client = await WsClient.connect(
        kubelet.port,
        kubelet.context(),
        f"{EXEC}?command=echo&command=hi&output=1",
        ["v4.base64.channel.k8s.io"],
    )
    messages = await client.receive_all()
    await client.close()
    assert all(isinstance(m, str) for m in messages)
    stdout = b"".join(
        base64.b64decode(m[1:]) for m in messages if isinstance(m, str) and m[0] == "1"
    )
    assert stdout == b"hi\n"
    error = next(m for m in messages if isinstance(m, str) and m[0] == "3" and len(m) > 1)
    assert json.loads(base64.b64decode(error[1:]))["status"] == "Success"


async def test_stdin_and_resize_channels_reach_the_provider(kubelet: Kubelet) -> None:
    client = await WsClient.connect(
        kubelet.port,
        kubelet.context(),
        f"{EXEC}?command=sizes&command=1&input=1&output=1&tty=1",
        ["v4.channel.k8s.io"],
    )
    await client.send(b"\x04" + json.dumps({"Width": 100, "Height": 30}).encode())
    messages = await client.receive_all()
    await client.close()
    assert b"\x01100x30\n" in messages


async def test_v5_close_signal_ends_stdin(kubelet: Kubelet) -> None:
    client = await WsClient.connect(
        kubelet.port,
        kubelet.context(),
        f"{EXEC}?command=cat&input=1&output=1",
        ["v5.channel.k8s.io"],
    )
    await client.send(b"\x00abc")
    await client.send(b"\xff\x00")  # close channel 0
    messages = await client.receive_all()
    await client.close()
    assert b"\x01abc" in messages


async def test_unknown_subprotocol_is_refused(kubelet: Kubelet) -> None:
    with pytest.raises(ConnectionError, match="400"):
        await WsClient.connect(
            kubelet.port, kubelet.context(), f"{EXEC}?command=echo&output=1", ["v9.channel.k8s.io"]
        )


async def test_websocket_without_credentials_is_401(kubelet: Kubelet) -> None:
    with pytest.raises(ConnectionError, match="401"):
        await WsClient.connect(
            kubelet.port,
            kubelet.context(cert=False),
            f"{EXEC}?command=echo&output=1",
            ["v4.channel.k8s.io"],
        )
