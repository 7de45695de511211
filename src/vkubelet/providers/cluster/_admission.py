"""The constraint webhook, sans I/O: its `lower.yaml` section, AdmissionReview in -> JSONPatch out,
the MutatingWebhookConfiguration the agent installs, and which pods were admitted without it.

The agent serves it (HTTPS, `vkubelet.agent._webhook`); this module decides everything else.

Opt-in, never by default, and never in kube-system:

- a namespace labelled `vkubelet.io/constraint-webhook=enabled` opts in all its pods (a pod
  labelled `...=disabled` opts out);
- a pod labelled `vkubelet.io/constraint-webhook=enabled` opts in, in any other namespace.

Two webhooks in one configuration express that "or" (one admission webhook's selectors can only
"and"); a pod matches one of them at most. `kube-system` is excluded by its
`kubernetes.io/metadata.name` label in both selectors, and again by the handler.

`failurePolicy: Ignore`: an agent that is down, slow or unreachable never blocks pod creation
upstairs; such a pod keeps its constraints in its spec (the upper scheduler then checks them
against the virtual node, where they usually fail). That is made visible: every opted-in pod the
webhook saw carries the annotation (`{"v":1}` when nothing moved), so a pod without it was
admitted without the webhook, and the agent warns about it (`skipped`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._constraints import ANNOTATION, ConstraintsError, VirtualKeys, move
from ._webhookconfig import WebhookConfig

__all__ = [
    "OPT_IN_LABEL",
    "SKIPPED_REASON",
    "ConstraintWebhook",
    "json_patch",
]

JSON = dict[str, Any]

OPT_IN_LABEL = "vkubelet.io/constraint-webhook"
ENABLED, DISABLED = "enabled", "disabled"
SKIPPED_REASON = "ConstraintWebhookSkipped"
PATH = "/mutate"
_NAMESPACE_NAME = "kubernetes.io/metadata.name"
_PROTECTED_NAMESPACES = ["kube-system"]
_PATCHED = (
    ("metadata", "annotations"),
    ("spec", "nodeSelector"),
    ("spec", "affinity"),
    ("spec", "tolerations"),
    ("spec", "topologySpreadConstraints"),
)


def configuration_name(node_name: str) -> str:
    """One configuration per virtual node (several agents may each serve one); a name too long
    for the API is cut and made distinct with a hash."""
    name = f"vkubelet-constraints-{node_name}"
    if len(name) <= 253:
        return name
    return f"{name[:236]}-{hashlib.sha256(node_name.encode()).hexdigest()[:16]}"


@dataclass
class ConstraintWebhook:
    """What the agent needs to serve, install and audit one node's constraint webhook."""

    node_name: str
    config: WebhookConfig
    default_host: str
    keys: VirtualKeys = field(default_factory=VirtualKeys)

    def __post_init__(self) -> None:
        self.keys = self.keys.with_extra(self.config.keep_keys)
        self.name = configuration_name(self.node_name)
        self.port = self.config.port
        self.host = self.config.host or self.default_host
        self.cert_file = self.config.cert_file
        self.key_file = self.config.key_file
        self.ca_file = self.config.ca_file
        self.audit_seconds = self.config.audit_seconds
        self.path = PATH
        self.skipped_reason = SKIPPED_REASON

    # -- admission ----------------------------------------------------------------------
    def review(self, body: bytes) -> bytes:
        """An AdmissionReview v1 answer. Raises ValueError for a body that is not one."""
        try:
            review = json.loads(body)
            request = review["request"]
            uid = str(request["uid"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not an AdmissionReview: {e}") from None
        response: JSON = {"uid": uid, "allowed": True}
        pod = request.get("object")
        if self._applies(request, pod):
            assert isinstance(pod, dict)
            try:
                moved = move(pod, self.keys)
            except ConstraintsError as e:
                response = {
                    "uid": uid,
                    "allowed": False,
                    "status": {"code": 400, "reason": "BadRequest", "message": str(e)},
                }
            else:
                patch = json_patch(pod, moved)
                if patch:
                    response["patchType"] = "JSONPatch"
                    response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        answer = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        return json.dumps({**answer, "response": response}).encode()

    def _applies(self, request: Mapping[str, Any], pod: Any) -> bool:
        """Pods created in an opted-in place; the selectors already say so, but kube-system and
        an opted-out pod are refused here too, whatever the installed configuration says."""
        kind = request.get("kind") or {}
        if kind.get("kind") != "Pod" or kind.get("group", "") != "":
            return False
        if request.get("operation") != "CREATE" or request.get("subResource"):
            return False
        if request.get("namespace") in _PROTECTED_NAMESPACES or not isinstance(pod, dict):
            return False
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return labels.get(OPT_IN_LABEL) != DISABLED

    # -- installation -------------------------------------------------------------------
    def configuration(self, url: str, ca_bundle: bytes) -> JSON:
        """The MutatingWebhookConfiguration, for server-side apply."""
        not_protected = {
            "key": _NAMESPACE_NAME,
            "operator": "NotIn",
            "values": _PROTECTED_NAMESPACES,
        }
        common: JSON = {
            "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_bundle).decode()},
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "scope": "Namespaced",
                }
            ],
            "failurePolicy": "Ignore",
            "matchPolicy": "Equivalent",
            "sideEffects": "None",
            "timeoutSeconds": self.config.timeout_seconds,
            "admissionReviewVersions": ["v1"],
            # Webhooks after us may add constraints (a policy engine adding a nodeSelector):
            # called again, we move those too (`move` restores first, so it is exact).
            "reinvocationPolicy": "IfNeeded",
        }
        by_namespace = {
            **common,
            "name": "by-namespace.constraints.vkubelet.io",
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": OPT_IN_LABEL, "operator": "In", "values": [ENABLED]},
                    not_protected,
                ]
            },
            "objectSelector": {
                "matchExpressions": [
                    {"key": OPT_IN_LABEL, "operator": "NotIn", "values": [DISABLED]}
                ]
            },
        }
        by_pod = {
            **common,
            "name": "by-pod.constraints.vkubelet.io",
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": OPT_IN_LABEL, "operator": "NotIn", "values": [ENABLED]},
                    not_protected,
                ]
            },
            "objectSelector": {"matchLabels": {OPT_IN_LABEL: ENABLED}},
        }
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {
                "name": self.name,
                "labels": {"app.kubernetes.io/managed-by": "vkubelet"},
                "annotations": {"vkubelet.io/virtual-node": self.node_name},
            },
            "webhooks": [by_namespace, by_pod],
        }

    # -- pods admitted without us ---------------------------------------------------------
    def audit_lists(
        self, namespaces: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, dict[str, str]]]:
        """The pod lists (path, params) that hold every opted-in pod, given all namespaces."""
        lists = [("/api/v1/pods", {"labelSelector": f"{OPT_IN_LABEL}={ENABLED}"})]
        for namespace in namespaces:
            name = str((namespace.get("metadata") or {}).get("name", ""))
            if _namespace_opted_in(namespace) and name not in _PROTECTED_NAMESPACES:
                lists.append(
                    (
                        f"/api/v1/namespaces/{name}/pods",
                        {"labelSelector": f"{OPT_IN_LABEL}!={DISABLED}"},
                    )
                )
        return lists

    def skipped(
        self, pod: Mapping[str, Any], namespaces: Mapping[str, Mapping[str, Any]]
    ) -> str | None:
        """The Warning for an opted-in, live pod that the webhook never saw, else None."""
        metadata = pod.get("metadata") or {}
        namespace = str(metadata.get("namespace", ""))
        if namespace in _PROTECTED_NAMESPACES:
            return None
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None
        if ANNOTATION in (metadata.get("annotations") or {}):
            return None
        label = (metadata.get("labels") or {}).get(OPT_IN_LABEL)
        in_namespace = _namespace_opted_in(namespaces.get(namespace) or {})
        if not (label == ENABLED or (in_namespace and label != DISABLED)):
            return None
        return (
            f"admitted without the constraint webhook {self.name} (agent of virtual node "
            f"{self.node_name}, failurePolicy Ignore: the agent was down or did not answer, "
            "or the pod predates the opt-in): "
            "its constraints for the lower cluster stayed in the spec, where the upper "
            "scheduler checks them against the virtual node; delete the pod so that it is "
            "created again (its controller does that) while the agent runs"
        )


def _namespace_opted_in(namespace: Mapping[str, Any]) -> bool:
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(OPT_IN_LABEL) == ENABLED)


def json_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[JSON]:
    """RFC 6902 operations turning `before` into `after`, for the fields `move` may change
    (whole values: exact and short, no general diff library needed)."""
    ops: list[JSON] = []
    for parent, key in _PATCHED:
        old = (before.get(parent) or {}).get(key)
        new = (after.get(parent) or {}).get(key)
        if old == new:
            continue
        path = f"/{parent}/{key}"
        if new is None:
            ops.append({"op": "remove", "path": path})
        elif old is None:
            if parent not in before:
                ops.append({"op": "add", "path": f"/{parent}", "value": {}})
            ops.append({"op": "add", "path": path, "value": new})
        else:
            ops.append({"op": "replace", "path": path, "value": new})
    return ops
