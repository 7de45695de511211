"""The documented example provider works through the provider API as the agent calls it."""

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Pod

from vkubelet.sdk import (
    AttachIO,
    ContainerLogOptions,
    PodLifecycleHandler,
    PodNotifier,
    ProviderContext,
    ResolvedPod,
)
from vkubelet.testing.harness import eventually

EXAMPLE = Path(__file__).parents[2] / "examples" / "local_provider.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("local_provider", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_provider"] = module
    spec.loader.exec_module(module)
    return module


def pod(name: str, command: list[str], policy: str = "Always") -> ResolvedPod:
    raw = {
        "metadata": {"namespace": "default", "name": name, "uid": f"uid-{name}"},
        "spec": {
            "nodeName": "n",
            "restartPolicy": policy,
            "containers": [
                {
                    "name": "c",
                    "image": "-",
                    "command": command,
                    "env": [{"name": "X", "value": "1"}],
                }
            ],
        },
    }
    return ResolvedPod(msgspec.convert(raw, Pod))


async def test_example_provider_reports_running_then_the_exit_code() -> None:
    provider = load_example().create(ProviderContext("n", None, "127.0.0.1", 10250))
    assert isinstance(provider, PodLifecycleHandler) and isinstance(provider, PodNotifier)
    seen: list[dict[str, Any]] = []
    provider.notify_pods(lambda p: seen.append(msgspec.to_builtins(p)["status"]))
    code = "import time; time.sleep(0.3); raise SystemExit(3)"
    await provider.create_pod(pod("fails", [sys.executable, "-c", code], "Never"))
    await eventually(lambda: seen[-1]["phase"] == "Failed", within=10)
    assert "Running" in [s["phase"] for s in seen]
    terminated = seen[-1]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"


async def test_example_provider_restarts_a_failed_container_and_keeps_its_logs() -> None:
    provider = load_example().create(ProviderContext("n", None, "127.0.0.1", 10250))
    seen: list[dict[str, Any]] = []
    provider.notify_pods(lambda p: seen.append(msgspec.to_builtins(p)["status"]))
    code = "print('run', flush=True); raise SystemExit(1)"
    resolved = pod("crashes", [sys.executable, "-c", code], "OnFailure")
    await provider.create_pod(resolved)
    await eventually(lambda: seen[-1]["containerStatuses"][0]["restartCount"] >= 1, within=10)
    await eventually(lambda: "waiting" in seen[-1]["containerStatuses"][0]["state"], within=10)
    status = seen[-1]["containerStatuses"][0]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["state"]["waiting"]["message"].startswith("back-off 10s restarting failed")
    assert status["lastState"]["terminated"]["exitCode"] == 1 and seen[-1]["phase"] == "Running"
    previous = provider.container_logs(
        "default", "crashes", "c", ContainerLogOptions(previous=True)
    )
    assert b"".join([chunk async for chunk in previous]) == b"run\n"
    await provider.delete_pod(resolved.pod, 1)  # returns at once; the stop is reported
    await eventually(lambda: "terminated" in seen[-1]["containerStatuses"][0]["state"], within=10)


async def test_example_provider_execs_in_the_container_s_environment() -> None:
    provider = load_example().create(ProviderContext("n", None, "127.0.0.1", 10250))
    provider.notify_pods(lambda _: None)
    resolved = pod("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    await provider.create_pod(resolved)

    class Out:
        data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    out = Out()
    command = [sys.executable, "-c", "import os; print(os.environ['X'])"]
    io = AttachIO(None, out, Out())
    assert await provider.exec_in_container("default", "sleeper", "c", command, io) == 0
    assert out.data == b"1\n"
    await provider.aclose()  # stops its pods: processes a restarted agent could not adopt


async def test_example_provider_stops_a_pod_within_its_grace_period() -> None:
    provider = load_example().create(ProviderContext("n", None, "127.0.0.1", 10250))
    provider.notify_pods(lambda _: None)
    resolved = pod("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    await provider.create_pod(resolved)
    started = asyncio.get_running_loop().time()
    await provider.delete_pod(resolved.pod, 5)
    await eventually(lambda: not provider.runners, within=10)
    assert asyncio.get_running_loop().time() - started < 5
    assert await provider.get_pod("default", "sleeper") is None
