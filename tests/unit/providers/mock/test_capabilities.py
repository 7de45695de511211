"""The mock provider's optional capabilities, driven through the protocols as the kubelet server
drives them: exec (built-in commands, a little shell, the tar of `kubectl cp`, a TTY), attach,
port-forward to a local server, stats, resource metrics and logs."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vkubelet.node import ContainerLogOptions, ProviderError
from vkubelet.providers.mock import MockConfig, MockProvider
from vkubelet.providers.mock._stats import _go_float
from vkubelet.sdk.capabilities import (
    ContainerAttach,
    ContainerExec,
    MetricsProvider,
    PortForwarder,
    StatsProvider,
    TerminalSize,
)

from ...kubelet.harness import start_echo_server
from .helpers import NS, POD, UID, Connection, Input, make_tar, read_tar, resolved, stdio


@pytest.fixture
async def mock() -> MockProvider:
    provider = MockProvider("n1", MockConfig())
    provider.tick_seconds = 0.05
    await provider.create_pod(resolved())
    return provider


async def run(
    mock: MockProvider, *command: str, stdin: bytes | None = None, container: str = "app"
) -> tuple[int, bytes, bytes]:
    """Run a command without a TTY; (exit code, stdout, stderr)."""
    io_, out, err = stdio(None if stdin is None else Input(stdin, closed=True))
    async with asyncio.timeout(10):
        code = await mock.exec_in_container(NS, POD, container, list(command), io_)
    assert err is not None
    return code, bytes(out.data), bytes(err.data)


# --- exec: commands -------------------------------------------------------------------------


async def test_the_mock_offers_every_capability(mock: MockProvider) -> None:
    for capability in (ContainerExec, ContainerAttach, PortForwarder, StatsProvider):
        assert isinstance(mock, capability)
    assert isinstance(mock, MetricsProvider)


async def test_builtin_commands_print_and_exit_like_their_namesakes(mock: MockProvider) -> None:
    assert (await run(mock, "true"))[0] == 0
    assert (await run(mock, "false"))[0] == 1
    assert (await run(mock, "exit", "3"))[0] == 3
    assert await run(mock, "echo", "hello", "world") == (0, b"hello world\n", b"")
    assert await run(mock, "/bin/echo", "-n", "x") == (0, b"x", b"")
    assert await run(mock, "hostname") == (0, b"web\n", b"")
    assert await run(mock, "sleep", "0.01") == (0, b"", b"")
    assert (await run(mock, "sleep", "soon"))[0] == 1


async def test_env_shows_the_containers_resolved_environment(mock: MockProvider) -> None:
    code, out, _ = await run(mock, "env")
    env = dict(line.split("=", 1) for line in out.decode().splitlines())
    assert code == 0
    assert env["GREETING"] == "hello there"
    assert env["HOSTNAME"] == "web"
    assert env["HOME"] == "/root" and "/bin" in env["PATH"]
    _, sidecar, _ = await run(mock, "env", container="sidecar")
    assert b"GREETING" not in sidecar


async def test_an_unknown_command_exits_127_with_a_message_on_stderr(mock: MockProvider) -> None:
    assert await run(mock, "nginx", "-g", "daemon off;") == (
        127,
        b"",
        b"mock: nginx: command not found\n",
    )


async def test_unknown_pods_and_containers_are_not_found(mock: MockProvider) -> None:
    io_, _, _ = stdio(None)
    calls = [
        mock.exec_in_container(NS, "nope", "app", ["true"], io_),
        mock.exec_in_container(NS, POD, "nope", ["true"], io_),
        mock.exec_in_container(NS, POD, "setup", ["true"], io_),  # a completed init container
        mock.attach_to_container(NS, POD, "nope", io_),
        mock.port_forward(NS, "nope", 80, Connection()),
    ]
    for call in calls:
        with pytest.raises(ProviderError) as caught:
            await call
        assert caught.value.reason == "NotFound"


async def test_cat_copies_stdin_to_stdout_until_it_ends(mock: MockProvider) -> None:
    payload = os.urandom(300_000)
    assert await run(mock, "cat", stdin=payload) == (0, payload, b"")
    code, _, err = await run(mock, "cat", "/etc/missing")
    assert (code, err) == (1, b"cat: /etc/missing: No such file or directory\n")


async def test_volume_files_appear_at_their_mount_paths(mock: MockProvider) -> None:
    assert await run(mock, "cat", "/etc/config/mode") == (0, b"fast", b"")
    assert await run(mock, "cat", "/etc/config/nested/deep.txt") == (0, b"deep", b"")
    assert await run(mock, "cat", "/app/settings.json") == (0, b'{"replicas": 1}', b"")
    assert await run(mock, "ls", "/etc/config") == (0, b"mode\nnested\nsettings.json\n", b"")
    assert (await run(mock, "test", "-d", "/scratch"))[0] == 0
    _, etc, _ = await run(mock, "ls", "/etc")
    assert {"config", "hostname", "hosts"} <= set(etc.decode().split())
    code, _, err = await run(mock, "ls", "/nowhere")
    assert code == 2 and b"No such file or directory" in err


async def test_containers_have_their_own_files(mock: MockProvider) -> None:
    assert (await run(mock, "sh", "-c", "echo mine > /tmp/note"))[0] == 0
    assert await run(mock, "cat", "/tmp/note") == (0, b"mine\n", b"")
    assert (await run(mock, "cat", "/tmp/note", container="sidecar"))[0] == 1
    assert (await run(mock, "test", "-e", "/etc/config", container="sidecar"))[0] == 1


async def test_updated_volume_files_replace_the_mounted_ones(mock: MockProvider) -> None:
    await run(mock, "sh", "-c", "echo kept > /tmp/kept")
    await mock.update_pod(resolved(settings=b'{"replicas": 2}'))
    assert await run(mock, "cat", "/etc/config/settings.json") == (0, b'{"replicas": 2}', b"")
    # subPath mounts are not updated, as on a kubelet
    assert await run(mock, "cat", "/app/settings.json") == (0, b'{"replicas": 1}', b"")
    assert await run(mock, "cat", "/tmp/kept") == (0, b"kept\n", b"")


# --- exec: kubectl cp -----------------------------------------------------------------------


async def test_kubectl_cp_into_the_pod_and_back_out_round_trips(mock: MockProvider) -> None:
    blob = os.urandom(200_000)
    # `kubectl cp ./data web:/tmp`: /tmp is a directory, so the copy goes to /tmp/data
    assert (await run(mock, "test", "-d", "/tmp"))[0] == 0
    assert (await run(mock, "test", "-d", "/tmp/data"))[0] == 1
    archive = make_tar({"data/a.txt": b"alpha\n", "data/sub/b.bin": blob, "data/empty": None})
    assert await run(mock, "tar", "-xmf", "-", "-C", "/tmp", stdin=archive) == (0, b"", b"")
    assert await run(mock, "cat", "/tmp/data/sub/b.bin") == (0, blob, b"")
    assert await run(mock, "ls", "/tmp/data") == (0, b"a.txt\nempty\nsub\n", b"")

    # `kubectl cp web:/tmp/data ./back`
    code, out, err = await run(mock, "tar", "cf", "-", "/tmp/data")
    assert code == 0
    assert err == b"tar: Removing leading `/' from member names\n"
    entries = read_tar(out)
    assert all(name.startswith("tmp/data") for name in entries)  # kubectl checks the prefix
    assert entries == {
        "tmp/data": None,
        "tmp/data/a.txt": b"alpha\n",
        "tmp/data/empty": None,
        "tmp/data/sub": None,
        "tmp/data/sub/b.bin": blob,
    }


async def test_kubectl_cp_no_preserve_and_single_files_work(mock: MockProvider) -> None:
    # `kubectl cp --no-preserve ./notes.txt web:/tmp/renamed.txt` (not a directory: as named)
    command = ["tar", "--no-same-permissions", "--no-same-owner", "-xmf", "-", "-C", "/tmp"]
    archive = make_tar({"renamed.txt": b"notes"})
    assert await run(mock, *command, stdin=archive) == (0, b"", b"")
    code, out, _ = await run(mock, "tar", "cf", "-", "/tmp/renamed.txt")
    assert code == 0 and read_tar(out) == {"tmp/renamed.txt": b"notes"}


async def test_kubectl_cp_retries_resume_through_tail(mock: MockProvider) -> None:
    """With --retries kubectl runs `sh -c "tar cf - 'PATH' | tail -c+N"` and splices the
    output onto what it had: the archive must come out the same each time."""
    archive = make_tar({"data/a.txt": os.urandom(50_000), "data/b.txt": b"b"})
    await run(mock, "tar", "-xmf", "-", "-C", "/tmp", stdin=archive)
    _, whole, _ = await run(mock, "tar", "cf", "-", "/tmp/data")
    code, first, _ = await run(mock, "sh", "-c", "tar cf - '/tmp/data' | tail -c+0")
    assert code == 0 and first == whole
    _, rest, _ = await run(mock, "sh", "-c", "tar cf - '/tmp/data' | tail -c+20001")
    assert rest == whole[20_000:]


async def test_tar_fails_like_gnu_tar(mock: MockProvider) -> None:
    code, _, err = await run(mock, "tar", "cf", "-", "/tmp/missing")
    assert code == 2
    assert b"tar: /tmp/missing: Cannot stat: No such file or directory" in err
    code, _, err = await run(mock, "tar", "-xmf", "-", "-C", "/tmp", stdin=b"not a tar")
    assert code == 2 and b"does not look like a tar archive" in err
    code, _, err = await run(mock, "tar", "-xmf", "-", "-C", "/nowhere", stdin=make_tar({}))
    assert code == 2 and b"Cannot open" in err


async def test_tar_does_not_write_outside_its_directory(mock: MockProvider) -> None:
    archive = make_tar({"../escape.txt": b"x", "fine.txt": b"y"})
    code, _, err = await run(mock, "tar", "-xmf", "-", "-C", "/tmp", stdin=archive)
    assert code == 2 and b"Member name contains '..'" in err
    assert (await run(mock, "test", "-e", "/escape.txt"))[0] == 1
    assert await run(mock, "cat", "/tmp/fine.txt") == (0, b"y", b"")


async def test_a_full_filesystem_fails_the_write(mock: MockProvider) -> None:
    big = os.urandom(70 * 2**20)
    code, _, err = await run(mock, "sh", "-c", "cat > /tmp/big", stdin=big)
    assert code == 1 and b"No space left on device" in err


# --- exec: the shell ------------------------------------------------------------------------


async def test_sh_runs_lists_pipelines_and_redirections(mock: MockProvider) -> None:
    script = """
        echo one > /tmp/f; echo two >> /tmp/f
        cat /tmp/f | tail -n 1
        false && echo no || echo "status $?"
        A=1; echo "${A}-$HOSTNAME" 'single $A' # a comment
        cd /etc/config && pwd && ls | wc -l
        cat < /etc/config/mode; echo
        nosuch 2> /tmp/err; cat /tmp/err
        nosuch 2>&1 | wc -l
    """
    code, out, err = await run(mock, "sh", "-c", script)
    assert out.decode().splitlines() == [
        "two",
        "status 1",
        "1-web single $A",
        "/etc/config",
        "3",
        "fast",
        "mock: nosuch: command not found",
        "1",
    ]
    assert (code, err) == (0, b"")
    assert (await run(mock, "sh", "-c", "exit 4"))[0] == 4
    assert (await run(mock, "bash", "-c", "true && exit 5"))[0] == 5
    code, _, err = await run(mock, "sh", "-c", 'echo "unterminated')
    assert code == 2 and err.startswith(b"sh: syntax error")


async def test_sh_reads_commands_from_stdin_without_a_terminal(mock: MockProvider) -> None:
    code, out, err = await run(mock, "sh", stdin=b"echo a\nmkdir -p /x/y\nls /x\nexit 7\necho b\n")
    assert (code, out, err) == (7, b"a\ny\n", b"")


async def test_files_can_be_made_and_removed(mock: MockProvider) -> None:
    script = "mkdir /tmp/d && echo x > /tmp/d/f && rm /tmp/d; rm -r /tmp/d && test ! -e /tmp/d"
    code, _, err = await run(mock, "sh", "-c", script)
    assert code == 0
    assert err == b"rm: cannot remove '/tmp/d': Is a directory\n"


# --- exec: a terminal -----------------------------------------------------------------------


async def test_an_interactive_shell_on_a_tty_echoes_and_knows_the_window_size(
    mock: MockProvider,
) -> None:
    keyboard = Input()
    io_, screen, _ = stdio(keyboard, tty=True)
    io_.resizes.put(TerminalSize(width=80, height=24))
    session = asyncio.create_task(mock.exec_in_container(NS, POD, "app", ["sh"], io_))
    await screen.wait_for(b"/ # ")
    keyboard.feed(b"stty size\r")
    await screen.wait_for(b"stty size\r\n24 80\r\n/ # ")
    io_.resizes.put(TerminalSize(width=120, height=40))  # the user resized the window
    keyboard.feed(b"stty size\r")
    await screen.wait_for(b"40 120\r\n/ # ")  # typing before the prompt would echo first
    keyboard.feed(b"echo hix\x7f\r")  # a typo, erased
    await screen.wait_for(b"echo hix\b \b\r\nhi\r\n/ # ")
    keyboard.feed(b"cat\r")
    keyboard.feed(b"typed\r")
    await screen.wait_for(b"typed\r\ntyped\r\n")  # the echo, then cat's copy
    keyboard.feed(b"\x04")  # ^D ends cat's input, not the shell's
    keyboard.feed(b"exit 3\r")
    async with asyncio.timeout(5):
        assert await session == 3


async def test_ctrl_c_interrupts_the_foreground_command(mock: MockProvider) -> None:
    keyboard = Input()
    io_, screen, _ = stdio(keyboard, tty=True)
    io_.resizes.close()
    session = asyncio.create_task(mock.exec_in_container(NS, POD, "app", ["sh"], io_))
    await screen.wait_for(b"/ # ")
    keyboard.feed(b"sleep 100\r")
    await screen.wait_for(b"sleep 100\r\n")
    keyboard.feed(b"\x03")
    await screen.wait_for(b"^C\r\n/ # ")  # the shell survives
    keyboard.feed(b"echo $?\r")
    await screen.wait_for(b"130\r\n")
    keyboard.end()  # the end of input ends the shell, with the status of `echo`
    async with asyncio.timeout(5):
        assert await session == 0
    assert screen.data.endswith(b"exit\r\n")

    keyboard = Input()
    io_, screen, _ = stdio(keyboard, tty=True)
    io_.resizes.close()
    sleeper = asyncio.create_task(mock.exec_in_container(NS, POD, "app", ["sleep", "100"], io_))
    await asyncio.sleep(0.05)
    keyboard.feed(b"\x03")
    async with asyncio.timeout(5):
        assert await sleeper == 130


async def test_stty_needs_a_terminal(mock: MockProvider) -> None:
    code, _, err = await run(mock, "stty", "size")
    assert code == 1 and b"Inappropriate ioctl" in err


async def test_a_command_is_killed_when_its_pod_stops(mock: MockProvider) -> None:
    io_, _, _ = stdio(None)
    sleeper = asyncio.create_task(mock.exec_in_container(NS, POD, "app", ["sleep", "100"], io_))
    await asyncio.sleep(0.05)
    pod = await mock.get_pod(NS, POD)
    assert pod is not None
    await mock.delete_pod(pod, 0)
    async with asyncio.timeout(5):
        assert await sleeper == 137


# --- attach ---------------------------------------------------------------------------------


async def test_attach_echoes_stdin_upper_cased_until_it_ends(mock: MockProvider) -> None:
    io_, out, _ = stdio(Input(b"hello\nworld", closed=True))
    async with asyncio.timeout(5):
        await mock.attach_to_container(NS, POD, "app", io_)
    assert bytes(out.data) == b"HELLO\nWORLD"


async def test_attach_with_a_tty_echoes_typing_and_ends_on_ctrl_c(mock: MockProvider) -> None:
    keyboard = Input()
    io_, screen, _ = stdio(keyboard, tty=True)
    io_.resizes.close()
    attached = asyncio.create_task(mock.attach_to_container(NS, POD, "app", io_))
    keyboard.feed(b"hi\r")
    await screen.wait_for(b"hi\r\nHI\r\n")
    keyboard.feed(b"\x03")
    async with asyncio.timeout(5):
        await attached


async def test_attach_without_stdin_prints_a_line_every_tick_until_detached(
    mock: MockProvider,
) -> None:
    io_, out, _ = stdio(None)
    attached = asyncio.create_task(mock.attach_to_container(NS, POD, "app", io_))
    await out.wait_for(b"mock: app is running (3)\n")
    attached.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attached


# --- port-forward ---------------------------------------------------------------------------


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await start_echo_server()
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def forward(mock: MockProvider, port: int, payload: bytes) -> bytes:
    connection = Connection()
    task = asyncio.create_task(mock.port_forward(NS, POD, port, connection))
    for offset in range(0, len(payload), 32 * 1024):
        connection.feed(payload[offset : offset + 32 * 1024])
        await asyncio.sleep(0)
    connection.end()
    async with asyncio.timeout(10):
        await task
    assert connection.closed
    return bytes(connection.data)


async def test_port_forward_relays_bytes_both_ways_to_a_local_server(
    mock: MockProvider, echo_port: int
) -> None:
    payload = os.urandom(1_000_000)
    assert await forward(mock, echo_port, payload) == payload


async def test_port_forward_carries_many_connections_at_once(
    mock: MockProvider, echo_port: int
) -> None:
    payloads = [os.urandom(100_000 + k) for k in range(20)]
    results = await asyncio.gather(*(forward(mock, echo_port, p) for p in payloads))
    assert results == payloads


async def test_port_forward_to_a_closed_port_is_an_error_naming_it(mock: MockProvider) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}: connect: connection refused"):
        await mock.port_forward(NS, POD, port, Connection())


async def test_port_forward_ends_soon_after_the_server_closes(mock: MockProvider) -> None:
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"bye\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    connection = Connection()  # the client never finishes sending
    async with asyncio.timeout(5):
        await mock.port_forward(NS, POD, server.sockets[0].getsockname()[1], connection)
    assert bytes(connection.data) == b"bye\n" and connection.closed
    server.close()
    await server.wait_closed()


# --- stats and metrics ----------------------------------------------------------------------


def started_long_ago(mock: MockProvider, seconds: int) -> None:
    """Pretend the pod has been running for a while (the mock counts CPU from its start)."""
    record = mock._pods[f"{NS}/{POD}"]
    start = datetime.now(UTC) - timedelta(seconds=seconds)
    record.started = start.strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_stats_summary_has_the_kubelet_shape_and_plausible_numbers(
    mock: MockProvider,
) -> None:
    started_long_ago(mock, 100)
    summary = await mock.stats_summary()
    node = summary["node"]
    assert node["nodeName"] == "n1" and node["startTime"]
    assert {"time", "usageNanoCores", "usageCoreNanoSeconds"} <= node["cpu"].keys()
    memory_keys = {"time", "workingSetBytes", "usageBytes", "availableBytes", "rssBytes"}
    assert memory_keys <= node["memory"].keys()
    [pod] = summary["pods"]
    assert pod["podRef"] == {"name": POD, "namespace": NS, "uid": UID}
    assert [c["name"] for c in pod["containers"]] == ["app", "sidecar"]  # not the init one
    for container in pod["containers"]:
        cpu, memory = container["cpu"], container["memory"]
        assert 5_000_000 <= cpu["usageNanoCores"] <= 200_000_000
        assert 16 * 2**20 <= memory["workingSetBytes"] <= 256 * 2**20
        # the counter is the rate times the time since the start
        elapsed = (
            datetime.fromisoformat(cpu["time"]) - datetime.fromisoformat(container["startTime"])
        ).total_seconds()
        assert cpu["usageCoreNanoSeconds"] == int(cpu["usageNanoCores"] * elapsed)
    assert pod["cpu"]["usageNanoCores"] == sum(
        c["cpu"]["usageNanoCores"] for c in pod["containers"]
    )
    assert node["cpu"]["usageNanoCores"] > pod["cpu"]["usageNanoCores"]
    assert node["memory"]["workingSetBytes"] > pod["memory"]["workingSetBytes"]


async def test_usage_is_deterministic_per_pod(mock: MockProvider) -> None:
    other = MockProvider("n2", MockConfig())
    await other.create_pod(resolved())
    ours, theirs = (await mock.stats_summary())["pods"][0], (await other.stats_summary())["pods"][0]
    for a, b in zip(ours["containers"], theirs["containers"], strict=True):
        assert a["cpu"]["usageNanoCores"] == b["cpu"]["usageNanoCores"]
        assert a["memory"]["workingSetBytes"] == b["memory"]["workingSetBytes"]


async def test_the_node_cpu_counter_keeps_what_deleted_pods_used(mock: MockProvider) -> None:
    started_long_ago(mock, 3600)
    before = (await mock.stats_summary())["node"]["cpu"]["usageCoreNanoSeconds"]
    pod = await mock.get_pod(NS, POD)
    assert pod is not None
    await mock.delete_pod(pod, 0)
    after = await mock.stats_summary()
    assert after["pods"] == []
    assert after["node"]["cpu"]["usageCoreNanoSeconds"] >= before


async def test_resource_metrics_are_the_summarys_numbers_as_prometheus_text(
    mock: MockProvider,
) -> None:
    started_long_ago(mock, 100)
    text = await mock.metrics_resource()
    summary = await mock.stats_summary()
    assert "# HELP node_cpu_usage_seconds_total [STABLE] " in text
    assert "# TYPE container_cpu_usage_seconds_total counter" in text
    assert text.endswith("resource_scrape_error 0\n")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    now_ms = datetime.now(UTC).timestamp()
    memory = {
        s.labels["container"]: s for s in families["container_memory_working_set_bytes"].samples
    }
    for container in summary["pods"][0]["containers"]:
        sample = memory[container["name"]]
        assert sample.labels == {"container": container["name"], "namespace": NS, "pod": POD}
        assert sample.value == container["memory"]["workingSetBytes"]
        assert sample.timestamp is not None and abs(float(sample.timestamp) - now_ms) < 5
    [node_cpu] = families["node_cpu_usage_seconds"].samples  # the parser drops "_total"
    assert node_cpu.value >= summary["node"]["cpu"]["usageCoreNanoSeconds"] / 1e9 - 1
    [pod_memory] = families["pod_memory_working_set_bytes"].samples
    assert pod_memory.value == summary["pods"][0]["memory"]["workingSetBytes"]
    starts = families["container_start_time_seconds"].samples
    assert len(starts) == 2 and starts[0].timestamp is None


async def test_a_node_without_pods_reports_only_node_metrics() -> None:
    text = await MockProvider("n1", MockConfig()).metrics_resource()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    expected = ["node_cpu_usage_seconds_total", "node_memory_working_set_bytes"]
    assert names == [*expected, "resource_scrape_error"]


def test_metric_values_are_formatted_as_go_formats_them() -> None:
    cases = {
        14794752.0: "1.4794752e+07",
        0.951446: "0.951446",
        123456.0: "123456",
        1234567.0: "1.234567e+06",
        1.7e9: "1.7e+09",
        0.0001: "0.0001",
        0.00001: "1e-05",
        0.0: "0",
        -2.5: "-2.5",
        100.0: "100",
    }
    assert {value: _go_float(value) for value in cases} == cases


# --- logs -----------------------------------------------------------------------------------


async def logs(mock: MockProvider, **options: object) -> list[str]:
    chunks = mock.container_logs(NS, POD, "app", ContainerLogOptions(**options))  # type: ignore[arg-type]
    return [chunk.decode() async for chunk in chunks]


async def test_logs_honour_since_and_limit_bytes(mock: MockProvider) -> None:
    everything = await logs(mock)
    assert everything[0] == f"mock: container app of {NS}/{POD} started\n"
    assert await logs(mock, since_seconds=3600) == everything
    assert await logs(mock, since_time=datetime.now(UTC) + timedelta(seconds=5)) == []
    assert "".join(await logs(mock, limit_bytes=10)) == "".join(everything)[:10]


async def test_logs_of_a_previous_container_are_not_found(mock: MockProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        await logs(mock, previous=True)
    assert caught.value.reason == "NotFound"
    assert 'previous terminated container "app" in pod "web" not found' in str(caught.value)


async def test_following_logs_streams_ticks_until_the_pod_stops(mock: MockProvider) -> None:
    stream = mock.container_logs(NS, POD, "app", ContainerLogOptions(follow=True, tail_lines=0))
    assert await anext(stream) == b"mock: tick 1\n"
    assert await anext(stream) == b"mock: tick 2\n"
    pod = await mock.get_pod(NS, POD)
    assert pod is not None
    await mock.delete_pod(pod, 0)
    async with asyncio.timeout(5):
        rest = [chunk async for chunk in stream]
    assert len(rest) <= 1  # at most a tick that was already due


async def test_a_follower_with_a_byte_limit_stops_at_the_limit(mock: MockProvider) -> None:
    options = ContainerLogOptions(follow=True, tail_lines=0, limit_bytes=20)
    async with asyncio.timeout(5):
        chunks = [c async for c in mock.container_logs(NS, POD, "app", options)]
    assert b"".join(chunks) == b"mock: tick 1\nmock: tick 2\n"[:20]


async def test_mounts_survive_a_restart_through_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first = MockProvider("n1", MockConfig(state_file=state))
    await first.create_pod(resolved())  # returns once the state file has the pod
    second = MockProvider("n1", MockConfig(state_file=state))
    assert await run(second, "cat", "/etc/config/mode") == (0, b"fast", b"")


def test_a_mock_pod_stopped_in_the_second_it_started_ends_succeeded() -> None:
    """The status is replayed from the pod's life; only its last step may end the pod."""
    from vkubelet.providers.mock._provider import _status
    from vkubelet.providers.mock._records import MockContainer, MockPod
    from vkubelet.sdk.clock import now_rfc3339 as now

    t = now()
    containers = [MockContainer("setup", "img", [], init=True), MockContainer("app", "img", [])]
    mock = MockPod("ns", "p", "u", "node", "10.0.0.1", containers, t, started=t, stopped=t)
    status = _status(mock, "10.0.0.2")
    assert status.phase == "Succeeded"
    [app] = status.containerStatuses or []
    assert app.state and app.state.terminated and app.state.terminated.exitCode == 0
