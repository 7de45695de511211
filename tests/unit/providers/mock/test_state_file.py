"""The mock's state file behaves as a real backend's disk: what a lifecycle call did is there
when the call returns, so an agent killed at any moment loses nothing it was told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vkubelet import ProviderError, ResolvedPod
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


def named(name: str, uid: str) -> ResolvedPod:
    pod = resolved()
    assert pod.pod.metadata is not None
    pod.pod.metadata.name, pod.pod.metadata.uid = name, uid
    return pod


async def test_a_restarted_mock_never_gives_a_new_pod_the_ip_of_one_it_kept(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    first = MockProvider("n1", MockConfig(state_file=state))
    for i in range(3):
        await first.create_pod(named(f"p{i}", f"u{i}"))
    kept = {p["ip"] for p in stored(state)}
    assert len(kept) == 3
    again = MockProvider("n1", MockConfig(state_file=state))
    await again.create_pod(named("new", "u-new"))
    [new_ip] = {p["ip"] for p in stored(state)} - kept
    assert new_ip not in kept


async def test_pod_ips_are_host_addresses_of_the_cidr_and_run_out_with_a_clear_error() -> None:
    mock = MockProvider("n1", MockConfig(pod_cidr="10.9.0.0/30"))  # hosts .1 and .2
    await mock.create_pod(named("a", "ua"))
    await mock.create_pod(named("b", "ub"))
    ips = {(await mock.get_pod(NS, n)).status.podIP for n in ("a", "b")}  # type: ignore[union-attr]
    assert ips == {"10.9.0.1", "10.9.0.2"}
    with pytest.raises(ProviderError, match=r"every address of podCIDR 10\.9\.0\.0/30 is in use"):
        await mock.create_pod(named("c", "uc"))
    gone = await mock.get_pod(NS, "a")
    assert gone is not None
    await mock.delete_pod(gone, 0)
    await mock.create_pod(named("c", "uc"))
    assert (await mock.get_pod(NS, "c")).status.podIP == "10.9.0.1"  # type: ignore[union-attr]


async def test_the_ip_of_a_pod_the_mock_refused_is_free_again() -> None:
    mock = MockProvider("n1", MockConfig(pod_cidr="10.9.0.0/30"))
    for attempt in range(3):  # more than the CIDR holds: each reservation was given back
        refused = named(f"r{attempt}", f"ur{attempt}")
        assert refused.pod.metadata is not None
        refused.pod.metadata.annotations = {"mock.vkubelet.io/fail": "Nope"}
        await mock.pod_ips(refused.pod)
        with pytest.raises(ProviderError, match="rejected because of"):
            await mock.create_pod(refused)
    for attempt in range(3):  # resolved, then deleted before it was created
        never = named(f"n{attempt}", f"un{attempt}")
        await mock.pod_ips(never.pod)
        await mock.delete_pod(never.pod, 0)
    await mock.create_pod(named("a", "ua"))
    await mock.create_pod(named("b", "ub"))


async def test_an_address_two_kept_pods_share_is_free_only_once_both_are_gone(
    tmp_path: Path,
) -> None:
    """A state file from before pod IPs were unique may give two pods one address: deleting
    one of them must not hand that address to a third pod while the other still has it."""
    state = tmp_path / "state.json"
    first = MockProvider("n1", MockConfig(state_file=state, pod_cidr="10.9.0.0/29"))
    await first.create_pod(named("a", "ua"))
    await first.create_pod(named("b", "ub"))
    raw = json.loads(state.read_text())
    shared = raw["pods"][0]["ip"]
    raw["pods"][1]["ip"] = shared
    state.write_text(json.dumps(raw))
    again = MockProvider("n1", MockConfig(state_file=state, pod_cidr="10.9.0.0/29"))
    gone = await again.get_pod(NS, "a")
    assert gone is not None
    await again.delete_pod(gone, 0)
    for i in range(5):  # every other host address of the /29, round-robin
        await again.create_pod(named(f"n{i}", f"un{i}"))
    assert shared not in {p["ip"] for p in stored(state) if p["name"] != "b"}
