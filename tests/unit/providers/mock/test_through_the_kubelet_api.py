"""The mock provider behind a real kubelet API server, reached over TLS and SPDY the way the
apiserver reaches a kubelet: every kubectl verb works end to end without a cluster."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from vkubelet.kubelet import (
    KubeletAuth,
    KubeletNode,
    KubeletServer,
    ServerConfig,
    UnionAuthenticator,
    X509Authenticator,
    server_ssl_context,
)
from vkubelet.protocols.remotecommand import TerminalSize, encode_resize
from vkubelet.providers.mock import MockConfig, MockProvider

from ...kubelet.harness import (
    FakeAuthorizer,
    FakeTokens,
    HttpClient,
    SpdyClient,
    client_context,
    fetch,
    make_pki,
    start_echo_server,
)
from .helpers import NS, POD, make_tar, read_tar, resolved

CLIENT_GO = ["v5.channel.k8s.io", "v4.channel.k8s.io"]


@dataclass
class Served:
    server: KubeletServer
    mock: MockProvider
    context: ssl.SSLContext  # the apiserver's client certificate

    @property
    def port(self) -> int:
        return self.server.port


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Served]:
    mock = MockProvider("n1", MockConfig())
    mock.tick_seconds = 0.05
    await mock.create_pod(resolved())
    pki = make_pki(tmp_path)
    server = KubeletServer(
        [KubeletNode("n1", mock)],
        ssl_context=server_ssl_context(pki.server_cert, pki.server_key, pki.ca),
        auth=KubeletAuth(UnionAuthenticator(X509Authenticator(), FakeTokens({})), FakeAuthorizer()),
        port=0,
        config=ServerConfig(host="127.0.0.1"),
        registry=CollectorRegistry(),
    )
    await server.start()
    yield Served(server, mock, client_context(pki))
    await server.close()


@dataclass
class Result:
    status: dict[str, object]
    stdout: bytes
    stderr: bytes


async def kubectl_exec(
    node: Served,
    command: list[str],
    *,
    stdin: bytes | None = None,
    keys: Sequence[bytes] = (),
    size: TerminalSize | None = None,
) -> Result:
    """What client-go's SPDY executor does for `kubectl exec` (with -t when `size` is given)."""
    tty = size is not None
    query = "&".join(f"command={quote(part)}" for part in command) + "&output=1"
    kinds = ["error", "stdout"]
    if tty:
        query += "&tty=1"
        kinds.append("resize")
    else:
        query += "&error=1"
        kinds.append("stderr")
    if stdin is not None or keys:
        query += "&input=1"
        kinds.append("stdin")
    target = f"/exec/{NS}/{POD}/app?{query}"
    client = await SpdyClient.upgrade(node.port, node.context, target, CLIENT_GO)
    ids = {kind: 2 * index + 1 for index, kind in enumerate(kinds)}
    for kind, stream_id in ids.items():
        await client.open(stream_id, {"streamType": kind})
    await client.wait_for(lambda: set(ids.values()) <= set(client.replies))
    if size is not None:
        await client.send(ids["resize"], encode_resize(size))
    for key in keys:
        await client.send(ids["stdin"], key)
        await asyncio.sleep(0.1)
    if stdin is not None:
        for offset in range(0, len(stdin), 60_000):
            await client.send(ids["stdin"], stdin[offset : offset + 60_000])
        await client.send(ids["stdin"], b"", fin=True)
    outputs = {ids[k] for k in ("stdout", "stderr", "error") if k in ids}
    await client.wait_for(lambda: outputs <= client.fins and client.goaway is not None, within=10)
    await client.close()
    status: dict[str, object] = json.loads(client.data[ids["error"]])
    stderr = bytes(client.data[ids["stderr"]]) if "stderr" in ids else b""
    return Result(status, bytes(client.data[ids["stdout"]]), stderr)


async def test_kubectl_exec_reports_output_and_exit_codes(node: Served) -> None:
    ok = await kubectl_exec(node, ["sh", "-c", "echo $GREETING; hostname"])
    assert ok.status == {"metadata": {}, "status": "Success"}
    assert ok.stdout == b"hello there\nweb\n"
    failed = await kubectl_exec(node, ["sh", "-c", "echo oops >&2; exit 3"])
    assert failed.status["reason"] == "NonZeroExitCode"
    assert failed.status["details"] == {"causes": [{"reason": "ExitCode", "message": "3"}]}
    assert (failed.stdout, failed.stderr) == (b"", b"oops\n")
    missing = await kubectl_exec(node, ["nginx"])
    assert missing.status["details"] == {"causes": [{"reason": "ExitCode", "message": "127"}]}
    assert missing.stderr == b"mock: nginx: command not found\n"


async def test_kubectl_cp_both_ways_over_spdy(node: Served) -> None:
    blob = os.urandom(500_000)
    probe = await kubectl_exec(node, ["test", "-d", "/tmp"])
    assert probe.status["status"] == "Success"
    archive = make_tar({"data/blob.bin": blob, "data/notes.txt": b"notes\n"})
    copied = await kubectl_exec(node, ["tar", "-xmf", "-", "-C", "/tmp"], stdin=archive)
    assert copied.status["status"] == "Success" and copied.stderr == b""
    back = await kubectl_exec(node, ["tar", "cf", "-", "/tmp/data"])
    assert back.status["status"] == "Success"
    assert read_tar(back.stdout) == {
        "tmp/data": None,
        "tmp/data/blob.bin": blob,
        "tmp/data/notes.txt": b"notes\n",
    }


async def test_kubectl_exec_with_a_terminal(node: Served) -> None:
    result = await kubectl_exec(
        node,
        ["sh"],
        keys=[b"stty size\r", b"exit 4\r"],
        size=TerminalSize(width=100, height=30),
    )
    assert b"stty size\r\n30 100\r\n" in result.stdout
    assert result.status["details"] == {"causes": [{"reason": "ExitCode", "message": "4"}]}


async def test_kubectl_attach_over_spdy(node: Served) -> None:
    target = f"/attach/{NS}/{POD}/app?input=1&output=1&error=1"
    client = await SpdyClient.upgrade(node.port, node.context, target, CLIENT_GO)
    for stream_id, kind in ((1, "error"), (3, "stdout"), (5, "stderr"), (7, "stdin")):
        await client.open(stream_id, {"streamType": kind})
    await client.wait_for(lambda: {1, 3, 5, 7} <= set(client.replies))
    await client.send(7, b"shout\n", fin=True)
    await client.wait_for(lambda: {1, 3} <= client.fins)
    assert bytes(client.data[3]) == b"SHOUT\n"
    await client.close()


async def test_kubectl_port_forward_reaches_a_local_server(node: Served) -> None:
    echo = await start_echo_server()
    port = echo.sockets[0].getsockname()[1]
    client = await SpdyClient.upgrade(
        node.port, node.context, f"/portForward/{NS}/{POD}", ["portforward.k8s.io"]
    )
    payloads = {k: os.urandom(300_000 + k) for k in range(5)}
    for k in payloads:  # as client-go: the error stream (half-closed), then data
        headers = {"port": str(port), "requestID": str(k)}
        await client.open(4 * k + 1, {**headers, "streamType": "error"})
        await client.send(4 * k + 1, b"", fin=True)
        await client.open(4 * k + 3, {**headers, "streamType": "data"})
    await client.wait_for(lambda: all(4 * k + 3 in client.replies for k in payloads))
    for k, payload in payloads.items():
        for offset in range(0, len(payload), 32_000):
            last = offset + 32_000 >= len(payload)
            await client.send(4 * k + 3, payload[offset : offset + 32_000], fin=last)
    await client.wait_for(lambda: all(4 * k + 3 in client.fins for k in payloads), within=10)
    for k, payload in payloads.items():
        assert bytes(client.data[4 * k + 3]) == payload
        assert bytes(client.data[4 * k + 1]) == b""
    await client.close()
    echo.close()
    await echo.wait_closed()


async def test_stats_and_resource_metrics_parse(node: Served) -> None:
    summary = await fetch(node.port, node.context, "/stats/summary")
    assert summary.status == 200
    body = summary.json()
    assert body["node"]["nodeName"] == "n1"
    assert body["pods"][0]["podRef"]["name"] == POD
    metrics = await fetch(node.port, node.context, "/metrics/resource")
    assert metrics.status == 200
    names = {f.name for f in text_string_to_metric_families(metrics.text)}
    assert {"node_cpu_usage_seconds", "container_memory_working_set_bytes"} <= names


async def test_kubectl_logs_follow_streams_ticks(node: Served) -> None:
    client = await HttpClient.connect(node.port, node.context)
    await client.request("GET", f"/containerLogs/{NS}/{POD}/app?follow=true&tailLines=1")
    response = await client.response()
    assert response.status_code == 200
    received = b""
    async with asyncio.timeout(5):
        async for chunk in client.chunks():
            received += chunk
            if b"mock: tick 2\n" in received:
                break
    assert received == b"mock: 1 lines\nmock: tick 1\nmock: tick 2\n"
    await client.close()
    previous = await fetch(node.port, node.context, f"/containerLogs/{NS}/{POD}/app?previous=1")
    assert (previous.status, previous.text) == (
        400,
        f'previous terminated container "app" in pod "{POD}" not found',
    )
