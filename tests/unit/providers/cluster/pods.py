"""Upper pods as the upper apiserver stores them (admission applied), for the translation tests."""

from __future__ import annotations

import copy
from typing import Any

from vkubelet.providers.cluster import Owner, PodTranslation

JSON = dict[str, Any]

OWNER = Owner("upper-a", "vk-lower")
OTHER = Owner("upper-b", "vk-lower")
VIRTUAL_LABELS = {
    "type": "virtual-kubelet",
    "kubernetes.io/role": "agent",
    "kubernetes.io/hostname": "vk-lower",
}

TOKEN_VOLUME = {
    "name": "kube-api-access-x7k2p",
    "projected": {
        "defaultMode": 420,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {
                "configMap": {
                    "name": "kube-root-ca.crt",
                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                }
            },
            {
                "downwardAPI": {
                    "items": [
                        {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                    ]
                }
            },
        ],
    },
}
TOKEN_MOUNT = {
    "name": "kube-api-access-x7k2p",
    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
    "readOnly": True,
}


def how(**changes: Any) -> PodTranslation:
    return PodTranslation(owner=OWNER, virtual_labels=VIRTUAL_LABELS, **changes)


def upper_pod(**spec: Any) -> JSON:
    """A web pod with a ConfigMap env ref, a Secret volume and an image pull secret."""
    pod: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "web-7d9f-abcde",
            "namespace": "shop",
            "uid": "0b6c1c3e-5f0a-4d59-9d1b-6a1f1d2e3f40",
            "resourceVersion": "4711",
            "creationTimestamp": "2026-11-24T05:00:00Z",
            "generateName": "web-7d9f-",
            "labels": {"app": "web", "pod-template-hash": "7d9f"},
            "annotations": {"team": "shop"},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f", "uid": "r1"}
            ],
            "finalizers": ["example.com/keep"],
            "managedFields": [{"manager": "kube-controller-manager"}],
        },
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/web:1",
                    "command": ["/bin/web"],
                    "args": ["--port", "8080"],
                    "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                    "env": [
                        {"name": "MODE", "value": "prod"},
                        {
                            "name": "COLOR",
                            "valueFrom": {
                                "configMapKeyRef": {"name": "web-config", "key": "color"}
                            },
                        },
                        {
                            "name": "PASSWORD",
                            "valueFrom": {"secretKeyRef": {"name": "web-secret", "key": "pw"}},
                        },
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                    ],
                    "envFrom": [{"secretRef": {"name": "web-env"}}],
                    "resources": {
                        "requests": {"cpu": "250m", "memory": "64Mi"},
                        "limits": {"memory": "128Mi"},
                    },
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}},
                    "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 5},
                    "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True},
                    "volumeMounts": [{"name": "certs", "mountPath": "/certs"}, TOKEN_MOUNT],
                    "terminationMessagePath": "/dev/termination-log",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "initContainers": [
                {
                    "name": "migrate",
                    "image": "registry.example/web:1",
                    "envFrom": [{"configMapRef": {"name": "web-config"}}],
                    "volumeMounts": [TOKEN_MOUNT],
                }
            ],
            "volumes": [
                {"name": "certs", "secret": {"secretName": "web-tls", "defaultMode": 256}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "web-data"}},
                copy.deepcopy(TOKEN_VOLUME),
            ],
            "imagePullSecrets": [{"name": "registry-creds"}],
            "serviceAccountName": "web",
            "serviceAccount": "web",
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 45,
            "dnsPolicy": "ClusterFirst",
            "securityContext": {"fsGroup": 2000},
            "nodeName": "vk-lower",
            "schedulerName": "default-scheduler",
            "priority": 0,
            "preemptionPolicy": "PreemptLowerPriority",
            "enableServiceLinks": True,
            "nodeSelector": {"type": "virtual-kubelet", "disktype": "ssd"},
            "tolerations": [
                {
                    "key": "virtual-kubelet.io/provider",
                    "operator": "Exists",
                    "effect": "NoSchedule",
                },
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
                {"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"},
            ],
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app": "web"}},
                }
            ],
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }
    pod["spec"].update(spec)
    return pod
