"""Service-link variables (pkg/kubelet/envvars): which services a pod sees, and their names."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.node.resolve import EnvResolutionError, resolve_env

from .fakes import ALLOCATABLE, KUBERNETES, FakeSources, pod, service

KUBERNETES_VARS = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "KUBERNETES_SERVICE_PORT_HTTPS": "443",
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
    "KUBERNETES_PORT_443_TCP_PORT": "443",
    "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
}


def env_of(sources: FakeSources, **pod_spec: Any) -> dict[str, str]:
    the_pod = pod(**pod_spec)
    container = the_pod["spec"]["containers"][0]
    return resolve_env(the_pod, container, sources, node_allocatable=ALLOCATABLE).as_dict()


def test_kubernetes_service_is_always_linked_even_with_service_links_disabled() -> None:
    sources = FakeSources(services=[KUBERNETES, service("cart", "10.96.5.5")])
    assert env_of(sources, enableServiceLinks=False) == KUBERNETES_VARS


def test_same_namespace_services_are_linked_with_docker_style_variables() -> None:
    redis = service(
        "redis-primary",
        "10.96.7.7",
        [
            {"name": "redis", "port": 6379},
            {"name": "metrics-http", "port": 9121, "protocol": "TCP"},
            {"name": "gossip", "port": 7946, "protocol": "UDP"},
        ],
    )
    env = env_of(FakeSources(services=[KUBERNETES, redis]))
    assert {k: v for k, v in env.items() if k.startswith("REDIS_PRIMARY")} == {
        "REDIS_PRIMARY_SERVICE_HOST": "10.96.7.7",
        "REDIS_PRIMARY_SERVICE_PORT": "6379",
        "REDIS_PRIMARY_SERVICE_PORT_REDIS": "6379",
        "REDIS_PRIMARY_SERVICE_PORT_METRICS_HTTP": "9121",
        "REDIS_PRIMARY_SERVICE_PORT_GOSSIP": "7946",
        "REDIS_PRIMARY_PORT": "tcp://10.96.7.7:6379",
        "REDIS_PRIMARY_PORT_6379_TCP": "tcp://10.96.7.7:6379",
        "REDIS_PRIMARY_PORT_6379_TCP_PROTO": "tcp",
        "REDIS_PRIMARY_PORT_6379_TCP_PORT": "6379",
        "REDIS_PRIMARY_PORT_6379_TCP_ADDR": "10.96.7.7",
        "REDIS_PRIMARY_PORT_9121_TCP": "tcp://10.96.7.7:9121",
        "REDIS_PRIMARY_PORT_9121_TCP_PROTO": "tcp",
        "REDIS_PRIMARY_PORT_9121_TCP_PORT": "9121",
        "REDIS_PRIMARY_PORT_9121_TCP_ADDR": "10.96.7.7",
        "REDIS_PRIMARY_PORT_7946_UDP": "udp://10.96.7.7:7946",
        "REDIS_PRIMARY_PORT_7946_UDP_PROTO": "udp",
        "REDIS_PRIMARY_PORT_7946_UDP_PORT": "7946",
        "REDIS_PRIMARY_PORT_7946_UDP_ADDR": "10.96.7.7",
    }


@pytest.mark.parametrize("cluster_ip", ["None", ""])
def test_headless_and_external_name_services_are_not_linked(cluster_ip: str) -> None:
    headless = service("db", cluster_ip)
    env = env_of(FakeSources(services=[KUBERNETES, headless]))
    assert not any(name.startswith("DB_") for name in env)


def test_services_of_other_namespaces_are_not_linked() -> None:
    elsewhere = service("cart", "10.96.5.5", namespace="other")
    assert env_of(FakeSources(services=[KUBERNETES, elsewhere])) == KUBERNETES_VARS


def test_default_namespace_pods_with_links_disabled_see_only_the_kubernetes_service() -> None:
    neighbour = service("cart", "10.96.5.5", namespace="default")
    sources = FakeSources(services=[KUBERNETES, neighbour])
    assert env_of(sources, namespace="default", enableServiceLinks=False) == KUBERNETES_VARS
    assert "CART_SERVICE_HOST" in env_of(sources, namespace="default")


def test_a_same_namespace_service_named_kubernetes_wins_over_the_master_one() -> None:
    local = service("kubernetes", "10.96.9.9", [{"port": 8443}])
    env = env_of(FakeSources(services=[KUBERNETES, local]))
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.9.9"
    assert (
        env_of(FakeSources(services=[KUBERNETES, local]), enableServiceLinks=False)[
            "KUBERNETES_SERVICE_HOST"
        ]
        == "10.96.0.1"
    )


def test_master_services_namespace_is_configurable() -> None:
    relocated = service("kubernetes", "10.0.0.1", [{"port": 6443}], namespace="control")
    the_pod = pod()
    container = the_pod["spec"]["containers"][0]
    env = resolve_env(
        the_pod,
        container,
        FakeSources(services=[KUBERNETES, relocated]),
        node_allocatable=ALLOCATABLE,
        master_services_namespace="control",
    ).as_dict()
    assert env["KUBERNETES_SERVICE_HOST"] == "10.0.0.1"


def test_ipv6_cluster_ips_are_bracketed_in_urls() -> None:
    v6 = service("api", "fd00:10:96::a", [{"port": 80}])
    env = env_of(FakeSources(services=[v6]))
    assert env["API_PORT"] == "tcp://[fd00:10:96::a]:80"
    assert env["API_PORT_80_TCP_ADDR"] == "fd00:10:96::a"


def test_container_variables_shadow_service_variables_which_remain_referenceable() -> None:
    the_pod = pod(
        containers=[
            {
                "name": "app",
                "env": [
                    {"name": "KUBERNETES_SERVICE_PORT", "value": "1"},
                    {"name": "API", "value": "https://$(KUBERNETES_SERVICE_HOST)"},
                ],
            }
        ]
    )
    container = the_pod["spec"]["containers"][0]
    env = resolve_env(
        the_pod, container, FakeSources(services=[KUBERNETES]), node_allocatable=ALLOCATABLE
    ).as_dict()
    assert env["KUBERNETES_SERVICE_PORT"] == "1"
    assert env["API"] == "https://10.96.0.1"


def test_services_that_cannot_be_listed_fail_the_container() -> None:
    with pytest.raises(EnvResolutionError, match="failed to list services"):
        env_of(FakeSources(services_unreadable=True))
