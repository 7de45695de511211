"""Which ConfigMaps and Secrets a pod depends on, so their changes can be pushed to providers."""

from __future__ import annotations

from typing import Any

from vkubelet.node.resolve import pass_through_references, referenced_objects

from .fakes import pod


def full_pod() -> dict[str, object]:
    return pod(
        containers=[
            {
                "name": "app",
                "envFrom": [{"configMapRef": {"name": "env-cm"}}, {"secretRef": {"name": "env-s"}}],
                "env": [
                    {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "key-cm", "key": "a"}}},
                    {"name": "B", "valueFrom": {"secretKeyRef": {"name": "key-s", "key": "b"}}},
                    {"name": "C", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "D", "value": "literal"},
                ],
            }
        ],
        initContainers=[
            {"name": "init", "envFrom": [{"secretRef": {"name": "init-s", "optional": True}}]}
        ],
        ephemeralContainers=[
            {"name": "debug", "envFrom": [{"configMapRef": {"name": "debug-cm"}}]}
        ],
        volumes=[
            {"name": "v1", "configMap": {"name": "vol-cm"}},
            {"name": "v2", "secret": {"secretName": "vol-s"}},
            {
                "name": "v3",
                "projected": {
                    "sources": [
                        {"configMap": {"name": "kube-root-ca.crt"}},
                        {"secret": {"name": "proj-s"}},
                        {"serviceAccountToken": {"path": "token"}},
                    ]
                },
            },
            {"name": "v4", "emptyDir": {}},
        ],
    )


VOLUME_REFS = {
    ("ConfigMap", "shop", "vol-cm"),
    ("Secret", "shop", "vol-s"),
    ("ConfigMap", "shop", "kube-root-ca.crt"),
    ("Secret", "shop", "proj-s"),
}
ENV_REFS = {
    ("ConfigMap", "shop", "env-cm"),
    ("Secret", "shop", "env-s"),
    ("ConfigMap", "shop", "key-cm"),
    ("Secret", "shop", "key-s"),
    ("Secret", "shop", "init-s"),
    ("ConfigMap", "shop", "debug-cm"),
}


def test_every_config_map_and_secret_a_pod_reads_is_referenced() -> None:
    assert referenced_objects(full_pod()) == VOLUME_REFS | ENV_REFS


def test_only_live_updatable_volume_sources_can_be_asked_for() -> None:
    assert referenced_objects(full_pod(), include_env=False) == VOLUME_REFS
    assert referenced_objects(full_pod(), include_volumes=False) == ENV_REFS


def test_a_pod_without_references_has_none() -> None:
    assert referenced_objects(pod()) == set()


def test_a_pass_through_provider_is_given_every_object_the_node_may_read_for_the_pod() -> None:
    raw = full_pod()
    spec: dict[str, Any] = raw["spec"]  # type: ignore[assignment]
    spec["imagePullSecrets"] = [{"name": "registry"}, {"name": ""}]
    spec["volumes"] += [
        {"name": "data", "persistentVolumeClaim": {"claimName": "data-0"}},
        {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
    ]
    assert pass_through_references(raw) == VOLUME_REFS | ENV_REFS | {
        ("Secret", "shop", "registry"),
        ("ServiceAccount", "shop", "app"),
        ("PersistentVolumeClaim", "shop", "data-0"),
        ("PersistentVolumeClaim", "shop", "web-0-scratch"),  # <pod>-<volume>, as the kubelet
    }


def test_a_pod_without_a_service_account_name_references_the_default_one() -> None:
    raw = pod()
    del raw["spec"]["serviceAccountName"]
    assert pass_through_references(raw) == {("ServiceAccount", "shop", "default")}
