"""The device's probe transport under the probe engine, without a device: the link runs the
scripts with the local sh (in the container's environment, as on a device), connects locally,
and can be switched off. A probe second lasts 50 ms here."""

from __future__ import annotations

import asyncio
import shlex
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.core_v1 import Container, ExecAction, PodSpec, Probe, TCPSocketAction
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.ssh._link import Completed
from vkubelet.providers.ssh._probes import DeviceProbes
from vkubelet.sdk.probes import PodProbes, ProbeEvent
from vkubelet.testing.harness import eventually

from .local_link import LocalLink

pytestmark = pytest.mark.timeout(30)

UID = "u1"
SECOND = 0.05


class RecordingLink(LocalLink):
    """Restart scripts are recorded, not run: there is no supervisor here."""

    def __init__(self, home: Path) -> None:
        super().__init__(home)
        self.restarts: list[str] = []

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed:
        if script.startswith("# vkubelet: restart container"):
            self.restarts.append(script)
            return Completed(0, b"", b"")
        return await super().run(script, deadline=deadline)

    @property
    def probes(self) -> list[str]:
        return [s for s in self.scripts if "vkubelet-exec" in s]


class Harness:
    def __init__(self, link: RecordingLink, root: Path) -> None:
        self.link = link
        self.root = root
        self.events: list[ProbeEvent] = []
        self.transport = DeviceProbes(link, str(root), UID)
        self.probes: PodProbes | None = None

    def start(self, pod: Pod) -> None:
        self.probes = PodProbes(
            pod, self.transport, self.transport.restart, on_event=self.events.append, second=SECOND
        )
        self.probes.sync({"main": 0})

    @property
    def ready(self) -> bool:
        assert self.probes is not None
        return self.probes.ready("main")


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    # The container's env file, as start_pod_script writes it: into its working directory.
    (tmp_path / "pods" / UID / "env").mkdir(parents=True)
    (tmp_path / "pods" / UID / "fs").mkdir()
    env = f"cd {shlex.quote(str(tmp_path / 'pods' / UID / 'fs'))}\n"
    (tmp_path / "pods" / UID / "env" / "main").write_text(env)
    home = tmp_path / "home"
    home.mkdir()
    link = RecordingLink(home)
    h = Harness(link, tmp_path)
    yield h
    if h.probes is not None:
        await h.probes.aclose()
    await link.aclose()


def exec_probe(command: str, **settings: Any) -> Probe:
    return Probe(exec=ExecAction(command=shlex.split(command)), periodSeconds=1, **settings)


def make_pod(**probes: Any) -> Pod:
    container = Container(name="main", image="host", command=["app"], **probes)
    return Pod(
        metadata=ObjectMeta(name="p", namespace="ns", uid=UID),
        spec=PodSpec(containers=[container], terminationGracePeriodSeconds=5),
    )


async def test_an_exec_probe_runs_in_the_container_s_directory(harness: Harness) -> None:
    harness.start(make_pod(readinessProbe=exec_probe("test -f ready")))
    await eventually(lambda: len(harness.link.probes) >= 3)
    assert not harness.ready
    (harness.root / "pods" / UID / "fs" / "ready").touch()
    await eventually(lambda: harness.ready)


async def test_an_exec_probe_s_output_is_the_event_s_message(harness: Harness) -> None:
    # 5 s to answer (a probe second is 50 ms here): a loaded machine starts a shell slowly.
    probe = exec_probe("sh -c 'echo not yet; exit 1'", timeoutSeconds=100)
    harness.start(make_pod(readinessProbe=probe))
    await eventually(lambda: bool(harness.events))
    assert harness.events[0].message == "Readiness probe failed: not yet\n"


async def test_an_exec_probe_that_hangs_is_killed_on_the_device(harness: Harness) -> None:
    probe = exec_probe("sleep 30", failureThreshold=1)  # timeoutSeconds: 1, i.e. 50 ms here
    harness.start(make_pod(livenessProbe=probe))
    await eventually(lambda: bool(harness.link.restarts))  # it timed out here...
    shell = harness.link._procs[0]
    # ...and killed there, a second later (10 s: a loaded machine is slow, the sleep lasts 30)
    code = await asyncio.wait_for(shell.wait(), 10)
    assert code == 128 + signal.SIGKILL


async def test_a_liveness_failure_restarts_the_container_with_the_grace_period(
    harness: Harness,
) -> None:
    probe = exec_probe("false", failureThreshold=2, terminationGracePeriodSeconds=7)
    harness.start(make_pod(livenessProbe=probe))
    await eventually(lambda: bool(harness.link.restarts))
    [script] = harness.link.restarts
    assert "restart container main of pod u1" in script
    assert "vkubelet-killer 7 " in script


async def test_an_unreachable_device_neither_fails_nor_restarts_a_container(
    harness: Harness,
) -> None:
    harness.link.connected = False
    harness.start(make_pod(livenessProbe=exec_probe("false", failureThreshold=2)))
    await asyncio.sleep(8 * SECOND)
    assert harness.link.restarts == []
    assert harness.events == []
    harness.link.connected = True  # the worker is still there, and now failures count
    await eventually(lambda: bool(harness.link.restarts))


async def test_a_probe_timing_out_because_the_link_dropped_is_not_a_failure(
    harness: Harness,
) -> None:
    probe = exec_probe("sleep 30", failureThreshold=1, timeoutSeconds=4)
    harness.start(make_pod(livenessProbe=probe))
    await eventually(lambda: bool(harness.link.probes))
    harness.link.connected = False  # while the probe waits for its answer
    await asyncio.sleep(6 * SECOND)
    assert harness.link.restarts == []


async def test_a_tcp_probe_connects_from_the_device(harness: Harness) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        harness.start(make_pod(readinessProbe=Probe(tcpSocket=TCPSocketAction(port=port))))
        await eventually(lambda: harness.ready)
