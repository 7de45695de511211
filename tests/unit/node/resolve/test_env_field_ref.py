"""Downward API env vars: every fieldPath the kubelet supports resolves, including the status.*
ones the reference virtual-kubelet fails pods over."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.node.resolve import EnvResolutionError, resolve_env

from .fakes import ALLOCATABLE, FakeSources, pod


def field_env(field_path: str, *, api_version: str | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"fieldPath": field_path}
    if api_version is not None:
        ref["apiVersion"] = api_version
    return {"name": "app", "env": [{"name": "V", "valueFrom": {"fieldRef": ref}}]}


def value_of(field_path: str, the_pod: dict[str, Any] | None = None, **kwargs: Any) -> str:
    container = field_env(field_path)
    env = resolve_env(
        the_pod or pod(), container, FakeSources(), node_allocatable=ALLOCATABLE, **kwargs
    ).as_dict()
    return env["V"]


@pytest.mark.parametrize(
    ("field_path", "expected"),
    [
        ("metadata.name", "web-0"),
        ("metadata.namespace", "shop"),
        ("metadata.uid", "6f1c2b9e-0000-4000-8000-000000000001"),
        ("metadata.labels", 'app="web"\ntier="front"'),
        ("metadata.annotations", 'owner="team-a"'),
        ("metadata.labels['tier']", "front"),
        ("metadata.annotations['owner']", "team-a"),
        ("metadata.labels['absent']", ""),
        ("spec.nodeName", "virtual-node"),
        ("spec.host", "virtual-node"),
        ("spec.serviceAccountName", "app"),
        ("status.hostIP", "192.168.0.10"),
        ("status.hostIPs", "192.168.0.10"),
        ("status.podIP", "10.244.1.7"),
        ("status.podIPs", "10.244.1.7"),
    ],
)
def test_every_supported_field_path_resolves(field_path: str, expected: str) -> None:
    assert value_of(field_path) == expected


def test_status_pod_ip_env_var_resolves_instead_of_failing_the_pod() -> None:
    assert value_of("status.podIP", pod_ips=["10.0.0.5"], host_ips=["192.168.0.10"]) == "10.0.0.5"


def test_status_host_ip_env_var_resolves_instead_of_failing_the_pod() -> None:
    assert value_of("status.hostIP", host_ips=["172.16.0.2", "fd00::2"]) == "172.16.0.2"
    assert value_of("status.hostIPs", host_ips=["172.16.0.2", "fd00::2"]) == "172.16.0.2,fd00::2"


def test_dual_stack_pod_ips_put_the_node_family_first() -> None:
    ips = ["fd00::7", "10.244.1.7", "10.244.1.8"]
    assert value_of("status.podIPs", pod_ips=ips, host_ips=["192.168.0.10"]) == (
        "10.244.1.7,fd00::7"
    )
    assert value_of("status.podIP", pod_ips=ips, host_ips=["fd00::10"]) == "fd00::7"


def test_pod_ips_come_from_the_pod_status_when_the_provider_does_not_pass_them() -> None:
    the_pod = pod()
    the_pod["status"] = {"podIP": "10.1.1.1", "hostIP": "192.168.9.9"}
    assert value_of("status.podIPs", the_pod) == "10.1.1.1"
    assert value_of("status.hostIPs", the_pod) == "192.168.9.9"


def test_pod_ip_before_the_pod_has_one_is_empty() -> None:
    the_pod = pod()
    the_pod["status"] = {}
    assert value_of("status.podIP", the_pod, host_ips=["192.168.0.10"]) == ""


def test_unknown_host_ip_fails_instead_of_resolving_to_nothing() -> None:
    the_pod = pod()
    the_pod["status"] = {}
    with pytest.raises(EnvResolutionError, match="host IP"):
        value_of("status.hostIP", the_pod)


def test_label_values_are_quoted_as_go_does() -> None:
    the_pod = pod()
    the_pod["metadata"]["labels"] = {
        "b": 'say "hi"\n',
        "a": "naïve\u200b\x00\x7f\U0001f600",
    }
    assert value_of("metadata.labels", the_pod) == (
        'a="naïve\\u200b\\x00\\x7f\U0001f600"\nb="say \\"hi\\"\\n"'
    )


@pytest.mark.parametrize(
    ("field_path", "message"),
    [
        ("status.phase", "unsupported fieldPath: status.phase"),
        ("spec.restartPolicy", "unsupported fieldPath"),
        ("spec.schedulerName", "unsupported fieldPath"),
        ("metadata.generateName", "field label not supported"),
        ("metadata.name['x']", "does not support subscript"),
        ("metadata.labels['-bad-']", "invalid key subscript"),
        ("metadata.annotations['a/b/c']", "invalid key subscript"),
    ],
)
def test_field_paths_the_kubelet_refuses_fail_the_container(field_path: str, message: str) -> None:
    with pytest.raises(EnvResolutionError, match=message) as caught:
        value_of(field_path)
    assert caught.value.variable == "env var 'V'"


def test_only_api_version_v1_is_understood() -> None:
    container = field_env("metadata.name", api_version="v2")
    with pytest.raises(EnvResolutionError, match="unsupported pod version: v2"):
        resolve_env(pod(), container, FakeSources(), node_allocatable=ALLOCATABLE)
