"""The fake apiserver's own semantics, where the agent's tests rely on them matching Kubernetes."""

from __future__ import annotations

import pytest

from vkubelet.kube import ApiError, Unreachable
from vkubelet.testing.fakeapi import FakeApiServer, merge_patch, strategic_merge_patch

from ..node.helpers import NS, pod


def test_merge_patch_replaces_lists_and_deletes_with_null() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3]}) == {
        "a": {"c": 2, "d": 3},
        "l": [3],
    }


def test_strategic_merge_merges_conditions_by_type_and_replaces_container_statuses() -> None:
    status = {
        "status": {
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "app", "state": {"waiting": {"reason": "X"}}}],
        }
    }
    patch = {
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "app", "state": {"running": {}}}],
        }
    }
    merged = strategic_merge_patch(status, patch)["status"]
    assert [c["type"] for c in merged["conditions"]] == ["PodScheduled", "Ready"]
    assert merged["containerStatuses"] == [{"name": "app", "state": {"running": {}}}]


async def test_preconditions_and_graceful_pod_deletion() -> None:
    api = FakeApiServer()
    client = api.client()
    try:
        created = api.create("pods", pod("web", grace=30))
        path = f"/api/v1/namespaces/{NS}/pods/web"
        with pytest.raises(ApiError) as error:
            await client.patch(f"{path}/status", {"metadata": {"uid": "other"}, "status": {}})
        assert error.value.conflict
        with pytest.raises(ApiError) as error:
            await client.delete(path, {"preconditions": {"uid": "other"}})
        assert error.value.conflict
        terminating = await client.delete(path)
        assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30
        assert api.get("pods", "web", NS) is not None
        await client.delete(
            path, {"gracePeriodSeconds": 0, "preconditions": {"uid": created["metadata"]["uid"]}}
        )
        assert api.get("pods", "web", NS) is None
    finally:
        await client.aclose()


async def test_watch_replays_from_a_version_and_expires_after_compaction() -> None:
    api = FakeApiServer()
    client = api.client()
    try:
        start = str(api.resource_version)
        api.create("pods", pod("a"))
        events = [
            kind
            async for kind, _ in client.watch(
                "/api/v1/pods", {"resourceVersion": start}, timeout_seconds=0
            )
        ]
        assert events == ["ADDED"]
        api.compact()
        events = [
            kind
            async for kind, _ in client.watch(
                "/api/v1/pods", {"resourceVersion": start}, timeout_seconds=5
            )
        ]
        assert events == ["ERROR"]
    finally:
        await client.aclose()


async def test_an_unreachable_server_raises_unreachable() -> None:
    api = FakeApiServer()
    client = api.client()
    try:
        with api.down(), pytest.raises(Unreachable):
            await client.get("/api/v1/nodes")
        assert (await client.get("/api/v1/nodes"))["items"] == []
    finally:
        await client.aclose()


async def test_a_token_request_returns_a_token_with_its_expiry() -> None:
    api = FakeApiServer()
    client = api.client()
    try:
        answer = await client.create(
            f"/api/v1/namespaces/{NS}/serviceaccounts/default/token",
            {"spec": {"expirationSeconds": 600}},
        )
        assert answer["status"]["token"]
        assert answer["status"]["expirationTimestamp"].endswith("Z")
        with pytest.raises(ApiError) as error:
            await client.create(f"/api/v1/namespaces/{NS}/serviceaccounts/absent/token", {})
        assert error.value.not_found
    finally:
        await client.aclose()
