"""The 50-line provider of docs/providers.md, tested the way the docs tell a provider author to:
with the in-memory apiserver and the agent's own pod controller (`vkubelet.testing.harness`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from vkubelet.sdk import ContainerLogOptions, ProviderContext
from vkubelet.testing.fakeapi import FakeApiServer
from vkubelet.testing.harness import PodHarness, eventually, pod_manifest

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_provider.py"
PY = sys.executable


def tiny() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_provider", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.create(ProviderContext("vk-test", None, "127.0.0.1", 10250))


def python(code: str) -> list[dict[str, Any]]:
    return [{"name": "main", "image": "-", "command": [PY, "-u", "-c", code]}]


async def stop_all(provider: Any) -> None:
    """The agent would delete them; a test ends its processes before its event loop closes."""
    await provider.aclose()


async def logs(provider: Any, name: str, **options: Any) -> bytes:
    chunks = provider.container_logs("default", name, "main", ContainerLogOptions(**options))
    return b"".join([chunk async for chunk in chunks])


async def test_a_pod_that_exits_zero_under_never_succeeds_with_its_output_in_the_logs() -> None:
    provider = tiny()
    async with PodHarness(FakeApiServer(), provider) as harness:
        harness.create_pod(
            pod_manifest("job", containers=python("print('done')"), restart_policy="Never")
        )
        await eventually(lambda: harness.phase("job") == "Succeeded", within=15)
        [state] = harness.status("job")["containerStatuses"]
        assert state["state"]["terminated"]["exitCode"] == 0
        assert await logs(provider, "job") == b"done\n"
        await stop_all(provider)


async def test_a_failing_container_under_on_failure_restarts_and_keeps_its_last_run() -> None:
    provider = tiny()
    code = "import os,sys; print('run'); sys.exit(3)"
    async with PodHarness(FakeApiServer(), provider) as harness:
        harness.create_pod(
            pod_manifest("crash", containers=python(code), restart_policy="OnFailure")
        )

        def restarted() -> dict[str, Any] | None:
            statuses = harness.status("crash").get("containerStatuses") or []
            return statuses[0] if statuses and statuses[0]["restartCount"] >= 1 else None

        state = await eventually(restarted, within=15)
        assert state is not None
        assert state["lastState"]["terminated"]["exitCode"] == 3
        assert harness.phase("crash") == "Running"  # OnFailure: a failed container restarts
        assert await logs(provider, "crash", previous=True) == b"run\n"
        await stop_all(provider)


async def test_deleting_a_pod_stops_its_process_within_the_grace_period() -> None:
    provider = tiny()
    async with PodHarness(FakeApiServer(), provider) as harness:
        harness.create_pod(pod_manifest("web", containers=python("import time; time.sleep(600)")))
        await eventually(lambda: harness.phase("web") == "Running", within=15)
        harness.delete_pod("web", grace=5)
        await eventually(lambda: harness.api.get("pods", "web", "default") is None, within=10)
        await eventually(lambda: not provider.runners, within=5)
