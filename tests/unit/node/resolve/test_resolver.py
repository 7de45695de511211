"""The agent's resolver against the fake apiserver: what a provider is handed (expanded command
lines, or for a pass-through provider the pod as written and its referenced objects), what it
costs (service links once per pod), and which watches it keeps open."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ResolvedPod
from vkubelet.node._objects import ObjectCache
from vkubelet.node._resolution import Resolver, ServiceCache
from vkubelet.testing.fakeapi import JSON, FakeApiServer

from ..helpers import (
    ALLOCATABLE,
    HOST_IP,
    NS,
    PodHarness,
    PushProvider,
    always,
    configmap,
    eventually,
    phase_of,
    pod,
    status_of,
    terminated_status,
)
from .fakes import b64


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


@pytest.fixture
def push() -> PushProvider:
    return PushProvider()


@pytest.fixture
async def node(api: FakeApiServer, push: PushProvider) -> AsyncIterator[PodHarness]:
    async with PodHarness(api, push) as harness:
        yield harness


def running(api: FakeApiServer, name: str) -> bool:
    return phase_of(api, name) == "Running"


def secret(name: str, data: dict[str, bytes]) -> JSON:
    return {
        "metadata": {"name": name, "namespace": NS},
        "data": {k: b64(v) for k, v in data.items()},
    }


def service(name: str, ip: str, *, namespace: str = NS) -> JSON:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": ip, "ports": [{"port": 80, "protocol": "TCP"}]},
    }


# -- $(VAR) in command and args -------------------------------------------------------------------
async def test_providers_receive_command_and_args_with_var_references_expanded(
    api: FakeApiServer, push: PushProvider, node: PodHarness
) -> None:
    raw = pod("web")
    raw["spec"]["containers"][0].update(
        command=["sh", "-c", 'echo "name=$(POD_NAME)"'],
        args=["$(GREETING)", "$$(POD_NAME)", "$(UNDEFINED)"],
        env=[
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hello $(POD_NAME)"},
        ],
    )
    api.create("pods", raw)
    await eventually(lambda: running(api, "web"))
    spec = push.resolved[f"{NS}/web"].pod.spec
    assert spec is not None
    container = spec.containers[0]
    assert container.command == ["sh", "-c", 'echo "name=web"']
    # `$$` escapes, an unknown reference stays as written (the kubelet's rules)
    assert container.args == ["hello web", "$(POD_NAME)", "$(UNDEFINED)"]


# -- service links ----------------------------------------------------------------------------
class CountingServiceCache(ServiceCache):
    """Counts namespace listings, lookups by name, and Service conversions to JSON."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.listed: list[str] = []
        self.looked_up: list[tuple[str, str]] = []
        self.converted = 0

    def _put(self, service: Any) -> None:
        self.converted += 1
        super()._put(service)

    def get(self, namespace: str, name: str) -> JSON | None:
        self.looked_up.append((namespace, name))
        return super().get(namespace, name)

    def in_namespace(self, namespace: str) -> list[JSON]:
        self.listed.append(namespace)
        return super().in_namespace(namespace)


@pytest.fixture
async def counted(api: FakeApiServer) -> AsyncIterator[tuple[Resolver, CountingServiceCache]]:
    client = api.client()
    services = CountingServiceCache(client)
    objects = ObjectCache(client, lambda *_: None)
    resolver = Resolver(
        client,
        objects,
        object(),
        services,
        host_ip=HOST_IP,
        allocatable=lambda: dict(ALLOCATABLE),
    )
    yield resolver, services
    if services._task is not None:
        services._task.cancel()
        await asyncio.gather(services._task, return_exceptions=True)
    await objects.aclose()
    await client.aclose()


def three_container_pod(name: str, *, links: bool) -> Pod:
    raw = pod(name, containers=[{"name": f"c{i}", "image": "app"} for i in range(3)])
    raw["metadata"]["uid"] = f"uid-{name}"
    raw["spec"]["enableServiceLinks"] = links
    return msgspec.convert(raw, Pod)


def env_of(resolved: ResolvedPod, index: int) -> dict[str, str]:
    assert resolved.pod.spec is not None
    return {e.name: e.value or "" for e in resolved.pod.spec.containers[index].env or []}


async def test_service_links_are_derived_once_per_namespace_until_a_service_changes(
    api: FakeApiServer, counted: tuple[Resolver, CountingServiceCache]
) -> None:
    resolver, services = counted
    api.create("services", service("kubernetes", "10.96.0.1", namespace="default"))
    for i in range(20):
        api.create("services", service(f"svc-{i}", f"10.96.1.{i}"))
        api.create("services", service(f"other-{i}", f"10.96.2.{i}", namespace="elsewhere"))
    for name in ("a", "b"):
        resolved = (
            await resolver.resolve(f"{NS}/{name}", three_container_pod(name, links=True))
        ).pod
        for index in range(3):
            env = env_of(resolved, index)
            assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"
            assert env["SVC_7_SERVICE_HOST"] == "10.96.1.7"
            assert "OTHER_7_SERVICE_HOST" not in env
    assert services.listed == [NS], "one listing of the namespace for both pods"
    assert services.looked_up == [("default", "kubernetes")]
    assert services.converted == 41, "each Service converted once, when it was seen"
    api.create("services", service("late", "10.96.3.1"))
    await eventually(lambda: services.converted == 42, what="the new Service seen")
    resolved = (await resolver.resolve(f"{NS}/c", three_container_pod("c", links=True))).pod
    assert env_of(resolved, 0)["LATE_SERVICE_HOST"] == "10.96.3.1"
    assert services.listed == [NS, NS], "listed again after the change"


async def test_service_links_disabled_lists_no_services_but_keeps_the_master_service(
    api: FakeApiServer, counted: tuple[Resolver, CountingServiceCache]
) -> None:
    resolver, services = counted
    api.create("services", service("kubernetes", "10.96.0.1", namespace="default"))
    api.create("services", service("db", "10.96.1.1"))
    resolved = (await resolver.resolve(f"{NS}/a", three_container_pod("a", links=False))).pod
    for index in range(3):
        env = env_of(resolved, index)
        assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"
        assert "DB_SERVICE_HOST" not in env
    assert services.listed == []
    assert services.looked_up == [("default", "kubernetes")]


# -- watches of terminal pods -----------------------------------------------------------------
async def test_a_pod_that_has_terminated_closes_the_watch_of_the_configmap_it_used(
    api: FakeApiServer, push: PushProvider, node: PodHarness
) -> None:
    api.create("configmaps", configmap("conf", {"level": "info"}))
    api.create("configmaps", configmap("shared", {"level": "info"}))
    for name, maps in (("job", ["conf", "shared"]), ("server", ["shared"])):
        raw = pod(name, restart_policy="Never")
        raw["spec"]["volumes"] = [{"name": m, "configMap": {"name": m}} for m in maps]
        api.create("pods", raw)
    await eventually(lambda: running(api, "job") and running(api, "server"))
    assert api.watch_count("configmaps") == 2
    assert len(node.controller.objects) == 2

    job = push.pods[f"{NS}/job"]
    job.status = msgspec.convert(terminated_status(msgspec.to_builtins(job.status)), PodStatus)
    push.report(f"{NS}/job")
    await eventually(lambda: phase_of(api, "job") == "Succeeded")
    await eventually(lambda: api.watch_count("configmaps") == 1, what="the job's watch to close")
    assert len(node.controller.objects) == 1, "the server still uses `shared`"
    # and it stays closed: nothing re-opens it while the terminal pod lingers in the API
    lists = len(api.calls_to("GET", f"/namespaces/{NS}/configmaps$"))
    api.patch("configmaps", "conf", {"data": {"level": "debug"}}, NS)
    await always(lambda: api.watch_count("configmaps") == 1, duration=0.5)
    assert len(api.calls_to("GET", f"/namespaces/{NS}/configmaps$")) == lists
    assert push.count("update") == 0


# -- secrets that cannot be environment variables ---------------------------------------------
async def test_a_non_utf8_secret_fails_the_pod_once_and_its_value_reaches_no_status_event_or_log(
    api: FakeApiServer, push: PushProvider, node: PodHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    emitted: list[tuple[str, str]] = []
    emit = node.events.emit

    def spy(ref: Any, type: str, reason: str, message: str) -> None:
        emitted.append((reason, message))
        emit(ref, type, reason, message)

    node.events.emit = spy  # type: ignore[method-assign]
    value = b"\xff\xfehunter2-\xc3\x28"
    api.create("secrets", secret("creds", {"password": value, "user": b"admin"}))
    raw = pod("web")
    raw["spec"]["containers"][0]["env"] = [
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}
    ]
    api.create("pods", raw)

    def waiting() -> JSON:
        statuses = status_of(api, "web").get("containerStatuses") or []
        found: JSON = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return found

    await eventually(lambda: waiting().get("reason") == "CreateContainerConfigError")
    message = waiting()["message"]
    assert "secret \"shop/creds\" key 'password'" in message
    assert "is not valid UTF-8 and cannot be an environment variable" in message
    # permanent: not retried (each retry would emit its event again) while the Secret stays so
    await always(lambda: len(emitted) == 1, duration=1.0, what="a single attempt")
    assert push.count("create") == 0

    leaked = ("hunter2", value.decode("utf-8", "surrogateescape"), b64(value))
    texts = [msgspec.json.encode(api.get("pods", "web")).decode()]
    texts += [msgspec.json.encode(e).decode() for e in api.objects("events", NS)]
    texts += [m for _, m in emitted] + [r.getMessage() for r in caplog.records]
    for text in texts:
        assert not any(secret_text in text for secret_text in leaked), text

    # fixing the Secret is all it takes: its watch re-syncs the pod
    api.patch("secrets", "creds", {"data": {"password": b64("hunter3")}}, NS)
    await eventually(lambda: running(api, "web"), what="the pod to start once the Secret is valid")
    assert env_of(push.resolved[f"{NS}/web"], 0)["PW"] == "hunter3"


# -- pass-through pods ------------------------------------------------------------------------
class PassThroughProvider(PushProvider):
    pass_through = True


def pass_through_pod() -> JSON:
    raw = pod(
        "web",
        volumes=[
            {"name": "conf", "configMap": {"name": "conf"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "certs", "projected": {"sources": [{"secret": {"name": "tls"}}]}},
        ],
    )
    raw["spec"]["serviceAccountName"] = "app"
    raw["spec"]["imagePullSecrets"] = [{"name": "registry"}]
    raw["spec"]["containers"][0].update(
        command=["run", "$(LEVEL)"],
        env=[
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "pw"}}},
            {"name": "LEVEL", "value": "$(PW)"},
        ],
        envFrom=[{"configMapRef": {"name": "env"}}],
    )
    return raw


def named(name: str, **fields: Any) -> JSON:
    return {"metadata": {"name": name, "namespace": NS}, **fields}


async def test_a_pass_through_provider_gets_the_pod_as_written_and_the_objects_it_references(
    api: FakeApiServer,
) -> None:
    provider = PassThroughProvider()
    api.create("configmaps", configmap("conf", {"level": "info"}))
    api.create("configmaps", configmap("env", {"MODE": "prod"}))
    api.create("secrets", secret("creds", {"pw": b"hunter2"}))
    api.create("secrets", secret("tls", {"tls.key": b"KEY"}))
    api.create("serviceaccounts", named("app"))
    # the image pull Secret and the claim do not exist (yet): the provider decides
    raw = pass_through_pod()
    async with PodHarness(api, provider) as harness:
        harness.controller.objects._poll_interval = 0.1
        api.create("pods", raw)
        await eventually(lambda: running(api, "web"))
        given = provider.resolved[f"{NS}/web"]
        spec = msgspec.to_builtins(given.pod.spec)
        container = spec["containers"][0]
        assert container["env"] == raw["spec"]["containers"][0]["env"], "references unresolved"
        assert container["envFrom"] == raw["spec"]["containers"][0]["envFrom"]
        assert container["command"] == ["run", "$(LEVEL)"], "not even expanded"
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert [v["name"] for v in spec["volumes"]] == ["conf", "data", "certs"]
        assert given.volumes == {}
        assert "hunter2" not in msgspec.json.encode(given.pod).decode()
        assert set(given.references) == {
            ("ConfigMap", NS, "conf"),
            ("ConfigMap", NS, "env"),
            ("Secret", NS, "creds"),
            ("Secret", NS, "tls"),
            ("Secret", NS, "registry"),
            ("ServiceAccount", NS, "app"),
            ("PersistentVolumeClaim", NS, "data"),
        }
        creds = given.references[("Secret", NS, "creds")]
        assert creds is not None and creds["data"] == {"pw": b64("hunter2")}
        assert given.references[("Secret", NS, "registry")] is None
        assert given.references[("PersistentVolumeClaim", NS, "data")] is None
        # only objects named by the pod were read, each by name
        assert not api.calls_to("GET", f"/namespaces/{NS}/serviceaccounts$")
        watches = api.calls_to("GET", f"/namespaces/{NS}/secrets$", watch=True)
        assert {w.params["fieldSelector"] for w in watches} == {
            f"metadata.name={n}" for n in ("creds", "tls", "registry")
        }

        # a change to any referenced object is an update_pod with the new copy
        api.patch("secrets", "creds", {"data": {"pw": b64("hunter3")}}, NS)
        await eventually(lambda: provider.count("update") == 1, what="update after the Secret")
        creds = provider.resolved[f"{NS}/web"].references[("Secret", NS, "creds")]
        assert creds is not None and creds["data"] == {"pw": b64("hunter3")}
        api.patch("configmaps", "env", {"data": {"MODE": "dev"}}, NS)
        await eventually(lambda: provider.count("update") == 2, what="update after the ConfigMap")
        api.create("persistentvolumeclaims", named("data", spec={"volumeName": "pv-1"}))
        await eventually(lambda: provider.count("update") == 3, what="update after the claim")
        claim = provider.resolved[f"{NS}/web"].references[("PersistentVolumeClaim", NS, "data")]
        assert claim is not None and claim["spec"] == {"volumeName": "pv-1"}
        # polling an unchanged object is not a change
        await always(lambda: provider.count("update") == 3, duration=0.5)
        assert provider.count("create") == 1
