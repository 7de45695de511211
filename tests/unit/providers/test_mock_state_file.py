"""The mock's state file behaves as a real backend's disk: what a lifecycle call did is there
when the call returns, so an agent killed at any moment loses nothing it was told."""

from __future__ import annotations

import json
from pathlib import Path

from vkubelet.providers.mock import MockConfig, MockProvider

from .helpers import NS, POD, UID, resolved


def stored(state: Path) -> list[dict[str, object]]:
    pods: list[dict[str, object]] = json.loads(state.read_text())["pods"]
    return pods


async def test_lifecycle_calls_return_only_once_the_state_file_holds_their_change(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    mock = MockProvider("n1", MockConfig(state_file=state))
    await mock.create_pod(resolved())
    assert [p["uid"] for p in stored(state)] == [UID]
    pod = await mock.get_pod(NS, POD)
    assert pod is not None
    await mock.delete_pod(pod, 0)
    assert stored(state) == []


async def test_a_pod_created_again_with_the_same_uid_is_counted(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    mock = MockProvider("n1", MockConfig(state_file=state))
    await mock.create_pod(resolved())
    assert [p["creates"] for p in stored(state)] == [1]
    await mock.create_pod(resolved())
    assert [p["creates"] for p in stored(state)] == [2]


async def test_the_agents_applied_digest_is_handed_back_after_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    given = resolved()
    assert given.pod.metadata is not None
    given.pod.metadata.annotations = {"vkubelet.io/applied": "abc"}
    await MockProvider("n1", MockConfig(state_file=state)).create_pod(given)
    again = await MockProvider("n1", MockConfig(state_file=state)).get_pod(NS, POD)
    assert again is not None and again.metadata is not None
    assert again.metadata.annotations == {"vkubelet.io/applied": "abc"}
