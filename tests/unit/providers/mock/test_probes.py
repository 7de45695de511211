"""The mock provider's probes, on the shared engine: exec probes run in the container's in-memory
shell, network probes reach 127.0.0.1; readiness shows in the pod's status, a failed liveness
probe restarts the container. A probe second lasts 50 ms here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.mock import MockConfig, MockProvider
from vkubelet.sdk import ProviderError, ResolvedPod
from vkubelet.testing.harness import always, eventually

from .helpers import Input, stdio

pytestmark = pytest.mark.timeout(30)

NS, NAME, UID = "default", "web", "uid-web"


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def pod_event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        self.seen.append((type, reason, message))

    def node_event(self, node_name: str, type: str, reason: str, message: str) -> None:
        pass


@pytest.fixture
async def events() -> Events:
    return Events()


@pytest.fixture
async def mock(events: Events, tmp_path: Path) -> AsyncIterator[MockProvider]:
    provider = MockProvider("n1", MockConfig(state_file=tmp_path / "state.json"), events=events)
    provider.probe_second = 0.05
    reports: list[Pod] = []
    provider.notify_pods(reports.append)
    yield provider
    await provider.aclose()


def pod(**container: Any) -> ResolvedPod:
    spec = {"name": "app", "image": "busybox", **container}
    raw = {"metadata": {"namespace": NS, "name": NAME, "uid": UID}, "spec": {"containers": [spec]}}
    return ResolvedPod(msgspec.convert(raw, Pod))


async def app_status(mock: MockProvider) -> Any:
    status = await mock.get_pod_status(NS, NAME)
    assert status is not None and status.containerStatuses
    return status.containerStatuses[0]


async def sh(mock: MockProvider, script: str) -> int:
    io_, _, _ = stdio(Input(closed=True))
    return await mock.exec_in_container(NS, NAME, "app", ["sh", "-c", script], io_)


async def test_a_mock_pod_is_ready_when_its_exec_readiness_probe_succeeds(
    mock: MockProvider,
) -> None:
    probe = {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1}
    await mock.create_pod(pod(readinessProbe=probe))
    assert not (await app_status(mock)).ready
    await asyncio.sleep(0.3)  # a few probes fail
    assert not (await app_status(mock)).ready
    status = await mock.get_pod_status(NS, NAME)
    assert status is not None and status.conditions
    assert {c.type: c.status for c in status.conditions}["Ready"] == "False"
    assert await sh(mock, "mkdir -p /tmp && echo > /tmp/ready") == 0
    await eventually(lambda: _ready(mock))
    assert await sh(mock, "rm /tmp/ready") == 0
    await eventually(lambda: _unready(mock))


async def _ready(mock: MockProvider) -> bool:
    return bool((await app_status(mock)).ready)


async def _unready(mock: MockProvider) -> bool:
    return not (await app_status(mock)).ready


async def test_the_ready_condition_moves_when_the_probe_verdict_does_not_at_each_poll(
    mock: MockProvider,
) -> None:
    probe = {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1}
    await mock.create_pod(pod(readinessProbe=probe))
    assert await sh(mock, "mkdir -p /tmp && echo > /tmp/ready") == 0
    await eventually(lambda: _ready(mock))
    became_ready = await _ready_condition(mock)
    assert became_ready.status == "True"
    await asyncio.sleep(1.5)  # the API's times are whole seconds: a poll-dated one would move
    assert await _ready_condition(mock) == became_ready


async def _ready_condition(mock: MockProvider) -> Any:
    status = await mock.get_pod_status(NS, NAME)
    assert status is not None and status.conditions
    return {c.type: c for c in status.conditions}["Ready"]


async def test_a_failed_liveness_probe_restarts_a_mock_container(
    mock: MockProvider, events: Events
) -> None:
    probe = {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}
    await mock.create_pod(pod(livenessProbe=probe))

    async def restarted() -> bool:
        return bool((await app_status(mock)).restartCount >= 1)

    await eventually(restarted)
    status = await app_status(mock)
    assert status.lastState.terminated.exitCode == 137
    assert ("Warning", "Unhealthy", "Liveness probe failed: ") in events.seen
    assert ("Normal", "Killing", "Container app failed liveness probe, will be restarted") in (
        events.seen
    )


async def test_a_tcp_readiness_probe_reaches_a_port_on_this_machine(mock: MockProvider) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        probe = {"tcpSocket": {"port": "web"}, "periodSeconds": 1}
        await mock.create_pod(
            pod(readinessProbe=probe, ports=[{"name": "web", "containerPort": port}])
        )
        await eventually(lambda: _ready(mock))


async def test_probes_of_a_mock_pod_run_again_after_a_restart_of_the_agent(
    mock: MockProvider, events: Events, tmp_path: Path
) -> None:
    probe = {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1}
    await mock.create_pod(pod(readinessProbe=probe))
    await asyncio.sleep(0.3)  # the state file is written
    again = MockProvider("n1", MockConfig(state_file=tmp_path / "state.json"), events=events)
    again.probe_second = 0.05
    try:
        [listed] = await again.list_pods()
        assert listed.spec is not None and listed.spec.containers[0].readinessProbe is not None
        await asyncio.sleep(0.3)
        assert not (await app_status(again)).ready  # its readiness probe runs, and fails
    finally:
        await again.aclose()


class StuckTokens:
    """A `PodTokens` whose apiserver never answers."""

    def __init__(self) -> None:
        self.asked = 0

    async def token_files(self, namespace: str, name: str, uid: str) -> Any:
        self.asked += 1
        await asyncio.Event().wait()


async def test_exec_probes_do_not_wait_for_a_token_the_apiserver_is_slow_to_give(
    mock: MockProvider,
) -> None:
    tokens = StuckTokens()
    mock.use_tokens(tokens)
    probe = {"exec": {"command": ["true"]}, "periodSeconds": 1, "timeoutSeconds": 1}
    await mock.create_pod(pod(readinessProbe=probe, livenessProbe=probe))
    await eventually(lambda: _ready(mock))
    assert tokens.asked == 1  # one fetch under way, shared, not one per probe
    assert (await app_status(mock)).restartCount == 0


class FailingTokens:
    """A `PodTokens` whose apiserver refuses every TokenRequest."""

    def __init__(self) -> None:
        self.asked = 0

    async def token_files(self, namespace: str, name: str, uid: str) -> Any:
        self.asked += 1
        raise ProviderError("FailedMount", "cannot get a token: the apiserver said 503")


async def test_probes_back_off_from_a_failing_token_request_and_an_exec_still_asks(
    mock: MockProvider,
) -> None:
    tokens = FailingTokens()
    mock.use_tokens(tokens)
    probe = {"exec": {"command": ["true"]}, "periodSeconds": 1, "timeoutSeconds": 1}
    await mock.create_pod(pod(readinessProbe=probe))
    await eventually(lambda: _ready(mock))
    # Twenty probe runs in a second: with a back-off doubling from 1 s, two requests at most.
    await always(lambda: tokens.asked <= 2, duration=1.0, what="no TokenRequest per probe run")
    asked = tokens.asked
    assert await sh(mock, "true") == 0  # an exec does not wait out the back-off: it asks
    assert tokens.asked == asked + 1


async def test_an_exec_waiting_for_tokens_ends_with_the_pod_and_leaves_nothing_behind(
    mock: MockProvider,
) -> None:
    mock.use_tokens(StuckTokens())
    await mock.create_pod(pod())
    session = asyncio.create_task(sh(mock, "sleep 100"))
    await eventually(lambda: _fetching(mock))
    found = await mock.get_pod(NS, NAME)
    assert found is not None
    await mock.delete_pod(found, 0)
    with pytest.raises(ProviderError, match="not running"):
        await asyncio.wait_for(session, 5)
    assert (mock._filesystems, mock._stops, mock._token_fetches) == ({}, {}, {})


async def _fetching(mock: MockProvider) -> bool:
    return bool(mock._token_fetches)
