"""exec and attach as a client, against our kubelet server over TLS, on both transports.

Our kubelet accepts WebSocket v5 and SPDY, so ``transport`` picks which one the client uses;
"auto" takes the WebSocket here, as kubectl would.
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from typing import NoReturn

import pytest

from vkubelet.sdk.capabilities import AttachIO, ResizeQueue, TerminalSize
from vkubelet.streaming import (
    Endpoint,
    RemoteCommandError,
    Transport,
    UpgradeFailed,
    attach,
    exec_command,
)
from vkubelet.streaming import _exec as streaming_exec

from ..kubelet.harness import CONTAINER, NAMESPACE, POD, Kubelet
from .stdio import Collected, Feed, Payload, SlowSink

BOTH: list[Transport] = ["websocket", "spdy"]


def endpoint(kubelet: Kubelet) -> Endpoint:
    return Endpoint(f"https://127.0.0.1:{kubelet.port}", kubelet.context(), kubelet=True)


@pytest.mark.parametrize("transport", BOTH)
async def test_exec_returns_stdout_stderr_and_the_exit_code(
    kubelet: Kubelet, transport: Transport
) -> None:
    stdout, stderr = Collected(), Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=stderr)
    code = await exec_command(
        endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["fail", "3"], io, transport=transport
    )
    assert (code, bytes(stdout.data), bytes(stderr.data)) == (3, b"partial\n", b"oops\n")


@pytest.mark.parametrize("transport", [*BOTH, "auto"])
async def test_exec_of_a_successful_command_returns_zero(
    kubelet: Kubelet, transport: Transport
) -> None:
    stdout = Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=Collected())
    command = ["echo", "hello", "world"]
    code = await exec_command(
        endpoint(kubelet), NAMESPACE, POD, CONTAINER, command, io, transport=transport
    )
    assert (code, bytes(stdout.data)) == (0, b"hello world\n")


@pytest.mark.parametrize("transport", BOTH)
async def test_stdin_goes_through_byte_exact_and_its_end_ends_the_command(
    kubelet: Kubelet, transport: Transport
) -> None:
    """`cat` exits only once it sees stdin end, so returning at all proves the end (v5's
    close signal, SPDY's half-close) got through."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    stdout = Collected()
    io = AttachIO(stdin=Payload(data), stdout=stdout, stderr=None)
    async with asyncio.timeout(30):
        code = await exec_command(
            endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["cat"], io, transport=transport
        )
    assert code == 0
    assert bytes(stdout.data) == data


@pytest.mark.parametrize("transport", BOTH)
async def test_a_terminal_session_forwards_every_resize(
    kubelet: Kubelet, transport: Transport
) -> None:
    sizes = ResizeQueue()
    sizes.put(TerminalSize(80, 24))
    sizes.put(TerminalSize(120, 40))
    stdout = Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=Collected(), tty=True, resizes=sizes)
    code = await exec_command(
        endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["sizes", "2"], io, transport=transport
    )
    assert code == 0
    assert bytes(stdout.data) == b"80x24\n120x40\n"
    assert kubelet.provider.started.is_set()


@pytest.mark.parametrize("transport", BOTH)
async def test_attach_relays_the_main_process_output(
    kubelet: Kubelet, transport: Transport
) -> None:
    stdout = Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=None)
    code = await attach(endpoint(kubelet), NAMESPACE, POD, CONTAINER, io, transport=transport)
    assert (code, bytes(stdout.data)) == (0, b"attached\n")


@pytest.mark.parametrize("transport", BOTH)
async def test_a_command_that_cannot_run_raises_with_the_servers_message(
    kubelet: Kubelet, transport: Transport
) -> None:
    io = AttachIO(stdin=None, stdout=Collected(), stderr=None)
    with pytest.raises(RemoteCommandError, match=r"cannot run \['boom'\]"):
        await exec_command(
            endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["boom"], io, transport=transport
        )


@pytest.mark.parametrize("transport", [*BOTH, "auto"])
async def test_an_unknown_pod_or_container_is_an_upgrade_failure_with_the_message(
    kubelet: Kubelet, transport: Transport
) -> None:
    io = AttachIO(stdin=None, stdout=Collected(), stderr=None)
    with pytest.raises(UpgradeFailed) as missing_pod:
        await exec_command(
            endpoint(kubelet), NAMESPACE, "nope", CONTAINER, ["echo"], io, transport=transport
        )
    assert missing_pod.value.not_found
    assert "pod default/nope is not running on node n1" in str(missing_pod.value)
    with pytest.raises(UpgradeFailed) as missing_container:
        await exec_command(
            endpoint(kubelet), NAMESPACE, POD, "ghost", ["echo"], io, transport=transport
        )
    assert missing_container.value.status == 404
    assert str(missing_container.value) == "container ghost is not valid for pod web"


@pytest.mark.parametrize("transport", BOTH)
async def test_cancelling_the_call_ends_the_remote_command(
    kubelet: Kubelet, transport: Transport
) -> None:
    stdin = Feed()
    io = AttachIO(stdin=stdin, stdout=Collected(), stderr=None)
    call = asyncio.create_task(
        exec_command(
            endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["sleep"], io, transport=transport
        )
    )
    async with asyncio.timeout(10):
        await kubelet.provider.started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    async with asyncio.timeout(10):
        await kubelet.provider.cancelled.wait()


def sessions(kubelet: Kubelet, transport: str) -> float:
    labels = {"port": str(kubelet.port), "kind": "exec", "transport": transport}
    value = kubelet.registry.get_sample_value("vkubelet_kubelet_active_streams", labels)
    return value or 0.0


@pytest.mark.parametrize(
    ("transport", "carried_by"),
    [("websocket", "websocket"), ("spdy", "spdy"), ("auto", "websocket")],
)
async def test_an_interactive_stdin_is_relayed_as_it_is_typed(
    kubelet: Kubelet, transport: Transport, carried_by: str
) -> None:
    stdin, stdout = Feed(), Collected()
    io = AttachIO(stdin=stdin, stdout=stdout, stderr=None)
    call = asyncio.create_task(
        exec_command(endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["cat"], io, transport=transport)
    )
    async with asyncio.timeout(10):
        for line in (b"one\n", b"two\n"):
            stdin.send(line)
            await stdout.wait_until_it_ends_with(line)
        assert not call.done()
        assert sessions(kubelet, carried_by) == 1
        stdin.end()
        assert await call == 0
    assert bytes(stdout.data) == b"one\ntwo\n"


@pytest.mark.parametrize("transport", BOTH)
async def test_a_slow_stdout_holds_the_command_back_instead_of_being_buffered_for(
    kubelet: Kubelet, transport: Transport
) -> None:
    """16 MiB through `cat` into a stdout slower than stdin: without back-pressure the client
    (and the kubelet in this same process) would end up holding most of it."""
    size = 16 * 1024 * 1024
    pipe = SlowSink(size, delay=0.002)
    io = AttachIO(stdin=pipe, stdout=pipe, stderr=None)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        async with asyncio.timeout(120):
            code = await exec_command(
                endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["cat"], io, transport=transport
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0
    assert pipe.received_bytes == size and pipe.intact
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"


async def test_auto_falls_back_to_spdy_when_the_websocket_upgrade_is_refused(
    kubelet: Kubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As kubectl does against a server without the v5 translation (a real kubelet, an old
    apiserver, a proxy that drops WebSockets)."""

    async def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise UpgradeFailed(400, "BadRequest", "unable to upgrade: no v5.channel.k8s.io")

    monkeypatch.setattr(streaming_exec, "open_websocket", refuse)
    stdin, stdout = Feed(), Collected()
    io = AttachIO(stdin=stdin, stdout=stdout, stderr=None)
    call = asyncio.create_task(
        exec_command(endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["cat"], io)
    )
    async with asyncio.timeout(10):
        stdin.send(b"over spdy\n")
        await stdout.wait_until_it_ends_with(b"over spdy\n")
        assert sessions(kubelet, "spdy") == 1
        stdin.end()
        assert await call == 0
    with pytest.raises(UpgradeFailed, match="no v5"):
        await exec_command(
            endpoint(kubelet), NAMESPACE, POD, CONTAINER, ["true"], io, transport="websocket"
        )
