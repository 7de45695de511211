"""kubectl exec / attach / port-forward / cp / top-style stats on a virtual node, through the real
apiserver (which speaks SPDY/3.1 to the kubelet port, or proxies WebSocket clients unchanged)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websocket  # websocket-client, the library the official Python client streams with
from prometheus_client.parser import text_string_to_metric_families

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    Kubectl,
    MockNode,
    port_forward,
    running_pod,
    terminal_session,
    wait_for,
)


@pytest.fixture(scope="module")
def node(api_node: MockNode) -> str:
    return api_node.name


@pytest.fixture(scope="module")
def pod(node: str, kubectl: Kubectl) -> Iterator[str]:
    name = running_pod(kubectl, node, env=[{"name": "GREETING", "value": "hi there"}])
    yield name
    kubectl("delete", "pod", name, "--wait=false")


def test_exec_runs_a_command_and_returns_its_output(pod: str, kubectl: Kubectl) -> None:
    assert kubectl("exec", pod, "--", "echo", "hello", "world").stdout == "hello world\n"
    assert "GREETING=hi there" in kubectl("exec", pod, "--", "env").stdout


def test_exec_propagates_a_non_zero_exit_code(pod: str, kubectl: Kubectl) -> None:
    result = kubectl("exec", pod, "--", "exit", "3", check=False)
    assert result.returncode == 3
    assert kubectl("exec", pod, "--", "false", check=False).returncode == 1


def test_exec_with_stdin_streams_it_through(pod: str, kubectl: Kubectl) -> None:
    data = "".join(f"line {i}\n" for i in range(2000))
    assert kubectl("exec", "-i", pod, "--", "cat", input=data).stdout == data


def test_attach_talks_to_the_main_process(pod: str, kubectl: Kubectl) -> None:
    result = kubectl("attach", "-i", pod, input="hello attach\n", timeout=30)
    assert "HELLO ATTACH" in result.stdout


def test_cp_copies_files_both_ways(pod: str, kubectl: Kubectl, tmp_path: Path) -> None:
    source = tmp_path / "payload.bin"
    source.write_bytes(os.urandom(300_000))
    kubectl("cp", str(source), f"{pod}:/tmp/payload.bin")
    back = tmp_path / "back.bin"
    kubectl("cp", f"{pod}:/tmp/payload.bin", str(back))
    assert back.read_bytes() == source.read_bytes()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by .ci/run")
def test_exec_with_a_terminal_sees_its_size_and_resizes(pod: str, kubectl: Kubectl) -> None:
    command = f"{kubectl.binary} --kubeconfig {kubectl.kubeconfig} exec -it {pod} -- sh"
    with terminal_session(command, cols=120, rows=40) as terminal:
        time.sleep(2)  # the interactive shell in the pod is ready
        terminal.type("stty size")
        wait_for(lambda: "40 120" in terminal.screen(), timeout=30, what="the size in the pod")
        terminal.resize(100, 30)
        time.sleep(1)
        terminal.type("stty size")
        wait_for(lambda: "30 100" in terminal.screen(), timeout=30, what="the size after resize")
        terminal.type("exit 4")


class EchoServer:
    """A TCP echo server on this machine: what the mock's pods forward ports to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        async def serve() -> None:
            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
                writer.close()

            server = await asyncio.start_server(echo, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await server.serve_forever()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),))
        self.thread.daemon = True
        self.thread.start()
        ready.wait(10)


def test_port_forward_moves_many_concurrent_connections_byte_exact(
    pod: str, kubectl: Kubectl
) -> None:
    echo = EchoServer()
    with port_forward(kubectl, pod, echo.port) as local:
        size = 10 * 1024 * 1024
        results: dict[int, bool] = {}

        def one(i: int) -> None:
            payload = hashlib.sha256(str(i).encode()).digest() * (size // 32)
            with socket.create_connection(("127.0.0.1", local), timeout=60) as conn:
                sender = threading.Thread(target=conn.sendall, args=(payload,))
                sender.start()
                received = bytearray()
                while len(received) < size:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    received += chunk
                sender.join()
            results[i] = bytes(received) == payload

        started = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        elapsed = time.monotonic() - started
        assert results == dict.fromkeys(range(20), True), results
        print(f"port-forward: 20 x 10 MiB each way in {elapsed:.1f} s")


def test_stats_summary_and_resource_metrics_parse(node: str, pod: str, kubectl: Kubectl) -> None:
    base = f"/api/v1/nodes/{node}/proxy"
    summary = json.loads(kubectl("get", "--raw", f"{base}/stats/summary").stdout)
    assert summary["node"]["nodeName"] == node
    assert any(p["podRef"]["name"] == pod for p in summary["pods"])
    text = kubectl("get", "--raw", f"{base}/metrics/resource").stdout
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"node_cpu_usage_seconds", "container_memory_working_set_bytes"} <= names


def _websocket(kube_cluster: Cluster, path: str, protocol: str) -> websocket.WebSocket:
    server = kube_cluster.server.replace("https://", "wss://")
    return websocket.create_connection(
        f"{server}{path}",
        subprotocols=[protocol],
        sslopt={
            "ca_certs": str(kube_cluster.pki / "ca.crt"),
            "certfile": str(kube_cluster.pki / "admin.crt"),
            "keyfile": str(kube_cluster.pki / "admin.key"),
            "cert_reqs": ssl.CERT_REQUIRED,
        },
        timeout=30,
    )


def test_a_websocket_v4_client_can_port_forward(kube_cluster: Cluster, pod: str) -> None:
    """port-forward over v4.channel.k8s.io: channel 0 carries data, channel 1 errors; the first
    frame on each channel is the port (little-endian)."""
    echo = EchoServer()
    ws = _websocket(
        kube_cluster,
        f"/api/v1/namespaces/default/pods/{pod}/portforward?ports={echo.port}",
        "v4.channel.k8s.io",
    )
    try:
        payload = os.urandom(100_000)
        received = bytearray()
        greeted = set()
        ws.send_binary(b"\x00" + payload)
        while len(received) < len(payload):
            frame = ws.recv()
            data = frame if isinstance(frame, bytes) else frame.encode()
            channel, body = data[0], data[1:]
            if channel not in greeted:  # the port announcement
                greeted.add(channel)
                assert int.from_bytes(body[:2], "little") == echo.port
                body = body[2:]
            if channel == 1 and body:
                pytest.fail(f"port-forward error: {body!r}")
            if channel == 0:
                received += body
        assert bytes(received) == payload
    finally:
        ws.close()


def test_a_websocket_v4_client_can_exec(kube_cluster: Cluster, pod: str) -> None:
    """Clients other than kubectl (here websocket-client, which the official Python client uses)
    speak v4.channel.k8s.io; the apiserver proxies them to the kubelet port unchanged."""
    ws = _websocket(
        kube_cluster,
        f"/api/v1/namespaces/default/pods/{pod}/exec"
        "?command=echo&command=over&command=websocket&stdout=true&stderr=true",
        "v4.channel.k8s.io",
    )
    stdout = b""
    status = b""
    try:
        while True:
            try:
                frame = ws.recv()
            except websocket.WebSocketConnectionClosedException:
                break
            if not frame:
                break
            data = frame if isinstance(frame, bytes) else frame.encode()
            if data[:1] == b"\x01":
                stdout += data[1:]
            elif data[:1] == b"\x03":
                status += data[1:]
    finally:
        ws.close()
    assert stdout == b"over websocket\n"
    assert json.loads(status)["status"] == "Success"
