"""PodRunner: the kubelet's pod worker for providers that run containers themselves."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import Container
from lightkube.resources.core_v1 import Pod

from vkubelet.sdk import PodRunner
from vkubelet.sdk.probes import ExecResult, ProbeReader, ProbeWriter
from vkubelet.testing.harness import eventually


def pod(containers: list[dict[str, Any]], inits: Sequence[dict[str, Any]] = (), **spec: Any) -> Pod:
    raw = {
        "metadata": {"namespace": "ns", "name": "p", "uid": "u1"},
        "spec": {"containers": containers, "initContainers": list(inits), **spec},
    }
    return msgspec.convert(raw, Pod)


class Fake:
    """Containers that run until signalled, or exit with a scripted code at once."""

    def __init__(self, exits: dict[str, int] | None = None) -> None:
        self.exits = exits or {}
        self.started: list[tuple[str, int]] = []
        self.signals: list[tuple[str, int]] = []
        self.ending: dict[str, asyncio.Future[int]] = {}
        self.ignore_term = False

    async def run(self, c: Container, count: int) -> int:
        self.started.append((c.name, count))
        if c.name in self.exits:
            return self.exits[c.name]
        self.ending[c.name] = asyncio.get_running_loop().create_future()
        return await self.ending[c.name]

    def signal(self, name: str, signum: int) -> None:
        self.signals.append((name, signum))
        if signum == signal.SIGKILL or not self.ignore_term:
            self.ending[name].set_result(-signum)


async def test_init_containers_run_in_order_then_the_containers_together() -> None:
    fake = Fake(exits={"i1": 0, "i2": 0})
    runner = PodRunner(
        pod([{"name": "a"}, {"name": "b"}], [{"name": "i1"}, {"name": "i2"}]),
        fake.run,
        fake.signal,
        host_ip="10.0.0.1",
    )
    runner.start()
    await eventually(lambda: runner.running("a") and runner.running("b"))
    assert [name for name, _ in fake.started] == ["i1", "i2", "a", "b"]
    assert runner.status().phase == "Running"
    await runner.stop(5)


async def test_a_failed_init_container_under_never_fails_the_pod_without_starting_the_rest() -> (
    None
):
    fake = Fake(exits={"init": 2})
    runner = PodRunner(
        pod([{"name": "a"}], [{"name": "init"}], restartPolicy="Never"),
        fake.run,
        fake.signal,
        host_ip="10.0.0.1",
    )
    runner.start()
    await eventually(lambda: runner.status().phase == "Failed")
    assert [name for name, _ in fake.started] == ["init"]


async def test_stop_terms_then_kills_a_container_that_outlives_the_grace_period() -> None:
    fake = Fake()
    fake.ignore_term = True
    runner = PodRunner(pod([{"name": "a"}]), fake.run, fake.signal, host_ip="10.0.0.1")
    runner.start()
    await eventually(lambda: runner.running("a"))
    await runner.stop(1)
    assert fake.signals == [("a", signal.SIGTERM), ("a", signal.SIGKILL)]
    [state] = runner.status().containerStatuses or []
    assert state.state is not None and state.state.terminated is not None
    assert state.state.terminated.exitCode == 128 + signal.SIGKILL


async def test_a_container_that_cannot_start_is_a_start_error_and_restarts_by_policy() -> None:
    async def run(c: Container, count: int) -> int:
        raise FileNotFoundError("no such command")

    runner = PodRunner(
        pod([{"name": "a"}], restartPolicy="Never"), run, lambda *_: None, host_ip="h"
    )
    runner.start()
    await eventually(lambda: runner.status().phase == "Failed")
    [state] = runner.status().containerStatuses or []
    assert state.state is not None and state.state.terminated is not None
    assert state.state.terminated.exitCode == 128


class FailingExec:
    """A probe transport whose exec probes always fail."""

    def available(self) -> bool:
        return True

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        return ExecResult(1, b"unhealthy")

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]:
        raise OSError("no network here")


async def test_a_failing_liveness_probe_ends_the_run_and_the_restart_policy_restarts_it() -> None:
    fake = Fake()
    probe = {"exec": {"command": ["check"]}, "periodSeconds": 1, "failureThreshold": 1}
    events: list[str] = []
    runner = PodRunner(
        pod([{"name": "a", "livenessProbe": probe}], terminationGracePeriodSeconds=1),
        fake.run,
        fake.signal,
        host_ip="10.0.0.1",
        probe_transport=FailingExec(),
        on_event=lambda e: events.append(e.reason),
    )
    runner.start()
    runner.status()  # the provider publishes a status: the probes start with the run
    await eventually(lambda: runner.restart_count("a") >= 1 and runner.status(), within=30)
    assert ("a", signal.SIGTERM) in fake.signals
    assert "Unhealthy" in events
    [state] = runner.status().containerStatuses or []
    assert state.lastState is not None and state.lastState.terminated is not None
    await runner.stop(1)


async def test_a_sidecar_init_container_keeps_running_beside_the_containers() -> None:
    fake = Fake(exits={"setup": 0})
    inits = [{"name": "setup"}, {"name": "proxy", "restartPolicy": "Always"}]
    runner = PodRunner(pod([{"name": "app"}], inits), fake.run, fake.signal, host_ip="10.0.0.1")
    runner.start()
    await eventually(lambda: runner.running("app"))
    assert [name for name, _ in fake.started] == ["setup", "proxy", "app"]
    assert runner.running("proxy")
    assert runner.status().phase == "Running"
    await runner.stop(5)
    assert not runner.running("proxy")


async def test_a_run_that_was_starting_when_the_pod_was_stopped_still_gets_its_sigterm() -> None:
    fake = Fake()
    starting = asyncio.Event()

    async def slow_start(c: Container, count: int) -> int:
        starting.set()
        await asyncio.sleep(0.3)  # the process does not exist yet when stop() comes
        return await fake.run(c, count)

    def signal_container(name: str, signum: int) -> None:
        if name not in fake.ending:
            raise ProcessLookupError(name)
        fake.signal(name, signum)

    runner = PodRunner(pod([{"name": "a"}]), slow_start, signal_container, host_ip="h")
    runner.start()
    await starting.wait()
    await runner.stop(30)  # returns once the late-born process got its SIGTERM and ended
    assert fake.signals == [("a", signal.SIGTERM)]


class CountingExec(FailingExec):
    """A probe transport whose exec probes succeed, counted."""

    def __init__(self) -> None:
        self.calls = 0

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        self.calls += 1
        return ExecResult(0, b"")


async def test_a_run_that_confirms_its_start_is_container_creating_and_unprobed_until_then() -> (
    None
):
    fake, transport = Fake(), CountingExec()
    probe = {"exec": {"command": ["check"]}, "periodSeconds": 1}
    runner = PodRunner(
        pod([{"name": "a", "readinessProbe": probe}]),
        fake.run,
        fake.signal,
        host_ip="h",
        probe_transport=transport,
        confirms_start=True,
    )
    runner.start()
    await eventually(lambda: ("a", 0) in fake.started)
    for _ in range(3):  # over a window in which a probe (run at once when up) would have run
        [state] = runner.status().containerStatuses or []
        assert state.state is not None and state.state.waiting is not None
        assert state.state.waiting.reason == "ContainerCreating" and not state.ready
        assert runner.status().phase == "Pending" and transport.calls == 0
        await asyncio.sleep(0.2)
    up_since = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    runner.confirm_start("a", 0, up_since)
    await eventually(lambda: transport.calls > 0 and bool(runner.status().containerStatuses))
    [state] = runner.status().containerStatuses or []
    assert state.state is not None and state.state.running is not None
    assert state.state.running.startedAt == up_since
    await eventually(lambda: (runner.status().containerStatuses or [])[0].ready is True)
    await runner.stop(5)


async def test_a_run_not_yet_confirmed_is_still_signalled_on_stop() -> None:
    fake = Fake()
    runner = PodRunner(
        pod([{"name": "a"}]), fake.run, fake.signal, host_ip="h", confirms_start=True
    )
    runner.start()
    await eventually(lambda: ("a", 0) in fake.started)
    await runner.stop(5)
    assert fake.signals == [("a", signal.SIGTERM)]


async def test_a_start_time_given_is_the_pod_s_start_time() -> None:
    fake = Fake()
    since = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    runner = PodRunner(pod([{"name": "a"}]), fake.run, fake.signal, host_ip="h", start_time=since)
    runner.start()
    await eventually(lambda: runner.running("a"))
    assert runner.status().startTime == since
    await runner.stop(5)


async def test_provider_conditions_appear_in_the_status_and_keep_their_transition_time() -> None:
    fake = Fake()
    runner = PodRunner(pod([{"name": "a"}]), fake.run, fake.signal, host_ip="10.0.0.1")
    runner.start()
    await eventually(lambda: runner.running("a"))
    runner.set_condition("example.com/Moving", "True", "Running", '{"progress": 10}')
    first = {c.type: c for c in runner.status().conditions or []}["example.com/Moving"]
    await asyncio.sleep(1.1)  # transition times have a one-second resolution
    runner.set_condition("example.com/Moving", "True", "Running", '{"progress": 50}')
    second = {c.type: c for c in runner.status().conditions or []}["example.com/Moving"]
    assert (second.reason, second.message) == ("Running", '{"progress": 50}')
    assert second.lastTransitionTime == first.lastTransitionTime
    assert {"PodScheduled", "Ready"} <= {c.type for c in runner.status().conditions or []}
    fake.ending["a"].set_result(0)


async def test_finish_ends_the_pod_with_its_run_under_always_and_its_own_reason() -> None:
    from vkubelet.sdk import Terminated

    ending: asyncio.Future[Terminated] = asyncio.get_running_loop().create_future()
    runs: list[int] = []
    signals: list[int] = []

    async def run(c: Container, count: int) -> Terminated:
        runs.append(count)
        return await ending

    runner = PodRunner(
        pod([{"name": "a"}], restartPolicy="Always"),
        run,
        lambda name, signum: signals.append(signum),
        host_ip="10.0.0.1",
    )
    runner.start()
    await eventually(lambda: runner.running("a"))
    runner.finish()
    ending.set_result(Terminated(0, reason="Migrated", message="{}"))
    await eventually(lambda: runner.status().phase == "Succeeded")
    terminated = (runner.status().containerStatuses or [])[0].state.terminated  # type: ignore[union-attr]
    assert terminated is not None and terminated.reason == "Migrated"
    await asyncio.sleep(0.2)
    assert runs == [0] and signals == []  # not restarted, nothing signalled
