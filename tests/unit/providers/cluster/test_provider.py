"""The provider class over a scripted lower API: what it refuses to touch and how it says so."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.kube import ApiError, KubeClient
from vkubelet.node import ConfigError
from vkubelet.providers.cluster import (
    ClusterProvider,
    LowerCluster,
    _deps,
    _depsync,
    _provider,
    create,
    load_lower_config,
    open_lower,
    stamp,
)
from vkubelet.providers.cluster._capacity import lower_capacity
from vkubelet.sdk import EventSink, ProviderError, ResolvedPod
from vkubelet.testing.harness import always, eventually

from .fakes import context, lower_yaml, resolved, scripted
from .pods import OTHER, upper_pod


def test_the_factory_needs_lower_yaml_and_does_not_contact_the_lower_cluster(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="needs --provider-config"):
        create(context(None))
    lower_yaml(tmp_path)
    provider = create(context(tmp_path))
    assert isinstance(provider, ClusterProvider) and provider.pass_through
    asyncio.run(provider.lower.aclose())


async def attempt(provider: ClusterProvider) -> ProviderError:
    try:
        with pytest.raises(ProviderError) as raised:
            await provider.create_pod(resolved())
        return raised.value
    finally:
        await provider.aclose()


def test_a_lower_pod_of_another_owner_is_a_conflict_and_is_left_alone(tmp_path: Path) -> None:
    writes: list[Any] = []
    theirs = stamp(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-7d9f-abcde", "uid": "x"}},
        OTHER,
        namespace="shop",
        name="web-7d9f-abcde",
        uid="someone-else",
    )
    error = asyncio.run(attempt(scripted(tmp_path, theirs, writes)))
    assert error.reason == "LowerNameConflict" and error.permanent
    assert "owned by virtual node 'vk-lower' of upper cluster 'upper-b'" in error.message
    assert [w for w in writes if w[0] != "POST" or not w[1].endswith("/namespaces")] == []


def test_the_users_own_lower_pod_of_that_name_is_left_alone(tmp_path: Path) -> None:
    writes: list[Any] = []
    users = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-7d9f-abcde"}}
    error = asyncio.run(attempt(scripted(tmp_path, users, writes)))
    assert error.reason == "LowerNameConflict"
    assert "the lower cluster's own object" in error.message
    assert not any(w[0] in ("DELETE", "PUT", "PATCH") for w in writes)


def test_another_owners_lower_pod_that_is_going_away_is_waited_for_not_a_conflict(
    tmp_path: Path,
) -> None:
    """A StatefulSet pod force-deleted upstairs and re-created on another virtual node that
    shares the lower cluster: the old lower pod is still terminating."""
    writes: list[Any] = []
    leaving = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-7d9f-abcde", "deletionTimestamp": "2026-11-25T06:00:00Z"},
    }
    error = asyncio.run(attempt(scripted(tmp_path, leaving, writes)))
    assert (error.reason, error.permanent) == ("LowerPodReplacing", False)
    assert not any(w[0] in ("DELETE", "PUT", "PATCH") for w in writes)


def test_a_namespace_forbidden_below_fails_the_pod_with_the_lower_apis_message(
    tmp_path: Path,
) -> None:
    error = asyncio.run(attempt(scripted(tmp_path, None, [])))
    assert (error.reason, error.permanent) == ("LowerForbidden", True)
    assert (
        error.message == 'lower cluster: create the lower pod: pods is forbidden: namespace "shop"'
    )


def test_a_pod_with_an_older_copy_of_a_configmap_does_not_roll_the_lower_copy_back(
    tmp_path: Path,
) -> None:
    config = load_lower_config(lower_yaml(tmp_path))
    written: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        body = json.loads(request.content)
        if body["kind"] == "ConfigMap":
            written.append(body["metadata"]["annotations"]["vkubelet.io/upper-resource-version"])
        return httpx.Response(201, json=body)

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    provider = ClusterProvider(config, context(tmp_path), lower, background=False)

    def pod(name: str, version: str) -> ResolvedPod:
        spec = upper_pod(
            volumes=[], imagePullSecrets=[], serviceAccountName="default", initContainers=[]
        )
        spec["metadata"]["name"] = name
        spec["metadata"]["uid"] = "uid-" + name
        spec["spec"]["containers"][0].update(
            env=[], volumeMounts=[], envFrom=[{"configMapRef": {"name": "web-config"}}]
        )
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": version},
            "data": {"v": version},
        }
        return ResolvedPod(
            msgspec.convert(spec, Pod), references={("ConfigMap", "shop", "web-config"): config_map}
        )

    async def scenario() -> None:
        await provider.create_pod(pod("fresh", "7"))
        await provider.create_pod(pod("stale", "5"))
        await provider.aclose()

    asyncio.run(scenario())
    assert written and set(written) == {"7"}


def test_a_pod_whose_copies_are_current_starts_without_a_plan_and_a_newer_version_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_lower_config(lower_yaml(tmp_path))
    requests: list[tuple[str, str]] = []
    plans: list[int] = []  # how many pods each dependency plan went over
    real_plan = _deps.plan_dependencies

    def plan(pods: Any, *args: Any, **kwargs: Any) -> Any:
        pods = list(pods)
        plans.append(len(pods))
        return real_plan(pods, *args, **kwargs)

    monkeypatch.setattr(_depsync, "plan_dependencies", plan)

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append((request.method, request.url.path))
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET" and request.url.path.endswith("/namespaces/shop"):
            return httpx.Response(200, json={"metadata": {"name": "shop"}})
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        return httpx.Response(201, json=json.loads(request.content))

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    provider = ClusterProvider(config, context(tmp_path), lower, background=False)

    def pod(name: str, version: str | None) -> ResolvedPod:
        spec = upper_pod(
            volumes=[], imagePullSecrets=[], serviceAccountName="default", initContainers=[]
        )
        spec["metadata"]["name"] = name
        spec["metadata"]["uid"] = "uid-" + name
        env_from = [{"configMapRef": {"name": "web-config"}}] if version else []
        spec["spec"]["containers"][0].update(env=[], volumeMounts=[], envFrom=env_from)
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": version},
            "data": {"v": version},
        }
        refs = {("ConfigMap", "shop", "web-config"): config_map} if version else {}
        return ResolvedPod(msgspec.convert(spec, Pod), references=refs)

    async def started(name: str, version: str | None) -> list[tuple[str, str]]:
        requests.clear()
        await provider.create_pod(pod(name, version))
        return [r for r in requests if "/pods" not in r[1]]  # the pod's own requests aside

    async def scenario() -> None:
        try:
            first = await started("a", "7")
            assert ("POST", "/api/v1/namespaces/shop/configmaps") in first
            assert await started("b", "7") == [], "the copy is there: no list, no write"
            assert await started("c", None) == [], "needs nothing: nothing but the pod"
            newer = await started("d", "8")
            assert [m for m, path in newer if "/configmaps/web-config" in path] == ["PUT"]
            assert await started("e", "8") == []
            assert plans == [1, 4], "planned for the first pod and the newer version only"
        finally:
            await provider.aclose()

    asyncio.run(scenario())


def test_a_dependency_name_taken_by_the_user_blocks_the_pod_and_is_left_alone(
    tmp_path: Path,
) -> None:
    config = load_lower_config(lower_yaml(tmp_path, dependencyNames="same"))
    writes: list[tuple[str, str]] = []
    users = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config"}}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and request.url.params.get("labelSelector"):
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        if request.method == "GET" and path.endswith("/configmaps/web-config"):
            return httpx.Response(200, json=users)
        if request.method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        writes.append((request.method, path))
        if path.endswith("/configmaps"):
            return httpx.Response(409, json={"reason": "AlreadyExists", "message": "exists"})
        return httpx.Response(201, json=json.loads(request.content))

    real = open_lower(config)
    lower = LowerCluster(
        KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
    )
    provider = ClusterProvider(config, context(tmp_path), lower, background=False)
    pod = resolved()
    spec = msgspec.to_builtins(pod.pod)
    spec["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "web-config"}}]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": "3"},
        "data": {},
    }
    refs = {("ConfigMap", "shop", "web-config"): config_map}

    async def scenario() -> ProviderError:
        try:
            with pytest.raises(ProviderError) as raised:
                await provider.create_pod(ResolvedPod(msgspec.convert(spec, Pod), references=refs))
            return raised.value
        finally:
            await provider.aclose()

    error = asyncio.run(scenario())
    assert (error.reason, error.permanent) == ("LowerDependencyConflict", True)
    assert "lower cluster's own object" in error.message
    assert not any(m in ("PUT", "PATCH", "DELETE") for m, _ in writes)
    assert not any(p.endswith("/pods") for _, p in writes)  # the pod is not created


class FakeLower:
    """A lower API that keeps its pods (and lists `nodes`), and whose first pod watch delivers
    `events` (later watches stay open and silent): the late events of a pod deleted and
    re-created upstairs."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.watched: list[str] = []  # the paths of the watches asked for, in order
        self.open_watches: Counter[str] = Counter()  # path -> watches open (and silent)
        self.written: list[tuple[str, str]] = []
        self.objects: dict[str, list[dict[str, Any]]] = {}  # "configmaps" -> those created
        self.patches: list[dict[str, Any]] = []  # the bodies of PATCH requests, in order
        self.pod_reads = 0
        self.watches = 0
        self.watching_again = asyncio.Event()
        self._version = 10

    def _next(self) -> str:
        self._version += 1
        return str(self._version)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        name = path.rsplit("/", 1)[-1]
        if request.url.params.get("watch"):
            self.watched.append(path)
            if path == "/api/v1/pods":
                self.watches += 1
            if path == "/api/v1/pods" and self.watches == 1:
                lines = b"".join(
                    msgspec.json.encode({"type": kind, "object": obj}) + b"\n"
                    for kind, obj in self.events
                )
                return httpx.Response(200, content=lines)
            if path == "/api/v1/pods":
                self.watching_again.set()
            self.open_watches[path] += 1
            try:
                await asyncio.Event().wait()  # open and silent until cancelled
            finally:
                self.open_watches[path] -= 1
        if method == "GET" and path == "/api/v1/nodes":
            return httpx.Response(
                200, json={"items": self.nodes, "metadata": {"resourceVersion": "9"}}
            )
        if method == "GET" and (request.url.params.get("labelSelector") or path == "/api/v1/pods"):
            collection = path.rsplit("/", 1)[-1]
            items = list(self.pods.values()) if path == "/api/v1/pods" else []
            items += [] if collection == "pods" else self.objects.get(collection, [])
            return httpx.Response(200, json={"items": items, "metadata": {"resourceVersion": "9"}})
        if method == "GET" and "/pods/" in path:
            self.pod_reads += 1
            if name not in self.pods:
                return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
            return httpx.Response(200, json=self.pods[name])
        if method == "GET" and path.startswith("/api/v1/namespaces/") and path.count("/") == 4:
            return httpx.Response(200, json={"metadata": {"name": name}})
        if method == "GET":
            return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
        self.written.append((method, path))
        if method == "DELETE":
            uid = ((json.loads(request.content or b"{}").get("preconditions")) or {}).get("uid")
            current = self.pods.get(name)
            if current is None:
                return httpx.Response(404, json={"reason": "NotFound", "message": "no"})
            if uid and current["metadata"].get("uid") != uid:
                return httpx.Response(409, json={"reason": "Conflict", "message": "uid"})
            self.pods.pop(name, None)
            return httpx.Response(200, json={"kind": "Status", "status": "Success"})
        body = json.loads(request.content)
        if method == "PATCH":
            self.patches.append(body)
        if body.get("kind") == "Pod" and method == "POST" and body["metadata"]["name"] in self.pods:
            return httpx.Response(409, json={"reason": "AlreadyExists", "message": "exists"})
        if body.get("kind") == "Pod":
            body["metadata"].update(uid=f"lower-{self._next()}", resourceVersion=self._next())
            body["status"] = {"phase": "Pending"}
            self.pods[body["metadata"]["name"]] = body
        elif method == "POST" and "metadata" in body:
            body["metadata"].update(uid=f"lower-{self._next()}", resourceVersion=self._next())
            self.objects.setdefault(path.rsplit("/", 1)[-1], []).append(body)
        return httpx.Response(201, json=body)

    def provider(self, tmp_path: Path, events: EventSink | None = None) -> ClusterProvider:
        config = load_lower_config(lower_yaml(tmp_path))
        real = open_lower(config)
        transport = httpx.MockTransport(self.handle)
        lower = LowerCluster(KubeClient(real.client.config, transport=transport), config)
        return ClusterProvider(config, context(tmp_path, events), lower, background=False)


def web_0(uid: str, *, config_map: bool = False) -> ResolvedPod:
    pod = msgspec.to_builtins(resolved().pod)
    pod["metadata"].update(name="web-0", uid=uid)
    references: dict[Any, Any] = {}
    if config_map:
        pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "web-config"}}]
        references[("ConfigMap", "shop", "web-config")] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-config", "namespace": "shop", "resourceVersion": "3"},
            "data": {},
        }
    return ResolvedPod(msgspec.convert(pod, Pod), references=references)


def with_phase(lower: dict[str, Any], phase: str) -> dict[str, Any]:
    changed: dict[str, Any] = json.loads(json.dumps(lower))
    changed["status"] = {"phase": phase}
    return changed


def test_a_new_pods_plain_pending_status_is_held_back_briefly_and_anything_else_goes_up_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One upper status write per pod in a burst, not two: the lower pod's Pending status
    between its create and Running (containers being created) is not pushed, unless it lasts
    longer than the hold; a Pending status that tells something (Unschedulable, a container
    waiting for its image) goes up at once."""
    monkeypatch.setattr(_provider, "PENDING_HOLD", 2.0)  # long enough for a loaded machine
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    reports: list[tuple[str, str]] = []

    def phases(uid: str) -> list[str]:
        return [phase for u, phase in reports if u == uid]

    def scheduled(
        lower: dict[str, Any], *, fits: bool = True, waiting: str | None = None
    ) -> dict[str, Any]:
        changed = with_phase(lower, "Pending")
        changed["spec"]["nodeName"] = "lower-a" if fits else None
        condition: dict[str, Any] = {"type": "PodScheduled", "status": "True"}
        if not fits:
            condition.update(status="False", reason="Unschedulable", message="0/3 nodes")
        changed["status"]["conditions"] = [condition]
        if waiting is not None:
            changed["status"]["containerStatuses"] = [
                {
                    "name": "web",
                    "image": "web:1",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": waiting}},
                }
            ]
        return changed

    async def scenario() -> None:
        def report(pod: Pod) -> None:
            assert pod.metadata is not None and pod.status is not None
            reports.append((str(pod.metadata.uid), str(pod.status.phase)))

        provider.notify_pods(report)
        names = {"fast": "web-0", "slow": "web-1", "stuck": "web-2", "creating": "web-3"}
        names["pulling"] = "web-4"
        try:
            for uid, name in names.items():
                pod = msgspec.to_builtins(web_0(uid).pod)
                pod["metadata"]["name"] = name
                await provider.create_pod(ResolvedPod(msgspec.convert(pod, Pod)))
            lower = {n: fake.pods[n] for n in names.values()}
            for name in lower:
                provider._observed(f"shop/{name}", scheduled(lower[name]))
            provider._observed("shop/web-2", scheduled(lower["web-2"], fits=False))
            provider._observed("shop/web-3", scheduled(lower["web-3"], waiting="ContainerCreating"))
            provider._observed("shop/web-4", scheduled(lower["web-4"], waiting="ErrImagePull"))
            await eventually(lambda: phases("stuck") == ["Pending"], what="Unschedulable at once")
            await eventually(lambda: phases("pulling") == ["Pending"], what="ErrImagePull at once")
            provider._observed("shop/web-0", with_phase(lower["web-0"], "Running"))
            await eventually(lambda: phases("fast") == ["Running"], what="Running at once")
            assert phases("slow") == [], "plain Pending is held back"
            assert phases("creating") == [], "containers being created: held back"
            await eventually(lambda: phases("slow") == ["Pending"], what="Pending after the hold")
            await eventually(lambda: phases("creating") == ["Pending"], what="and this one")
            await always(lambda: phases("fast") == ["Running"], duration=0.5)
        finally:
            await provider.aclose()

    asyncio.run(scenario())


def test_late_events_of_a_force_deleted_pod_do_not_touch_its_successor_of_the_same_name(
    tmp_path: Path,
) -> None:
    """`kubectl delete pod web-0 --force --grace-period=0`, and the StatefulSet re-creates
    web-0 at once: the old lower pod's late MODIFIED and DELETED events arrive after the new
    pod was created. The new pod is neither reported stopped nor given the old one's status,
    and keeps its ConfigMap copy."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    reports: list[Pod] = []

    def reported(uid: str, phase: str) -> bool:
        return any(
            p.metadata is not None
            and p.metadata.uid == uid
            and p.status is not None
            and p.status.phase == phase
            for p in reports
        )

    async def scenario() -> None:
        running = asyncio.Event()  # reports are pushed in event order: the last event's ends it

        def report(pod: Pod) -> None:
            reports.append(pod)
            if reported("upper-new", "Running"):
                running.set()

        provider.notify_pods(report)
        old, new = web_0("upper-old", config_map=True), web_0("upper-new", config_map=True)
        await provider.create_pod(old)
        old_lower = fake.pods["web-0"]
        await provider.delete_pod(old.pod, 0)
        await provider.create_pod(new)
        new_lower = fake.pods["web-0"] = with_phase(fake.pods["web-0"], "Running")
        fake.events = [
            ("MODIFIED", with_phase(old_lower, "Succeeded")),
            ("DELETED", with_phase(old_lower, "Succeeded")),
            ("MODIFIED", new_lower),
        ]
        follow = asyncio.create_task(provider._follow_pods())
        try:
            async with asyncio.timeout(10):
                await fake.watching_again.wait()
                await running.wait()
            await provider.deps.sync()  # what the periodic resync would do
        finally:
            follow.cancel()
            await provider.aclose()
        status = await provider.get_pod_status("shop", "web-0")
        assert status is not None and status.phase == "Running"

    asyncio.run(scenario())
    assert not reported("upper-new", "Failed")
    assert not reported("upper-new", "Succeeded")  # the old lower pod's status
    assert not [p for m, p in fake.written if m == "DELETE" and "/configmaps/" in p]


def test_one_lower_pod_watch_feeds_both_the_capacity_and_our_pods_statuses(
    tmp_path: Path,
) -> None:
    """The capacity (pods not ours take room) and our pods' statuses come from one list and
    watch of every lower pod, not from a second watch of ours by label: each event of our pod
    was received and decoded twice."""
    fake = FakeLower()
    fake.nodes = [
        {
            "metadata": {"name": "lower-a", "uid": "n-1"},
            "spec": {},
            "status": {
                "allocatable": {"cpu": "4", "pods": "10"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    ]
    provider = fake.provider(tmp_path)
    reports: list[Pod] = []
    provider.notify_pods(reports.append)
    theirs = {
        "metadata": {"name": "theirs", "namespace": "shop", "uid": "t-1"},
        "spec": {
            "nodeName": "lower-a",
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
        },
        "status": {"phase": "Running"},
    }

    def running() -> bool:
        return any(p.status is not None and p.status.phase == "Running" for p in reports)

    async def scenario() -> None:
        await provider.create_pod(web_0("upper-1"))
        ours = with_phase(fake.pods["web-0"], "Running")
        ours["spec"]["nodeName"] = "lower-a"
        fake.events = [("ADDED", theirs), ("MODIFIED", ours)]
        fake.pods.update({"web-0": ours, "theirs": theirs})  # as the next listing says
        tasks = [
            asyncio.create_task(provider._follow_pods()),
            asyncio.create_task(provider.capacity.run()),
        ]
        try:
            await eventually(
                lambda: (
                    running()
                    and provider.capacity.capacity.allocatable == {"cpu": "3", "pods": "9"}
                ),
                within=10,
                what="our pod Running and the room their pod takes subtracted",
            )
            assert provider.capacity.snapshot is not None
            assert {"t-1", ours["metadata"]["uid"]} <= set(provider.capacity.snapshot["Pod"])
            await eventually(lambda: fake.open_watches["/api/v1/pods"], what="watching again")
            await always(
                lambda: fake.open_watches["/api/v1/pods"] == 1, duration=0.5, what="one pod watch"
            )
        finally:
            for task in tasks:
                task.cancel()
            await provider.aclose()

    asyncio.run(scenario())
    assert sorted(set(fake.watched)) == ["/api/v1/nodes", "/api/v1/pods"]


def test_a_pod_refused_for_good_is_forgotten_when_deleted_and_its_successor_gets_its_copies(
    tmp_path: Path,
) -> None:
    """No lower pod stands for a pod refused with LowerNameConflict, so no lower DELETED event
    ends its deletion: delete_pod reports it stopped at once, and a later pod of its name is
    not left out of the dependency copies (its ConfigMap would never be copied)."""
    fake = FakeLower()
    fake.pods["web-0"] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0"}}
    provider = fake.provider(tmp_path)
    reports: list[Pod] = []
    provider.notify_pods(reports.append)

    async def scenario() -> None:
        refused = web_0("upper-refused")
        with pytest.raises(ProviderError, match="already exists"):
            await provider.create_pod(refused)
        await provider.delete_pod(refused.pod, 0)
        del fake.pods["web-0"]  # the lower cluster's user removed their own pod
        await provider.create_pod(web_0("upper-next", config_map=True))
        await provider.aclose()

    asyncio.run(scenario())
    assert [(p.metadata.uid, p.status.phase) for p in reports if p.metadata and p.status] == [
        ("upper-refused", "Failed")
    ]
    assert ("POST", "/api/v1/namespaces/shop/configmaps") in fake.written
    assert ("POST", "/api/v1/namespaces/shop/pods") in fake.written


def test_after_a_restart_the_copies_of_pods_not_yet_adopted_are_kept_and_adoption_owns_them(
    tmp_path: Path,
) -> None:
    """The restarted agent hands its running pods back one by one (`adopt_pod`): a plan made
    before it is done (another pod's start) must not delete what the others use below."""
    fake = FakeLower()

    async def scenario() -> None:
        first = fake.provider(tmp_path)
        await first.create_pod(web_0("upper-web", config_map=True))
        await first.aclose()
        assert [c["metadata"]["name"] for c in fake.objects["configmaps"]] != []
        restarted = fake.provider(tmp_path)
        assert [p.metadata.name for p in await restarted.list_pods() if p.metadata] == ["web-0"]
        other = msgspec.to_builtins(resolved().pod)
        other["metadata"].update(name="api-0", uid="upper-api")
        await restarted.create_pod(ResolvedPod(msgspec.convert(other, Pod)))  # plans, once
        await restarted.adopt_pod(web_0("upper-web", config_map=True))
        assert "shop/web-0" in restarted._pods
        await restarted.deps.sync(relist=True)  # adopted: its copy is wanted again
        await restarted.aclose()

    asyncio.run(scenario())
    deleted = [path for method, path in fake.written if method == "DELETE"]
    assert not [path for path in deleted if "/configmaps/" in path], deleted
    assert [path for method, path in fake.written if method == "POST" and "/pods" in path] == [
        "/api/v1/namespaces/shop/pods",  # web-0's, before the restart
        "/api/v1/namespaces/shop/pods",  # api-0's; web-0 is not created again
    ]


def test_a_pod_whose_create_failed_holds_nothing_below_once_it_is_deleted_upstairs(
    tmp_path: Path,
) -> None:
    """Its ConfigMap is missing upstairs, so it never starts: deleted then, no `delete_pod`
    comes for it (the agent never ran it), so the provider must not keep it among its pods."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)

    async def scenario() -> None:
        given = web_0("upper-web", config_map=True)
        missing = {**given.references, ("ConfigMap", "shop", "web-config"): None}  # not upstairs
        waiting = dataclasses.replace(given, references=missing)
        with pytest.raises(ProviderError, match="not found") as raised:
            await provider.create_pod(waiting)
        assert not raised.value.permanent  # retried by the agent while the pod exists
        assert "shop/web-0" not in provider._pods
        await provider.aclose()

    asyncio.run(scenario())


def test_a_label_removed_upstairs_is_removed_below_and_the_lower_clusters_own_stay(
    tmp_path: Path,
) -> None:
    """Lower Services select on the pod's labels: a pod taken out of a Service upstairs must
    leave it below too; a label the lower cluster added itself is not ours to remove."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)

    def labelled(labels: dict[str, str]) -> ResolvedPod:
        raw = msgspec.to_builtins(web_0("upper-web").pod)
        raw["metadata"]["labels"] = labels
        return ResolvedPod(msgspec.convert(raw, Pod))

    async def scenario() -> None:
        await provider.create_pod(labelled({"app": "web", "tier": "front"}))
        fake.pods["web-0"]["metadata"]["labels"]["mesh.lower/injected"] = "true"
        await provider.update_pod(labelled({"app": "web"}))
        await provider.aclose()

    asyncio.run(scenario())
    [patch] = [p for p in fake.patches if "labels" in p.get("metadata", {})]
    labels = patch["metadata"]["labels"]
    assert labels["tier"] is None and labels["app"] == "web"
    assert "mesh.lower/injected" not in labels


class ClaimsUpstairs:
    """An `UpperAPI` that answers reads of upper PVCs: name -> UID, or an HTTP status."""

    def __init__(self, answers: dict[str, str | int]) -> None:
        self.answers = answers

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        answer = self.answers[path.rsplit("/", 1)[-1]]
        if isinstance(answer, int):
            raise ApiError(answer, "Forbidden" if answer == 403 else "NotFound", "no")
        return {"metadata": {"uid": answer}}

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        raise AssertionError("no writes upstairs")

    def watch(self, path: str, params: Any, *, timeout_seconds: int) -> Any:
        raise AssertionError("no watches here")


def test_an_unused_lower_claim_is_released_only_once_its_upper_claim_is_known_gone(
    tmp_path: Path,
) -> None:
    """Deleted, or re-created (another UID): released. There, or unreadable (the Node
    authorizer refuses a node the claims of pods it no longer runs): kept."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    answers: dict[str, str | int] = {"gone": 404, "kept": "uid-kept", "hidden": 403, "new": "u2"}
    provider.use_upper_api(ClaimsUpstairs(answers))
    owner = provider.owner
    keys = []
    copies: dict[Any, Any] = {}
    for name, uid in (("gone", "uid-gone"), ("kept", "uid-kept"), ("hidden", "x"), ("new", "u1")):
        key = ("PersistentVolumeClaim", "shop", f"{name}-low")
        body = {"metadata": {"name": f"{name}-low", "namespace": "shop"}}
        copies[key] = stamp(body, owner, namespace="shop", name=name, uid=uid)
        keys.append(key)
    provider.deps.copies = copies
    uids = {key: f"lower-{key[2]}" for key in keys}
    asyncio.run(provider.deps._release_claims(keys, uids))
    released = sorted(path for method, path in fake.written if method == "DELETE")
    assert released == [
        "/api/v1/namespaces/shop/persistentvolumeclaims/gone-low",
        "/api/v1/namespaces/shop/persistentvolumeclaims/new-low",
    ]
    assert sorted(key[2] for key in provider.deps.copies) == ["hidden-low", "kept-low"]


def test_a_pod_whose_lower_pod_vanished_is_forgotten_when_deleted(tmp_path: Path) -> None:
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    reports: list[Pod] = []
    provider.notify_pods(reports.append)

    async def scenario() -> None:
        first = web_0("upper-first")
        await provider.create_pod(first)
        fake.events = [("DELETED", fake.pods.pop("web-0"))]  # evicted below
        follow = asyncio.create_task(provider._follow_pods())
        try:
            async with asyncio.timeout(10):
                await fake.watching_again.wait()
        finally:
            follow.cancel()
        await provider.delete_pod(first.pod, 0)
        await provider.create_pod(web_0("upper-next", config_map=True))
        await provider.aclose()

    asyncio.run(scenario())
    assert ("POST", "/api/v1/namespaces/shop/configmaps") in fake.written
    failed = [p for p in reports if p.metadata and p.metadata.uid == "upper-first"]
    assert failed and failed[-1].status is not None and failed[-1].status.phase == "Failed"


def test_deleting_an_earlier_pod_after_its_successor_was_given_leaves_the_successor_alone(
    tmp_path: Path,
) -> None:
    """The agent may delete the old web-0 after the new one's create began (which found the
    old lower pod and removed it): the new pod stays ours, is not reported stopped, and keeps
    its ConfigMap copy through the next dependency resync."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    reports: list[Pod] = []
    provider.notify_pods(reports.append)

    async def scenario() -> None:
        old, new = web_0("upper-old"), web_0("upper-new", config_map=True)
        await provider.create_pod(old)
        with pytest.raises(ProviderError, match="being removed first"):
            await provider.create_pod(new)
        await provider.delete_pod(old.pod, 0)
        await provider.create_pod(new)  # the agent's retry
        await provider.deps.sync()  # what the periodic resync does
        await provider.aclose()

    asyncio.run(scenario())
    assert not [p for p in reports if p.metadata and p.metadata.uid == "upper-new"]
    assert ("POST", "/api/v1/namespaces/shop/configmaps") in fake.written
    assert not [p for m, p in fake.written if m == "DELETE" and "/configmaps/" in p]
    created = fake.pods["web-0"]["metadata"]["annotations"]["vkubelet.io/upper-uid"]
    assert created == "upper-new"


def test_a_status_the_watch_saw_before_the_create_answered_is_not_rolled_back(
    tmp_path: Path,
) -> None:
    """The lower pod is scheduled and Running within ~100 ms, so the pod watch's events often
    come in before the create's answer (the pod as created, Pending) is processed: that answer
    must not replace what the watch saw (the pod would be reported Pending until the next
    re-list, a minute later)."""
    fake = FakeLower()
    handle = fake.handle

    async def create_then_watch_first(request: httpx.Request) -> httpx.Response:
        response = await handle(request)
        if request.method == "POST" and request.url.path.endswith("/pods"):
            running = with_phase(fake.pods["web-0"], "Running")
            running["metadata"]["resourceVersion"] = fake._next()
            provider._observed("shop/web-0", running)  # the watch, ahead of the answer
        return response

    fake.handle = create_then_watch_first  # type: ignore[method-assign]
    provider = fake.provider(tmp_path)

    async def scenario() -> str | None:
        try:
            await provider.create_pod(web_0("upper-1"))
            status = await provider.get_pod_status("shop", "web-0")
            return None if status is None else status.phase
        finally:
            await provider.aclose()

    assert asyncio.run(scenario()) == "Running"


def test_a_pod_the_lower_watch_does_not_know_is_created_without_reading_first(
    tmp_path: Path,
) -> None:
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    provider._pods_listed = True  # what the pod watch's first listing sets

    async def scenario() -> None:
        try:
            await provider.create_pod(web_0("upper-1"))
        finally:
            await provider.aclose()

    asyncio.run(scenario())
    assert ("POST", "/api/v1/namespaces/shop/pods") in fake.written
    assert fake.pod_reads == 0


def test_deleting_a_pod_whose_lower_pod_is_known_deletes_it_by_uid_without_reading_it(
    tmp_path: Path,
) -> None:
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    provider._pods_listed = True  # what the pod watch's first listing sets

    async def scenario() -> None:
        try:
            pod = web_0("upper-1")
            await provider.create_pod(pod)
            await provider.delete_pod(pod.pod, 30)
        finally:
            await provider.aclose()

    asyncio.run(scenario())
    assert ("DELETE", "/api/v1/namespaces/shop/pods/web-0") in fake.written
    assert "web-0" not in fake.pods
    assert fake.pod_reads == 0


def test_deleting_a_pod_whose_known_lower_copy_is_stale_reads_the_pod_and_spares_another_owners(
    tmp_path: Path,
) -> None:
    """The watch's copy says ours, but the name now holds the lower cluster user's own pod: the
    delete by the copy's UID removes nothing, the pod is read, and it is left alone."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    provider._pods_listed = True
    reports: list[Pod] = []
    provider.notify_pods(reports.append)
    theirs = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "uid": "theirs"}}

    async def scenario() -> None:
        try:
            pod = web_0("upper-1")
            await provider.create_pod(pod)
            fake.pods["web-0"] = theirs  # ours vanished unseen, and the name was taken
            await provider.delete_pod(pod.pod, 30)
        finally:
            await provider.aclose()

    asyncio.run(scenario())
    assert fake.pods["web-0"] is theirs
    assert fake.pod_reads == 1
    assert [p.status.phase for p in reports if p.status] == ["Failed"]  # reported stopped


def test_a_name_taken_below_by_someone_else_is_found_by_the_create_and_left_alone(
    tmp_path: Path,
) -> None:
    fake = FakeLower()
    fake.pods["web-0"] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0"}}
    provider = fake.provider(tmp_path)
    provider._pods_listed = True  # the user's pod carries no stamp: the watch never saw it

    async def scenario() -> ProviderError:
        try:
            with pytest.raises(ProviderError) as raised:
                await provider.create_pod(web_0("upper-1"))
            return raised.value
        finally:
            await provider.aclose()

    error = asyncio.run(scenario())
    assert error.reason == "LowerNameConflict"
    assert fake.pods["web-0"]["metadata"] == {"name": "web-0"}
    assert not any(method in ("DELETE", "PUT", "PATCH") for method, _ in fake.written)


def unschedulable(lower: dict[str, Any]) -> dict[str, Any]:
    changed = with_phase(lower, "Pending")
    changed["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 fit"}
    ]
    return changed


def test_a_pod_unschedulable_below_past_the_timeout_fails_and_its_lower_pod_is_removed(
    tmp_path: Path,
) -> None:
    """The descheduler's outcome without one: a pod the lower scheduler keeps refusing is
    failed upstairs (its controller replaces it) and removed below, with the lower reason; a
    pod scheduled in time is left alone."""
    fake = FakeLower()
    provider = fake.provider(tmp_path)
    provider.config = dataclasses.replace(provider.config, unschedulable_timeout=0.3)
    failed: list[tuple[str, str, str]] = []

    def report(pod: Pod) -> None:
        assert pod.metadata is not None and pod.status is not None
        if pod.status.phase == "Failed":
            failed.append((str(pod.metadata.uid), str(pod.status.reason), str(pod.status.message)))

    async def scenario() -> None:
        provider.notify_pods(report)
        try:
            for uid, name in (("stuck", "web-0"), ("placed", "web-1")):
                pod = msgspec.to_builtins(web_0(uid).pod)
                pod["metadata"]["name"] = name
                await provider.create_pod(ResolvedPod(msgspec.convert(pod, Pod)))
            stuck, placed = fake.pods["web-0"], fake.pods["web-1"]
            provider._observed("shop/web-0", unschedulable(stuck))
            provider._observed("shop/web-1", unschedulable(placed))
            running = with_phase(placed, "Running")
            running["spec"]["nodeName"] = "lower-a"
            provider._observed("shop/web-1", running)  # scheduled within the timeout
            await eventually(lambda: "web-0" not in fake.pods, what="the stuck lower pod removed")
            await eventually(lambda: bool(failed), what="the stuck pod failed")
            # Its lower pod's DELETED event does not turn the reason into "deleted below".
            provider._vanished("shop/web-0", stuck)
            pod = await provider.get_pod("shop", "web-0")
            assert pod is not None and pod.status is not None
            assert pod.status.reason == "LowerClusterUnschedulable"
            await always(lambda: "web-1" in fake.pods, duration=0.6)
        finally:
            await provider.aclose()

    asyncio.run(scenario())
    assert [(uid, reason) for uid, reason, _ in failed][:1] == [
        ("stuck", "LowerClusterUnschedulable")
    ]
    assert "0/3 fit" in failed[0][2]
    assert not [f for f in failed if f[0] == "placed"]


class NodeEvents:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def pod_event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        pass

    def node_event(self, node_name: str, type: str, reason: str, message: str) -> None:
        self.seen.append((reason, message))


def test_zero_capacity_from_tainted_lower_nodes_is_explained_once_per_change(
    tmp_path: Path,
) -> None:
    """A new user's lower cluster of default mock nodes (tainted NoSchedule): the virtual node
    gets no capacity, and a Warning names the nodes instead of a bare "Too many pods"."""
    events = NodeEvents()
    provider = FakeLower().provider(tmp_path, events)
    tainted = {
        "metadata": {"name": "mock-1"},
        "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "effect": "NoSchedule"}]},
        "status": {
            "allocatable": {"cpu": "4", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    nothing = lower_capacity([tainted], [], lambda p: False)
    provider.capacity._explain_no_usable_node([tainted], nothing)
    provider.capacity._explain_no_usable_node([tainted], nothing)  # the same state: said once
    assert [reason for reason, _ in events.seen] == ["NoUsableLowerNode"]
    assert "mock-1" in events.seen[0][1]
    untainted = {**tainted, "spec": {}}
    provider.capacity._explain_no_usable_node(
        [untainted], lower_capacity([untainted], [], lambda p: False)
    )
    provider.capacity._explain_no_usable_node([tainted], nothing)  # tainted again: said again
    assert len(events.seen) == 2
