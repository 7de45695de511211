"""resourceFieldRef env vars: divisors, ceilings, and unset limits defaulting to what the
container could actually use (node allocatable, or pod-level limits)."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.node.resolve import EnvResolutionError, resolve_env

from .fakes import ALLOCATABLE, FakeSources, pod

RESOURCES = {
    "limits": {
        "cpu": "1500m",
        "memory": "64Mi",
        "ephemeral-storage": "1Gi",
        "hugepages-2Mi": "4Mi",
    },
    "requests": {"cpu": "250m", "memory": "100M", "ephemeral-storage": "512Mi"},
}


def resource_env(
    resource: str,
    divisor: str | None = None,
    *,
    resources: dict[str, Any] | None = None,
    container_name: str | None = None,
    the_pod: dict[str, Any] | None = None,
    allocatable: dict[str, Any] | None = None,
) -> str:
    ref: dict[str, Any] = {"resource": resource}
    if divisor is not None:
        ref["divisor"] = divisor
    if container_name is not None:
        ref["containerName"] = container_name
    container = {
        "name": "app",
        "resources": RESOURCES if resources is None else resources,
        "env": [{"name": "V", "valueFrom": {"resourceFieldRef": ref}}],
    }
    the_pod = the_pod or pod(containers=[container])
    result = resolve_env(
        the_pod,
        container,
        FakeSources(),
        node_allocatable=ALLOCATABLE if allocatable is None else allocatable,
    )
    return result.as_dict()["V"]


@pytest.mark.parametrize(
    ("resource", "divisor", "expected"),
    [
        ("limits.cpu", None, "2"),
        ("limits.cpu", "1", "2"),
        ("limits.cpu", "1m", "1500"),
        ("requests.cpu", None, "1"),
        ("requests.cpu", "1m", "250"),
        ("limits.memory", None, str(64 * 2**20)),
        ("limits.memory", "1Mi", "64"),
        ("limits.memory", "1M", "68"),
        ("requests.memory", "1Mi", "96"),
        ("requests.memory", "1k", "100000"),
        ("limits.ephemeral-storage", "1Gi", "1"),
        ("requests.ephemeral-storage", "1Gi", "1"),
        ("requests.ephemeral-storage", "1Mi", "512"),
        ("limits.hugepages-2Mi", "2Mi", "2"),
        ("requests.hugepages-2Mi", "2Mi", "0"),
        ("limits.cpu", "0", "2"),
    ],
)
def test_resource_values_are_divided_and_rounded_up(
    resource: str, divisor: str | None, expected: str
) -> None:
    assert resource_env(resource, divisor) == expected


@pytest.mark.parametrize(
    ("resource", "divisor", "expected"),
    [
        ("limits.cpu", "1m", "4000"),
        ("limits.memory", "1Gi", "16"),
        ("limits.ephemeral-storage", "1Gi", "100"),
        ("requests.cpu", None, "0"),
        ("limits.hugepages-1Gi", None, "0"),
    ],
)
def test_unset_limits_default_to_node_allocatable_but_requests_do_not(
    resource: str, divisor: str | None, expected: str
) -> None:
    assert resource_env(resource, divisor, resources={}) == expected


def test_zero_limit_is_treated_as_unset() -> None:
    assert resource_env("limits.cpu", resources={"limits": {"cpu": "0"}}) == "4"


def test_unset_limit_without_allocatable_reads_as_zero() -> None:
    assert resource_env("limits.memory", resources={}, allocatable={}) == "0"


def test_pod_level_limits_bound_containers_without_their_own() -> None:
    container = {
        "name": "app",
        "env": [{"name": "V", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
    }
    the_pod = pod(containers=[container], resources={"limits": {"cpu": "2", "memory": "1Gi"}})
    env = resolve_env(the_pod, container, FakeSources(), node_allocatable=ALLOCATABLE)
    assert env.as_dict()["V"] == "2"


def test_container_name_reads_another_containers_defaulted_limits() -> None:
    sidecar = {"name": "sidecar", "resources": {"limits": {"memory": "128Mi"}}}
    container = {
        "name": "app",
        "env": [
            {
                "name": "V",
                "valueFrom": {
                    "resourceFieldRef": {"containerName": "sidecar", "resource": "limits.cpu"}
                },
            },
            {
                "name": "M",
                "valueFrom": {
                    "resourceFieldRef": {
                        "containerName": "sidecar",
                        "resource": "limits.memory",
                        "divisor": "1Mi",
                    }
                },
            },
        ],
    }
    the_pod = pod(containers=[container, sidecar])
    env = resolve_env(the_pod, container, FakeSources(), node_allocatable=ALLOCATABLE).as_dict()
    assert (env["V"], env["M"]) == ("4", "128")


def test_init_container_named_by_container_name_is_not_defaulted_like_the_kubelet() -> None:
    init = {"name": "init", "resources": {}}
    container = {
        "name": "app",
        "env": [
            {
                "name": "V",
                "valueFrom": {
                    "resourceFieldRef": {"containerName": "init", "resource": "limits.cpu"}
                },
            }
        ],
    }
    the_pod = pod(containers=[container], initContainers=[init])
    env = resolve_env(the_pod, container, FakeSources(), node_allocatable=ALLOCATABLE)
    assert env.as_dict()["V"] == "0"


def test_the_init_container_being_started_is_defaulted() -> None:
    init = {
        "name": "init",
        "env": [{"name": "V", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
    }
    the_pod = pod(initContainers=[init])
    env = resolve_env(the_pod, init, FakeSources(), node_allocatable=ALLOCATABLE)
    assert env.as_dict()["V"] == "4"


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ({"resource": "limits.nvidia.com/gpu"}, "unsupported container resource"),
        ({"resource": "cpu"}, "unsupported container resource"),
        ({"resource": "limits.cpu", "containerName": "ghost"}, "container ghost not found"),
        ({"resource": "limits.cpu", "divisor": "1x"}, "divisor"),
    ],
)
def test_bad_resource_references_fail_the_container(ref: dict[str, Any], message: str) -> None:
    container = {"name": "app", "env": [{"name": "V", "valueFrom": {"resourceFieldRef": ref}}]}
    with pytest.raises(EnvResolutionError, match=message):
        resolve_env(
            pod(containers=[container]), container, FakeSources(), node_allocatable=ALLOCATABLE
        )
