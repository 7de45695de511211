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
from vkubelet.providers.cluster._services import (
    MANAGER,
    ServicePlan,
    held_deletes,
    lower_endpoint_slice,
    lower_service,
    plan_services,
    selects,
)
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


def endpoint_slice(name: str, *endpoints: tuple[str, str, bool], service: str = "web") -> JSON:
    """An upper EndpointSlice of `service`: (address, node, ready) per endpoint."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": "shop",
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "20",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "nodeName": node,
                "zone": "a",
                "targetRef": {"kind": "Pod", "namespace": "shop", "name": f"pod-{address}"},
            }
            for address, node, ready in endpoints
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


NODES = {"vk-lower"}


def plan(
    services: list[JSON],
    pods: list[JSON],
    ours: dict[tuple[str, str, str], JSON] | None = None,
    slices: dict[tuple[str, str], list[JSON]] | None = None,
    nodes: set[str] = NODES,
) -> ServicePlan:
    return plan_services(services, pods, slices, ours or {}, OWNER, prefixed, nodes)


def test_the_lower_copy_has_no_selector_and_opens_no_node_port() -> None:
    lower = lower_service(service(), OWNER, "up-shop")
    assert lower["metadata"]["namespace"] == "up-shop"
    assert lower["metadata"]["name"] == "web", "the DNS name is kept"
    assert "selector" not in lower["spec"], "its EndpointSlices are written by the provider"
    assert lower["spec"]["type"] == "ClusterIP"
    assert lower["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    assert "clusterIP" not in lower["spec"], "the lower cluster allocates its own"
    labels, annotations = lower["metadata"]["labels"], lower["metadata"]["annotations"]
    assert labels["vkubelet.io/owner"] == OWNER.key, "a forged stamp is replaced"
    assert annotations["vkubelet.io/upper-uid"] == "uid-web"
    assert annotations["vkubelet.io/upper-resource-version"] == "10"
    headless = lower_service(service(clusterIP="None"), OWNER, "up-shop")
    assert headless["spec"]["clusterIP"] == "None"


def test_the_lower_endpoint_slice_holds_every_upper_endpoint_without_upper_node_or_pod() -> None:
    upper = endpoint_slice("web-abc", ("10.160.0.5", "worker-0", True), ("10.244.1.7", "vk", False))
    upper["endpoints"][0]["hostname"] = "web-0"
    lower = lower_endpoint_slice(upper, OWNER, "up-shop")
    assert lower["metadata"]["namespace"] == "up-shop" and lower["metadata"]["name"] == "web-abc"
    labels = lower["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == "web"
    assert labels["endpointslice.kubernetes.io/managed-by"] == MANAGER, "not the controller's"
    assert labels["vkubelet.io/owner"] == OWNER.key
    assert lower["endpoints"] == [
        {
            "addresses": ["10.160.0.5"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "hostname": "web-0",
        },
        {
            "addresses": ["10.244.1.7"],
            "conditions": {"ready": False, "serving": False, "terminating": False},
        },
    ]
    assert lower["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert lower["metadata"]["annotations"]["vkubelet.io/upper-resource-version"] == "20"


def test_only_services_matching_a_pod_of_the_node_are_created_with_their_slices() -> None:
    slices = {
        ("shop", "web"): [endpoint_slice("web-abc", ("10.160.0.5", "worker-0", True))],
        ("shop", "db"): [endpoint_slice("db-xyz", ("10.160.0.6", "worker-1", True), service="db")],
    }
    upper = [service("web"), service("db", selector={"app": "db"})]
    made = plan(upper, [pod({"app": "web"})], slices=slices)
    assert [(o["kind"], o["metadata"]["name"]) for o in made.create] == [("Service", "web")]
    assert not made.update and not made.delete
    ours = {("Service", "up-shop", "web"): made.create[0]}
    then = plan(upper, [pod({"app": "web"})], ours, slices=slices)
    assert [(o["kind"], o["metadata"]["name"]) for o in then.create] == [
        ("EndpointSlice", "web-abc")
    ], "once the Service is ours; the replica on an upper worker is an endpoint below too"


def test_a_lower_service_held_by_someone_else_gets_no_endpoint_slice_of_ours() -> None:
    slices = {("shop", "web"): [endpoint_slice("web-abc", ("10.160.0.5", "worker-0", True))]}
    made = plan([service()], [pod({"app": "web"})], slices=slices)
    assert [o["kind"] for o in made.create] == ["Service"], "its create may meet a conflict"


def test_an_endpoint_on_a_node_sharing_the_copies_keeps_its_service_below() -> None:
    slices = {("shop", "web"): [endpoint_slice("web-abc", ("10.244.2.3", "vk-b", True))]}
    mirror = plan([service()], [], slices=slices, nodes={"vk-a", "vk-b"})
    assert [o["kind"] for o in mirror.create] == ["Service"]
    elsewhere = plan([service()], [], slices=slices, nodes={"vk-a"})
    assert not elsewhere.create, "no pod of ours, no endpoint on a node of ours"
    hand_made = plan([service(selector={})], [], slices=slices, nodes={"vk-a", "vk-b"})
    assert not hand_made.create, "a Service without a selector is not reflected"


def test_an_unchanged_copy_is_left_alone_and_a_changed_one_updated_keeping_its_ip() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"] |= {"uid": "lower-1", "resourceVersion": "77"}
    current["spec"] |= {"clusterIP": "10.0.0.7", "clusterIPs": ["10.0.0.7"]}
    ours = {("Service", "up-shop", "web"): current}
    assert plan([service()], [pod({"app": "web"})], ours).update == []
    changed = service()
    changed["metadata"]["resourceVersion"] = "11"
    changed["spec"]["ports"][0]["port"] = 8080
    [update] = plan([changed], [pod({"app": "web"})], ours).update
    assert update["spec"]["ports"][0]["port"] == 8080
    assert update["spec"]["clusterIP"] == "10.0.0.7"
    assert update["metadata"]["resourceVersion"] == "77"


def test_a_changed_upper_slice_updates_its_copy_and_a_gone_one_deletes_it() -> None:
    old = lower_endpoint_slice(endpoint_slice("web-abc"), OWNER, "up-shop")
    old["metadata"] |= {"uid": "lower-s", "resourceVersion": "5"}
    gone = lower_endpoint_slice(endpoint_slice("web-old"), OWNER, "up-shop")
    gone["metadata"]["uid"] = "lower-g"
    service_copy = lower_service(service(), OWNER, "up-shop")
    ours = {
        ("Service", "up-shop", "web"): service_copy,
        ("EndpointSlice", "up-shop", "web-abc"): old,
        ("EndpointSlice", "up-shop", "web-old"): gone,
    }
    newer = endpoint_slice("web-abc", ("10.160.0.5", "worker-0", True))
    newer["metadata"]["resourceVersion"] = "21"
    made = plan([service()], [pod({"app": "web"})], ours, slices={("shop", "web"): [newer]})
    [update] = made.update
    assert update["endpoints"][0]["addresses"] == ["10.160.0.5"]
    assert update["metadata"]["resourceVersion"] == "5"
    assert made.delete == [(("EndpointSlice", "up-shop", "web-old"), "lower-g")]
    unknown = plan([service()], [pod({"app": "web"})], ours, slices=None)
    assert not unknown.delete and not unknown.update, "unreadable upper slices: left as they are"


def test_a_copy_no_pod_needs_or_whose_upper_service_went_is_deleted_with_its_uid() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"]["uid"] = "lower-1"
    ours = {("Service", "up-shop", "web"): current}
    no_pod = plan([service()], [pod({"app": "db"})], ours)
    assert no_pod.delete == [(("Service", "up-shop", "web"), "lower-1")]
    no_service = plan([], [pod({"app": "web"})], ours)
    assert no_service.delete == [(("Service", "up-shop", "web"), "lower-1")]


def test_turning_headless_or_a_copy_with_a_selector_deletes_and_recreates_it() -> None:
    current = lower_service(service(), OWNER, "up-shop")
    current["metadata"]["uid"] = "lower-1"
    current["spec"]["clusterIP"] = "10.0.0.7"
    headless = service(clusterIP="None")
    headless["metadata"]["resourceVersion"] = "12"
    made = plan([headless], [pod({"app": "web"})], {("Service", "up-shop", "web"): current})
    assert made.delete == [(("Service", "up-shop", "web"), "lower-1")]
    assert [s["spec"]["clusterIP"] for s in made.replace] == ["None"]
    current["spec"]["selector"] = {"app": "web", "vkubelet.io/owner": OWNER.key}
    earlier = plan([service()], [pod({"app": "web"})], {("Service", "up-shop", "web"): current})
    assert [s["metadata"]["name"] for s in earlier.replace] == ["web"], "made by an earlier version"


def test_a_shared_copy_no_member_needs_stays_for_the_grace_while_its_upper_service_exists() -> None:
    copy = lower_service(service(), OWNER, "up-shop")
    piece = lower_endpoint_slice(endpoint_slice("web-abc"), OWNER, "up-shop")
    ours = {("Service", "up-shop", "web"): copy, ("EndpointSlice", "up-shop", "web-abc"): piece}
    deletes = [(key, "uid") for key in ours]
    exists = {("shop", "web")}
    now, since = held_deletes(deletes, ours, exists, {}, 100.0, 30.0)
    assert now == [], "kept, with its slices: a replica may be moving to another member"
    later, since_then = held_deletes(deletes, ours, exists, since, 120.0, 30.0)
    assert later == [] and since_then == since, "unneeded since the first pass"
    after, _ = held_deletes(deletes, ours, exists, since, 130.0, 30.0)
    assert after == deletes, "the grace is over"
    gone, _ = held_deletes(deletes, ours, set(), {}, 100.0, 30.0)
    assert gone == deletes, "the upper Service is gone: no reason to wait"
    _, needed_again = held_deletes([], ours, exists, since, 120.0, 30.0)
    assert needed_again == {}, "needed again: the next unneeded spell starts afresh"


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
        assert names["api"]["metadata"]["labels"]["vkubelet.io/owner"] == given.owner.key

        del given._pods["shop/p"]
        await given.services.sync(relist=False)
        assert {s["metadata"]["name"] for s in lower_api.objects("services", "shop")} == {
            "web",
            "users",
        }
        await given.aclose()

    asyncio.run(run())


class NodeEvents:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def pod_event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        pass

    def node_event(self, node_name: str, type: str, reason: str, message: str) -> None:
        self.events.append((reason, message))


def test_the_provider_writes_the_upper_slices_below_and_says_once_when_it_may_not_read_them(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        config = load_lower_config(
            lower_yaml(tmp_path, upperClusterID="upper-a", namespaces={"create": False})
        )
        lower_api, events = FakeApiServer(), NodeEvents()
        context = ProviderContext(
            node_name="vk-lower",
            config_path=None,
            internal_ip="10.0.0.9",
            kubelet_port=0,
            events=events,
        )
        given = ClusterProvider(
            config, context, LowerCluster(lower_api.client(), config), background=False
        )
        denied = ApiError(403, "Forbidden", "endpointslices.discovery.k8s.io is forbidden")
        given.services._slices_failed(denied)
        given.services._slices_failed(denied)
        [(reason, message)] = events.events
        assert reason == "UpperEndpointSlicesForbidden"
        assert "list/watch endpointslices.discovery.k8s.io" in message
        given.services.upper_services = {("shop", n): service(n) for n in ("web", "mine")}
        given.services._put_slice(endpoint_slice("web-abc", ("10.160.0.5", "worker-0", True)))
        given.services._put_slice(
            endpoint_slice("mine-x", ("10.160.0.6", "w", True), service="mine")
        )
        lower_api.create("services", {"metadata": {"name": "mine"}, "spec": {}}, "shop")
        given.services._slices_listed()
        upper = upper_pod()
        upper["metadata"]["labels"] = {"app": "web"}
        given._pods["shop/p"] = ResolvedPod(msgspec.convert(upper, Pod))

        await given.services.sync(relist=True)
        assert lower_api.objects("endpointslices", "shop") == [], "not before the Service"
        await given.services.sync(relist=False)
        [copy] = lower_api.objects("endpointslices", "shop")  # none for the user's Service
        assert copy["endpoints"][0]["addresses"] == ["10.160.0.5"]
        assert copy["metadata"]["labels"]["kubernetes.io/service-name"] == "web"

        given.services._drop_slice(endpoint_slice("web-abc"))
        await given.services.sync(relist=False)
        assert lower_api.objects("endpointslices", "shop") == []
        await given.aclose()

    asyncio.run(run())
