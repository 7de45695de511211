"""DaemonSet pods are refused on a virtual node (a clear, permanent reason, so the pod ends
Failed, never stuck), unless the pod's annotation or the config asks for them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.cluster import ClusterProvider
from vkubelet.sdk import ProviderError, ResolvedPod

from .fakes import resolved, scripted


def daemon_pod(**annotations: str) -> ResolvedPod:
    raw: dict[str, Any] = msgspec.to_builtins(resolved().pod)
    raw["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": "agent",
            "uid": "d1",
            "controller": True,
        }
    ]
    raw["metadata"]["annotations"] = {**(raw["metadata"].get("annotations") or {}), **annotations}
    return ResolvedPod(msgspec.convert(raw, Pod))


async def refusal(provider: ClusterProvider, pod: ResolvedPod) -> ProviderError:
    try:
        with pytest.raises(ProviderError) as raised:
            await provider.create_pod(pod)
        return raised.value
    finally:
        await provider.aclose()


def test_a_daemonset_pod_is_refused_for_good_with_a_reason_saying_how_to_opt_in(
    tmp_path: Path,
) -> None:
    writes: list[Any] = []
    error = asyncio.run(refusal(scripted(tmp_path, None, writes), daemon_pod()))
    assert (error.reason, error.permanent) == ("DaemonSetPodRefused", True)
    assert "vkubelet.io/run-on-virtual-node" in error.message
    assert writes == [], "nothing was written below"


def test_a_daemonset_pod_that_opts_in_goes_down_like_any_pod(tmp_path: Path) -> None:
    pod = daemon_pod(**{"vkubelet.io/run-on-virtual-node": "true"})
    error = asyncio.run(refusal(scripted(tmp_path, None, []), pod))
    assert error.reason == "LowerForbidden", "it reached the lower API (scripted to refuse)"
