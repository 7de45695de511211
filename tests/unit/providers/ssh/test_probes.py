"""Probes against a device without a device: a fake link whose exec probes answer canned exit
codes (or run in the local sh), whose connections go to local servers and which only records
restarts. A probe second lasts 50 ms here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pytest
from lightkube.models.core_v1 import (
    Container,
    ContainerPort,
    ExecAction,
    HTTPGetAction,
    HTTPHeader,
    PodSpec,
    Probe,
    TCPSocketAction,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.ssh._link import Completed, Unreachable
from vkubelet.providers.ssh._probes import Prober
from vkubelet.providers.ssh._remote import ContainerStatus, RemotePod

pytestmark = pytest.mark.timeout(30)

UID = "u1"
SECOND = 0.05
HANG = -1  # a canned answer: none, ever
STARTED = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
State = Literal["waiting", "running", "terminated"]


class FakeLink:
    """The part of a DeviceLink that probes use."""

    def __init__(self) -> None:
        self.connected = True
        self.canned: dict[str, list[int]] = {}  # by command; the last answer repeats
        self.probes: list[str] = []  # the commands of the exec probes, as they start
        self.restarts: list[str] = []  # restart scripts
        self.shells: list[asyncio.subprocess.Process] = []

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed:
        if not self.connected:
            raise Unreachable("the device is down")
        if script.startswith("# vkubelet: restart container"):
            self.restarts.append(script)
            return Completed(0, b"", b"")
        words = shlex.split(script.splitlines()[0])
        command = words[words.index("vkubelet-exec") + 1 : -2]  # ... </dev/null &
        self.probes.append(command[0])
        answers = self.canned.get(command[0])
        if answers is None:
            return await self._sh(script)
        code = answers.pop(0) if len(answers) > 1 else answers[0]
        if code == HANG:
            await asyncio.sleep(3600)
        return Completed(code, b"", b"")

    async def _sh(self, script: str) -> Completed:
        proc = await asyncio.create_subprocess_exec(
            "sh",
            "-s",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.shells.append(proc)
        # Like an SSH channel, the process does not end because its caller gave up on it.
        out, err = await asyncio.shield(proc.communicate(script.encode()))
        assert proc.returncode is not None
        return Completed(proc.returncode, out, err)

    async def open_connection(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if not self.connected:
            raise Unreachable("the device is down")
        return await asyncio.open_connection(host, port)

    async def aclose(self) -> None:
        for proc in self.shells:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


class Harness:
    def __init__(self, link: FakeLink, root: Path) -> None:
        self.link = link
        self.root = root
        self.ready: dict[str, bool] = {}
        self.changes: list[tuple[int, bool | None]] = []  # (exec probes so far, ready)
        self.prober = Prober(link, str(root), UID, self.ready, self._changed, second=SECOND)

    def _changed(self) -> None:
        self.changes.append((len(self.link.probes), self.ready.get("main")))

    def sync(self, pod: Pod, state: State = "running", restarts: int = 0) -> None:
        self.prober.sync(pod, remote(state, restarts))


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    # The container's env file, as start_pod_script writes it: into its working directory.
    (tmp_path / "pods" / UID / "env").mkdir(parents=True)
    (tmp_path / "pods" / UID / "fs").mkdir()
    env = f"cd {shlex.quote(str(tmp_path / 'pods' / UID / 'fs'))}\n"
    (tmp_path / "pods" / UID / "env" / "main").write_text(env)
    link = FakeLink()
    harness = Harness(link, tmp_path)
    yield harness
    harness.prober.stop()
    await link.aclose()


def exec_probe(command: str, **settings: Any) -> Probe:
    return Probe(exec=ExecAction(command=shlex.split(command)), periodSeconds=1, **settings)


def make_pod(
    *,
    grace: int | None = 5,
    ports: list[ContainerPort] | None = None,
    startup: Probe | None = None,
    readiness: Probe | None = None,
    liveness: Probe | None = None,
) -> Pod:
    container = Container(
        name="main",
        image="host",
        command=["app"],
        ports=ports,
        startupProbe=startup,
        readinessProbe=readiness,
        livenessProbe=liveness,
    )
    return Pod(
        metadata=ObjectMeta(name="p", namespace="ns", uid=UID),
        spec=PodSpec(containers=[container], terminationGracePeriodSeconds=grace),
    )


def remote(state: State, restarts: int = 0, *, stopping: bool = False) -> RemotePod:
    started = STARTED.replace(minute=restarts)
    status = ContainerStatus("main", state, "", 42, started, None, None, restarts)
    return RemotePod(UID, True, stopping, b"{}", [], [status])


async def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def periods(n: int) -> None:
    await asyncio.sleep(n * SECOND)


# -- thresholds ---------------------------------------------------------------------------------
async def test_readiness_turns_true_and_false_only_after_consecutive_results(
    harness: Harness,
) -> None:
    harness.link.canned["check"] = [1, 0, 0, 1, 0, 1, 1]
    pod = make_pod(readiness=exec_probe("check", successThreshold=2, failureThreshold=2))
    harness.sync(pod)
    assert harness.ready == {"main": False}  # not ready before a probe said so
    await eventually(lambda: len(harness.link.probes) >= 10)
    # A success, then the second in a row; a failure, a success (no change), two failures.
    assert harness.changes == [(3, True), (7, False)]


async def test_liveness_restarts_the_container_once_after_failure_threshold_failures(
    harness: Harness,
) -> None:
    harness.link.canned["alive"] = [0, 1, 0, 1, 1]
    harness.sync(make_pod(grace=5, liveness=exec_probe("alive", failureThreshold=2)))
    await eventually(lambda: bool(harness.link.restarts))
    assert len(harness.link.probes) == 5
    await periods(5)  # the run is over: no more probes, no second restart
    assert len(harness.link.probes) == 5
    [script] = harness.link.restarts
    assert "vkubelet-killer 5 " in script  # the pod's grace period
    assert harness.changes == []  # liveness says nothing about readiness


async def test_a_probe_s_own_grace_period_overrides_the_pod_s(harness: Harness) -> None:
    harness.link.canned["alive"] = [1]
    probe = exec_probe("alive", failureThreshold=1, terminationGracePeriodSeconds=7)
    harness.sync(make_pod(grace=30, liveness=probe))
    await eventually(lambda: bool(harness.link.restarts))
    assert "vkubelet-killer 7 " in harness.link.restarts[0]


async def test_the_initial_delay_holds_the_first_probe_back(harness: Harness) -> None:
    harness.link.canned["check"] = [0]
    started = time.monotonic()
    harness.sync(make_pod(readiness=exec_probe("check", initialDelaySeconds=6)))
    await eventually(lambda: harness.ready["main"])
    assert time.monotonic() - started >= 6 * SECOND
    assert harness.changes == [(1, True)]


# -- startup ------------------------------------------------------------------------------------
async def test_a_startup_probe_holds_liveness_and_readiness_back_until_it_succeeds(
    harness: Harness,
) -> None:
    harness.link.canned |= {"started": [1, 1, 0], "alive": [0], "check": [0]}
    pod = make_pod(
        startup=exec_probe("started", failureThreshold=5),
        liveness=exec_probe("alive"),
        readiness=exec_probe("check"),
    )
    harness.sync(pod)
    await eventually(lambda: harness.ready["main"])
    probes = harness.link.probes
    assert probes[:3] == ["started"] * 3
    await periods(4)
    assert probes.count("started") == 3  # done for this run
    assert {"alive", "check"} <= set(probes[3:])


async def test_without_a_readiness_probe_a_container_is_ready_once_started(
    harness: Harness,
) -> None:
    harness.link.canned["started"] = [1, 0]
    harness.sync(make_pod(startup=exec_probe("started")))
    assert harness.ready == {"main": False}
    await eventually(lambda: harness.ready["main"])
    assert harness.changes == [(2, True)]


async def test_a_startup_probe_that_keeps_failing_restarts_the_container(
    harness: Harness,
) -> None:
    harness.link.canned |= {"started": [1], "alive": [0]}
    pod = make_pod(startup=exec_probe("started", failureThreshold=3), liveness=exec_probe("alive"))
    harness.sync(pod)
    await eventually(lambda: bool(harness.link.restarts))
    await periods(3)
    assert harness.link.probes == ["started"] * 3
    assert len(harness.link.restarts) == 1
    assert harness.ready == {"main": False}


async def test_a_container_without_probes_is_ready_as_soon_as_it_runs(harness: Harness) -> None:
    harness.ready["main"] = False  # from an earlier run of a pod with probes, say
    harness.sync(make_pod())
    assert harness.ready == {}  # no entry: ready while running


# -- the device's link --------------------------------------------------------------------------
async def test_an_unreachable_device_neither_fails_nor_restarts_a_container(
    harness: Harness,
) -> None:
    harness.link.canned["alive"] = [1]
    harness.link.connected = False
    harness.sync(make_pod(liveness=exec_probe("alive", failureThreshold=2)))
    await periods(8)
    assert harness.link.restarts == []
    harness.link.connected = True  # the worker is still there, and now failures count
    await eventually(lambda: bool(harness.link.restarts))
    assert len(harness.link.probes) == 2


async def test_a_probe_timing_out_because_the_link_dropped_is_not_a_failure(
    harness: Harness,
) -> None:
    harness.link.canned["alive"] = [HANG]
    probe = exec_probe("alive", failureThreshold=1, timeoutSeconds=4)
    harness.sync(make_pod(liveness=probe))
    await eventually(lambda: bool(harness.link.probes))
    harness.link.connected = False  # while the probe waits for its answer
    await periods(5)
    assert harness.link.restarts == []


async def test_a_probe_timing_out_on_a_working_link_is_a_failure(harness: Harness) -> None:
    harness.link.canned["alive"] = [HANG]
    harness.sync(make_pod(liveness=exec_probe("alive", failureThreshold=2)))
    await eventually(lambda: bool(harness.link.restarts))
    assert len(harness.link.probes) == 2


# -- runs ---------------------------------------------------------------------------------------
async def test_workers_stop_when_the_run_ends_and_start_over_for_the_next(
    harness: Harness,
) -> None:
    harness.link.canned["check"] = [0]
    pod = make_pod(readiness=exec_probe("check"))
    harness.sync(pod, restarts=0)
    await eventually(lambda: harness.ready["main"])
    harness.sync(pod, "terminated", restarts=0)
    await periods(1)
    count = len(harness.link.probes)
    await periods(4)
    assert len(harness.link.probes) == count
    harness.sync(pod, restarts=1)
    assert harness.ready == {"main": False}  # a new run is not ready before its probe says so
    await eventually(lambda: harness.ready["main"])


async def test_workers_stop_when_the_pod_is_stopping(harness: Harness) -> None:
    harness.link.canned["check"] = [0]
    pod = make_pod(readiness=exec_probe("check"))
    harness.sync(pod)
    await eventually(lambda: bool(harness.link.probes))
    harness.prober.sync(pod, remote("running", stopping=True))
    await periods(1)
    count = len(harness.link.probes)
    await periods(4)
    assert len(harness.link.probes) == count


# -- handlers -----------------------------------------------------------------------------------
async def test_an_exec_probe_runs_in_the_container_s_directory(harness: Harness) -> None:
    harness.sync(make_pod(readiness=exec_probe("test -f ready")))
    await eventually(lambda: len(harness.link.probes) >= 3)
    assert harness.ready == {"main": False}
    (harness.root / "pods" / UID / "fs" / "ready").touch()
    await eventually(lambda: harness.ready["main"])


async def test_an_exec_probe_that_hangs_is_killed_on_the_device(harness: Harness) -> None:
    probe = exec_probe("sleep 30", failureThreshold=1)  # timeoutSeconds: 1, i.e. 50 ms here
    harness.sync(make_pod(liveness=probe))
    await eventually(lambda: bool(harness.link.restarts))  # it timed out here...
    [shell] = harness.link.shells
    code = await asyncio.wait_for(shell.wait(), 3)  # ...and is killed there after a second
    assert code == 128 + signal.SIGKILL


@contextlib.asynccontextmanager
async def http_server(requests: list[bytes]) -> AsyncIterator[int]:
    """A server answering with the status code its request's path names."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        requests.append(request)
        code = request.split(b" ")[1].strip(b"/").decode()
        if not code.isdigit():  # no answer at all
            writer.close()
            return
        writer.write(f"HTTP/1.1 {code} Whatever\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def closed_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


@pytest.mark.parametrize(("code", "ready"), [(200, True), (302, True), (404, False), (500, False)])
async def test_an_http_probe_succeeds_on_a_2xx_or_3xx_status(
    harness: Harness, code: int, ready: bool
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = Probe(
            httpGet=HTTPGetAction(port="web", path=str(code), httpHeaders=[HTTPHeader("X-A", "b")]),
            periodSeconds=1,
            failureThreshold=1,
        )
        harness.sync(make_pod(ports=[ContainerPort(port, name="web")], readiness=probe))
        await eventually(lambda: len(requests) >= 3)
        assert harness.ready == {"main": ready}
    head = requests[0].decode().split("\r\n")
    assert head[0] == f"GET /{code} HTTP/1.1"
    assert {"X-A: b", f"Host: 127.0.0.1:{port}", "User-Agent: kube-probe/vkubelet"} <= set(head)


async def test_an_http_probe_fails_on_a_connection_closed_without_an_answer(
    harness: Harness,
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = Probe(httpGet=HTTPGetAction(port=port, path="/silence"), failureThreshold=1)
        harness.sync(make_pod(liveness=probe))
        await eventually(lambda: bool(harness.link.restarts))
    assert len(requests) == 1


async def test_an_http_probe_to_a_closed_port_fails(harness: Harness) -> None:
    probe = Probe(httpGet=HTTPGetAction(port=await closed_port()), failureThreshold=1)
    harness.sync(make_pod(liveness=probe))
    await eventually(lambda: bool(harness.link.restarts))


async def test_an_https_probe_fails_saying_it_is_not_supported(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vkubelet.providers.ssh._probes")
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = Probe(httpGet=HTTPGetAction(port=port, scheme="HTTPS"), failureThreshold=1)
        harness.sync(make_pod(liveness=probe))
        await eventually(lambda: bool(harness.link.restarts))
    assert requests == []
    assert "HTTPS probes are not supported" in caplog.text


async def test_a_tcp_probe_succeeds_when_the_port_accepts_a_connection(
    harness: Harness,
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = Probe(tcpSocket=TCPSocketAction(port=str(port)), periodSeconds=1)
        harness.sync(make_pod(readiness=probe))
        await eventually(lambda: harness.ready["main"])


async def test_a_tcp_probe_to_a_closed_port_fails(harness: Harness) -> None:
    probe = Probe(tcpSocket=TCPSocketAction(port=await closed_port()), failureThreshold=1)
    harness.sync(make_pod(liveness=probe))
    await eventually(lambda: bool(harness.link.restarts))


async def test_a_probe_on_an_unknown_port_name_never_runs(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe(tcpSocket=TCPSocketAction(port="nope"), periodSeconds=1, failureThreshold=1)
    harness.sync(make_pod(readiness=probe, liveness=probe))
    await periods(3)
    assert harness.link.restarts == []
    assert harness.ready == {"main": False}
    assert "has no port named 'nope'" in caplog.text
