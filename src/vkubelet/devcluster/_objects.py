"""The API objects a dev cluster creates as it starts, as kubeadm and addon manifests would.

Each is a (collection path, object) pair for a plain POST; `Cluster` creates them in order.
"""

from __future__ import annotations

import base64
from typing import Any

Obj = dict[str, Any]
Item = tuple[str, Obj]

RBAC = "/apis/rbac.authorization.k8s.io/v1"
METRICS_SERVER_USER = "system:metrics-server"
METRICS_SERVER_SERVICE = "metrics-server"  # in kube-system
MARKER_NAMESPACE = "kube-public"
MARKER_NAME = "vkubelet-dev-cluster"


def _meta(name: str, namespace: str | None = None) -> Obj:
    meta: Obj = {"name": name, "labels": {"app.kubernetes.io/managed-by": "vkubelet-dev-cluster"}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _cluster_role(
    name: str, rules: list[dict[str, Any]], labels: dict[str, str] | None = None
) -> Item:
    metadata = _meta(name)
    metadata["labels"] |= labels or {}
    return (
        f"{RBAC}/clusterroles",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": metadata,
            "rules": rules,
        },
    )


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def _binding(name: str, role: str, kind: str, subject: str, namespace: str = "") -> Item:
    """A RoleBinding to a Role of `namespace`; without one, a ClusterRoleBinding."""
    scope = "Role" if namespace else "ClusterRole"
    return (
        f"{RBAC}/namespaces/{namespace}/rolebindings"
        if namespace
        else f"{RBAC}/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": f"{scope}Binding",
            "metadata": _meta(name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": scope, "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": subject}],
        },
    )


def kubelet_access() -> list[Item]:
    """What kubeadm sets up for kubelets and the apiserver's calls to them.

    Kubelets (and vkubelet) authorize callers with SubjectAccessReviews on `nodes/proxy` and
    friends; without the first binding `kubectl logs/exec` would be refused with 403. The others
    let bootstrap tokens request node client certificates, which the controller-manager
    approves, as it approves nodes' renewals.
    """
    return [
        _binding(
            "vkubelet:apiserver-kubelet-api-admin",
            "system:kubelet-api-admin",
            "User",
            "kube-apiserver-kubelet-client",
        ),
        _binding(
            "vkubelet:node-bootstrapper",
            "system:node-bootstrapper",
            "Group",
            "system:bootstrappers",
        ),
        _binding(
            "vkubelet:node-autoapprove-bootstrap",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            "Group",
            "system:bootstrappers",
        ),
        _binding(
            "vkubelet:node-autoapprove-certificate-rotation",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            "Group",
            "system:nodes",
        ),
    ]


def dev_cluster_marker(cluster_name: str) -> list[Item]:
    """A ConfigMap that says "this is a vkubelet dev cluster", readable by any authenticated user.

    An agent may trust it to take dev-cluster shortcuts (approving its own serving CSR): only an
    administrator can create it, and the Role lets everyone read exactly this object, nothing else
    in kube-public.
    """
    role = "vkubelet:dev-cluster-marker-reader"
    return [
        (
            f"/api/v1/namespaces/{MARKER_NAMESPACE}/configmaps",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(MARKER_NAME, MARKER_NAMESPACE),
                "data": {"name": cluster_name},
            },
        ),
        (
            f"{RBAC}/namespaces/{MARKER_NAMESPACE}/roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": _meta(role, MARKER_NAMESPACE),
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["configmaps"],
                        "resourceNames": [MARKER_NAME],
                        "verbs": ["get"],
                    }
                ],
            },
        ),
        _binding(role, role, "Group", "system:authenticated", MARKER_NAMESPACE),
    ]


AGGREGATE_TO = ("view", "edit", "admin")


def metrics_server_access() -> list[Item]:
    """metrics-server's RBAC, as its own manifests grant it (to a user instead of an account).

    It lists nodes and pods and reads `nodes/metrics` from kubelets, which vkubelet authorizes
    with a SubjectAccessReview; as an aggregated API server it checks the apiserver's proxied
    requests with TokenReviews and SubjectAccessReviews (auth-delegator) and reads the
    front-proxy CA from kube-system/extension-apiserver-authentication.
    """
    role = METRICS_SERVER_USER
    return [
        _cluster_role(
            role,
            [
                _rule("", ["nodes/metrics"], ["get"]),
                _rule("", ["nodes", "pods"], ["get", "list", "watch"]),
            ],
        ),
        _binding(role, role, "User", METRICS_SERVER_USER),
        _binding(
            "vkubelet:metrics-server:auth-delegator",
            "system:auth-delegator",
            "User",
            METRICS_SERVER_USER,
        ),
        _binding(
            "vkubelet:metrics-server-auth-reader",
            "extension-apiserver-authentication-reader",
            "User",
            METRICS_SERVER_USER,
            "kube-system",
        ),
        _cluster_role(  # `kubectl top` for whoever may view, edit or administer (upstream's)
            "system:aggregated-metrics-reader",
            [_rule("metrics.k8s.io", ["pods", "nodes"], ["get", "list", "watch"])],
            labels={f"rbac.authorization.k8s.io/aggregate-to-{r}": "true" for r in AGGREGATE_TO},
        ),
    ]


def metrics_api(port: int, ca_pem: bytes) -> list[Item]:
    """Register metrics-server, listening on 127.0.0.1:`port`, as the `metrics.k8s.io` API.

    The aggregator reaches an APIService through its Service. A ClusterIP Service would need
    endpoints, and EndpointSlices refuse loopback addresses; but for a Service of type
    ExternalName the aggregator (without --enable-aggregator-routing) dials
    `https://<externalName>:<APIService port>` (k8s.io/apiserver/pkg/util/proxy ResolveCluster),
    so `localhost` reaches metrics-server without root or a routable address. It verifies the
    serving certificate against `caBundle` for the name `metrics-server.kube-system.svc`.
    """
    return [
        (
            "/api/v1/namespaces/kube-system/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(METRICS_SERVER_SERVICE, "kube-system"),
                "spec": {"type": "ExternalName", "externalName": "localhost"},
            },
        ),
        (
            "/apis/apiregistration.k8s.io/v1/apiservices",
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": _meta("v1beta1.metrics.k8s.io"),
                "spec": {
                    "group": "metrics.k8s.io",
                    "version": "v1beta1",
                    "service": {
                        "name": METRICS_SERVER_SERVICE,
                        "namespace": "kube-system",
                        "port": port,
                    },
                    "caBundle": base64.b64encode(ca_pem).decode(),
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            },
        ),
    ]


COREDNS_USER = "system:coredns"
DNS_SERVICE = "kube-dns"  # the name kubeadm's clusters give it; tools look for it


def cluster_dns(service_ip: str, host_ip: str) -> list[Item]:
    """CoreDNS's read access and the `kube-dns` Service that points pods at it.

    CoreDNS runs on the host (like metrics-server), listening on the host bridge, not as a pod:
    the Service has no selector and one EndpointSlice with the host's address, which
    kube-proxy on every worker turns into DNAT rules for `service_ip`.
    """
    role = "vkubelet:coredns"
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    return [
        _cluster_role(
            role,
            [
                _rule("", ["services", "pods", "namespaces"], ["list", "watch"]),
                _rule("discovery.k8s.io", ["endpointslices"], ["list", "watch"]),
            ],
        ),
        _binding(role, role, "User", COREDNS_USER),
        (
            "/api/v1/namespaces/kube-system/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    **_meta(DNS_SERVICE, "kube-system"),
                    "labels": {
                        "app.kubernetes.io/managed-by": "vkubelet-dev-cluster",
                        "k8s-app": "kube-dns",
                        "kubernetes.io/name": "CoreDNS",
                    },
                },
                "spec": {
                    "clusterIP": service_ip,
                    "ports": [
                        {"name": name, "port": 53, "protocol": proto, "targetPort": 53}
                        for name, proto in ports
                    ],
                },
            },
        ),
        (
            "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    **_meta(f"{DNS_SERVICE}-host", "kube-system"),
                    "labels": {
                        "kubernetes.io/service-name": DNS_SERVICE,
                        "endpointslice.kubernetes.io/managed-by": "vkubelet-dev-cluster",
                    },
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [host_ip], "conditions": {"ready": True}}],
                "ports": [{"name": name, "port": 53, "protocol": proto} for name, proto in ports],
            },
        ),
    ]
