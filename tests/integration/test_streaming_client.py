"""vkubelet.streaming as a client of the REAL apiserver, down to a mock node's pod: what the
cluster provider will do to relay kubectl's streaming verbs to a lower cluster.

Each transport is pinned explicitly so both are proven: "websocket" is the v5 channel protocol
the apiserver translates to SPDY (exec/attach) or the SPDY tunnel it unwraps (port-forward);
"spdy" is the direct upgrade the apiserver proxies byte for byte. Results are compared with what
kubectl prints for the same calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.sdk.capabilities import AttachIO, ResizeQueue, TerminalSize
from vkubelet.streaming import (
    Endpoint,
    PortForwardError,
    PortForwardSession,
    Transport,
    UpgradeFailed,
    attach,
    exec_command,
    port_forward,
)
from vkubelet.testing import Kubectl, MockNode, running_pod

from ..unit.streaming.stdio import Collected, Feed, Loopback, Payload

BOTH: list[Transport] = ["websocket", "spdy"]
NS = "default"
CONTAINER = "main"


@pytest.fixture(scope="module")
def node(api_node: MockNode) -> str:
    return api_node.name


@pytest.fixture(scope="module")
def pod(node: str, kubectl: Kubectl) -> Iterator[str]:
    name = running_pod(kubectl, node, env=[{"name": "GREETING", "value": "hi there"}])
    yield name
    kubectl("delete", "pod", name, "--wait=false")


@pytest.fixture
def api(kube_cluster: Cluster) -> Endpoint:
    """The admin kubeconfig, as the cluster provider would hold the lower cluster's."""
    return Endpoint.from_kubeconfig(kube_cluster.kubeconfig)


async def run(
    api: Endpoint,
    pod: str,
    command: list[str],
    transport: Transport,
    stdin: bytes | None = None,
) -> tuple[int, bytes, bytes]:
    stdout, stderr = Collected(), Collected()
    io = AttachIO(stdin=None if stdin is None else Payload(stdin), stdout=stdout, stderr=stderr)
    async with asyncio.timeout(60):
        code = await exec_command(api, NS, pod, CONTAINER, command, io, transport=transport)
    return code, bytes(stdout.data), bytes(stderr.data)


@pytest.mark.parametrize("transport", [*BOTH, "auto"])
async def test_exec_output_and_environment_match_kubectl(
    api: Endpoint, pod: str, kubectl: Kubectl, transport: Transport
) -> None:
    code, out, _ = await run(api, pod, ["echo", "hello", "world"], transport)
    assert (code, out) == (0, b"hello world\n")
    assert out.decode() == kubectl("exec", pod, "--", "echo", "hello", "world").stdout
    code, out, _ = await run(api, pod, ["env"], transport)
    assert code == 0
    assert "GREETING=hi there" in out.decode()
    assert out.decode() == kubectl("exec", pod, "--", "env").stdout


@pytest.mark.parametrize("transport", BOTH)
async def test_exec_returns_the_exit_code_kubectl_exits_with(
    api: Endpoint, pod: str, kubectl: Kubectl, transport: Transport
) -> None:
    code, _, _ = await run(api, pod, ["sh", "-c", "echo oops >&2; exit 3"], transport)
    assert code == 3
    assert kubectl("exec", pod, "--", "exit", "3", check=False).returncode == 3
    assert (await run(api, pod, ["false"], transport))[0] == 1
    _, _, err = await run(api, pod, ["sh", "-c", "echo oops >&2"], transport)
    assert err == b"oops\n"


@pytest.mark.parametrize("transport", BOTH)
async def test_stdin_streams_through_and_its_end_reaches_the_pod(
    api: Endpoint, pod: str, transport: Transport
) -> None:
    data = b"".join(f"line {i}\n".encode() for i in range(20000))
    code, out, _ = await run(api, pod, ["cat"], transport, stdin=data)
    assert code == 0
    assert out == data


@pytest.mark.parametrize("transport", BOTH)
async def test_a_terminal_sees_its_size_and_every_resize(
    api: Endpoint, pod: str, transport: Transport
) -> None:
    stdin, stdout, sizes = Feed(), Collected(), ResizeQueue()
    sizes.put(TerminalSize(120, 40))
    io = AttachIO(stdin=stdin, stdout=stdout, stderr=None, tty=True, resizes=sizes)
    session = asyncio.create_task(
        exec_command(api, NS, pod, CONTAINER, ["sh"], io, transport=transport)
    )

    async def size_shown(rows_cols: bytes) -> None:
        # Sizes and keystrokes travel on different streams, so ask again until the shell
        # has seen the new size.
        while rows_cols not in stdout.data:
            seen = len(stdout.data)
            stdin.send(b"stty size\n")
            await stdout.wait_until_it_ends_with(b"# ", beyond=seen)

    async with asyncio.timeout(60):
        await size_shown(b"40 120")
        sizes.put(TerminalSize(100, 30))
        await size_shown(b"30 100")
        stdin.send(b"exit 4\n")
        assert await session == 4


@pytest.mark.parametrize("transport", BOTH)
async def test_attach_talks_to_the_main_process_like_kubectl_attach(
    api: Endpoint, pod: str, kubectl: Kubectl, transport: Transport
) -> None:
    stdin, stdout = Feed(), Collected()
    io = AttachIO(stdin=stdin, stdout=stdout, stderr=None)
    session = asyncio.create_task(attach(api, NS, pod, CONTAINER, io, transport=transport))
    async with asyncio.timeout(60):
        stdin.send(b"hello attach\n")
        await stdout.wait_until_it_ends_with(b"HELLO ATTACH\n")
        stdin.end()  # the main process's stdin ends: it stops echoing, the session ends
        assert await session == 0
    assert "HELLO ATTACH" in kubectl("attach", "-i", pod, input="hello attach\n").stdout


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    """A TCP echo server on this machine, where the mock's pods forward to."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("transport", BOTH)
async def test_port_forward_moves_ten_mib_each_way_byte_exact(
    api: Endpoint, pod: str, echo_port: int, transport: Transport
) -> None:
    data = hashlib.sha256(transport.encode()).digest() * (10 * 1024 * 1024 // 32)
    stream = Loopback(data)
    async with asyncio.timeout(120):
        await port_forward(api, NS, pod, echo_port, stream, transport=transport)
    assert len(stream.received) == len(data)
    assert bytes(stream.received) == data
    assert stream.closed


@pytest.mark.parametrize("transport", BOTH)
async def test_many_connections_share_one_port_forward_session(
    api: Endpoint, pod: str, echo_port: int, transport: Transport
) -> None:
    streams = [Loopback(hashlib.sha256(bytes([i])).digest() * 8192) for i in range(10)]
    async with (
        asyncio.timeout(120),
        await PortForwardSession.connect(api, NS, pod, transport=transport) as session,
    ):
        await asyncio.gather(*(session.forward(echo_port, s) for s in streams))
    assert all(len(s.received) == 8192 * 32 for s in streams)
    assert all(
        bytes(s.received) == hashlib.sha256(bytes([i])).digest() * 8192
        for i, s in enumerate(streams)
    )


@pytest.mark.parametrize("transport", BOTH)
async def test_forwarding_to_a_closed_port_reports_the_kubelets_error(
    api: Endpoint, pod: str, transport: Transport
) -> None:
    with pytest.raises(PortForwardError) as failure:
        await port_forward(api, NS, pod, 9, Loopback(b"x"), transport=transport)
    message = str(failure.value)
    assert message.startswith(f"error forwarding port 9 to pod {pod}, uid ")
    assert "connection refused" in message


@pytest.mark.parametrize("transport", [*BOTH, "auto"])
async def test_a_missing_pod_or_container_fails_with_kubectls_message(
    api: Endpoint, pod: str, kubectl: Kubectl, transport: Transport
) -> None:
    with pytest.raises(UpgradeFailed) as missing_pod:
        await run(api, "no-such-pod", ["true"], transport)
    assert (missing_pod.value.status, missing_pod.value.reason) == (404, "NotFound")
    assert str(missing_pod.value) == 'pods "no-such-pod" not found'
    printed = kubectl("exec", "no-such-pod", "--", "true", check=False).stderr
    assert f"Error from server (NotFound): {missing_pod.value}" in printed

    stdout = Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=None)
    with pytest.raises(UpgradeFailed) as missing_container:
        await exec_command(api, NS, pod, "ghost", ["true"], io, transport=transport)
    assert missing_container.value.status == 400
    printed = kubectl("exec", pod, "-c", "ghost", "--", "true", check=False).stderr
    assert str(missing_container.value) in printed

    with pytest.raises(UpgradeFailed) as missing_forward:
        await port_forward(api, NS, "no-such-pod", 80, Loopback(b""), transport=transport)
    assert str(missing_forward.value) == 'pods "no-such-pod" not found'
