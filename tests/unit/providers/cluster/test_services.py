"""Which upper Services are reflected below, and what the lower copy looks like."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.kube import ApiError
from vkubelet.providers.cluster import (
    ClusterProvider,
    LowerCluster,
    load_lower_config,
    open_lower,
)
from vkubelet.providers.cluster._services import lower_service, plan_services, selects
from vkubelet.sdk import ProviderContext, ProviderError, ResolvedPod
from vkubelet.testing.fakeapi import FakeApiServer

from .fakes import lower_yaml
from .pods import OTHER, OWNER, upper_pod

JSON = dict[str, Any]


def service(name: str = "web", *, selector: dict[str, str] | None = None, **spec: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "namespace": "shop",
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "10",
            "labels": {"app": name, "vkubelet.io/owner": "forged"},
        },
        "spec": {
            "type": "NodePort",
            "clusterIP": "10.96.0.5",
            "selector": {"app": "web"} if selector is None else selector,
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}],
            **spec,
        },
    }


def pod(labels: dict[str, str], namespace: str = "shop") -> JSON:
    return {"metadata": {"namespace": namespace, "name": "p", "labels": labels}}


def prefixed(namespace: str) -> str:
    return "up-" + namespace


def test_a_service_selects_pods_of_its_namespace_with_all_its_labels() -> None:
    web = service()
    assert selects(web, pod({"app": "web", "tier": "front"}))
    assert not selects(web, pod({"app": "db"}))
    assert not selects(web, pod({"app": "web"}, namespace="other"))
    assert not selects(service(selector={}), pod({"app": "web"})), "hand-made endpoints"
    assert not selects(service(type="ExternalName"), pod({"app": "web"})), "a DNS alias"


def test_the_lower_copy_selects_only_this_owners_pods_and_opens_no_node_port() -> None:
    lower = lower_service(service(), OWNER, "up-shop")
    assert lower["metadata"]["namespace"] == "up-shop"
    assert lower["metadata"]["name"] == "web", "the DNS name is kept"
    assert lower["spec"]["selector"] == {"app": "web", "vkubelet.io/owner": OWNER.key}
    assert lower["spec"]["type"] == "ClusterIP"
    assert lower["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    assert "clusterIP" not in lower["spec"], "the lower cluster allocates its own"
    labels, annotations = lower["metadata"]["labels"], lower["metadata"]["annotations"]
    assert labels["vkubelet.io/owner"] == OWNER.key, "a forged stamp is replaced"
    assert annotations["vkubelet.io/upper-uid"] == "uid-web"
    assert annotations["vkubelet.io/upper-resource-version"] == "10"
    headless = lower_service(service(clusterIP="None"), OWNER, "up-shop")
    assert headless["spec"]["clusterIP"] == "None"


def test_only_services_matching_a_pod_of_the_node_are_created() -> None:
    plan = plan_services(
        [service("web"), service("db", selector={"app": "db"})],
        [pod({"app": "web"})],
        {},
        OWNER,
        prefixed,
    )
    assert [s["metadata"]["name"] for s in plan.create] == ["web"]
    assert not plan.update and not plan.delete


def test_an_unchanged_copy_is_left_alone_and_a_changed_one_updated_keeping_its_ip() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"] |= {"uid": "lower-1", "resourceVersion": "77"}
    current["spec"] |= {"clusterIP": "10.0.0.7", "clusterIPs": ["10.0.0.7"]}
    ours = {("up-shop", "web"): current}
    assert plan_services([service()], [pod({"app": "web"})], ours, OWNER, prefixed).update == []
    changed = service()
    changed["metadata"]["resourceVersion"] = "11"
    changed["spec"]["ports"][0]["port"] = 8080
    plan = plan_services([changed], [pod({"app": "web"})], ours, OWNER, prefixed)
    [update] = plan.update
    assert update["spec"]["ports"][0]["port"] == 8080
    assert update["spec"]["clusterIP"] == "10.0.0.7"
    assert update["metadata"]["resourceVersion"] == "77"


def test_a_copy_no_pod_needs_or_whose_upper_service_went_is_deleted_with_its_uid() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"]["uid"] = "lower-1"
    ours = {("up-shop", "web"): current}
    no_pod = plan_services([service()], [pod({"app": "db"})], ours, OWNER, prefixed)
    assert no_pod.delete == [(("up-shop", "web"), "lower-1")]
    no_service = plan_services([], [pod({"app": "web"})], ours, OWNER, prefixed)
    assert no_service.delete == [(("up-shop", "web"), "lower-1")]


def test_turning_headless_deletes_and_recreates_the_copy() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"]["uid"] = "lower-1"
    current["spec"]["clusterIP"] = "10.0.0.7"
    headless = service(clusterIP="None")
    headless["metadata"]["resourceVersion"] = "12"
    plan = plan_services(
        [headless], [pod({"app": "web"})], {("up-shop", "web"): current}, OWNER, prefixed
    )
    assert plan.delete == [(("up-shop", "web"), "lower-1")]
    assert [s["spec"]["clusterIP"] for s in plan.replace] == ["None"]


def test_two_owners_copies_select_disjoint_pods() -> None:
    mine = lower_service(service(), OWNER, "shop")["spec"]["selector"]
    theirs = lower_service(service(), OTHER, "shop")["spec"]["selector"]
    assert mine != theirs


class UpperStub:
    """The agent's client, as far as the upper cluster ID needs it."""

    def __init__(self, answer: JSON | ApiError) -> None:
        self.answer = answer

    async def get(self, path: str, params: Any = None) -> JSON:
        assert path == "/api/v1/namespaces/kube-system"
        if isinstance(self.answer, ApiError):
            raise self.answer
        return self.answer

    async def create(self, path: str, body: Any) -> JSON:
        raise AssertionError("not used")

    def watch(self, path: str, params: Any, *, timeout_seconds: int) -> Any:
        raise AssertionError("not used")


def provider(tmp_path: Path, **config: Any) -> ClusterProvider:
    loaded = load_lower_config(lower_yaml(tmp_path, **config))
    context = ProviderContext(
        node_name="vk-lower", config_path=None, internal_ip="10.0.0.9", kubelet_port=0
    )
    return ClusterProvider(loaded, context, open_lower(loaded), background=False)


def test_without_upper_cluster_id_the_kube_system_namespace_uid_is_the_identity(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        given = provider(tmp_path)
        given.use_upper_api(UpperStub({"metadata": {"name": "kube-system", "uid": "ks-uid-1"}}))
        await given._ensure_owner()
        assert given.owner.cluster_id == "ks-uid-1"
        assert given.how.owner == given.owner
        await given.lower.aclose()

        fixed = provider(tmp_path, upperClusterID="prod-eu")
        fixed.use_upper_api(UpperStub(ApiError(403, "Forbidden", "no")))
        await fixed._ensure_owner()
        assert fixed.owner.cluster_id == "prod-eu", "the configured ID wins, nothing read"
        await fixed.lower.aclose()

    asyncio.run(run())


def test_an_unreadable_kube_system_makes_the_node_not_ready_saying_what_to_set(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        given = provider(tmp_path)
        given.use_upper_api(UpperStub(ApiError(403, "Forbidden", "namespaces is forbidden")))
        with pytest.raises(ProviderError) as raised:
            await given._ensure_owner()
        assert raised.value.reason == "UpperClusterIDUnknown" and not raised.value.permanent
        [ready] = given.node_conditions()
        assert ready.status == "False" and ready.reason == "UpperClusterIDUnknown"
        assert "set upperClusterID" in ready.message and "namespaces is forbidden" in ready.message
        await given.lower.aclose()

    asyncio.run(run())


def test_the_provider_reflects_services_of_its_pods_and_never_touches_anyone_elses(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        config = load_lower_config(
            lower_yaml(tmp_path, upperClusterID="upper-a", namespaces={"create": False})
        )
        lower_api = FakeApiServer()
        context = ProviderContext(
            node_name="vk-lower", config_path=None, internal_ip="10.0.0.9", kubelet_port=0
        )
        given = ClusterProvider(
            config, context, LowerCluster(lower_api.client(), config), background=False
        )
        users = lower_service(service("users"), OTHER, "shop")
        users["spec"]["selector"] = {"app": "users"}
        lower_api.create("services", users, "shop")
        lower_api.create(
            "services", {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 1}]}}, "shop"
        )
        given.services.upper_services = {
            ("shop", name): service(name) for name in ("web", "users", "api")
        }
        upper = upper_pod()
        upper["metadata"]["labels"] = {"app": "web"}
        given._pods["shop/p"] = ResolvedPod(msgspec.convert(upper, Pod))

        await given.services.sync(relist=True)
        names = {s["metadata"]["name"]: s for s in lower_api.objects("services", "shop")}
        assert set(names) == {"web", "users", "api"}
        assert names["web"]["spec"]["ports"] == [{"port": 1}], "the user's own: left alone"
        assert names["users"]["spec"]["selector"] == {"app": "users"}, "another owner's"
        assert names["api"]["spec"]["selector"]["vkubelet.io/owner"] == given.owner.key

        del given._pods["shop/p"]
        await given.services.sync(relist=False)
        assert {s["metadata"]["name"] for s in lower_api.objects("services", "shop")} == {
            "web",
            "users",
        }
        await given.aclose()

    asyncio.run(run())
