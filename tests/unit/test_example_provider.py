"""The documented example provider works through the provider API as the agent calls it."""

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Pod

from vkubelet.node import PodLifecycleHandler, PodNotifier, ProviderContext, ResolvedPod

EXAMPLE = Path(__file__).parents[2] / "examples" / "local_provider.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("local_provider", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_provider"] = module
    spec.loader.exec_module(module)
    return module


def pod(name: str, command: list[str]) -> ResolvedPod:
    raw = {
        "metadata": {"namespace": "default", "name": name, "uid": f"uid-{name}"},
        "spec": {
            "nodeName": "n",
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
    await provider.create_pod(pod("fails", [sys.executable, "-c", "raise SystemExit(3)"]))
    assert seen[0]["phase"] == "Running"
    for _ in range(100):
        if seen[-1]["phase"] == "Failed":
            break
        await asyncio.sleep(0.05)
    terminated = seen[-1]["containerStatuses"][0]["state"]["terminated"]
    assert seen[-1]["phase"] == "Failed" and terminated["exitCode"] == 3


async def test_example_provider_stops_a_pod_within_its_grace_period() -> None:
    provider = load_example().create(ProviderContext("n", None, "127.0.0.1", 10250))
    provider.notify_pods(lambda _: None)
    resolved = pod("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    await provider.create_pod(resolved)
    started = asyncio.get_running_loop().time()
    await provider.delete_pod(resolved.pod, 5)
    assert asyncio.get_running_loop().time() - started < 5
    assert await provider.get_pod("default", "sleeper") is None
