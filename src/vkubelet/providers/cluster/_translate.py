"""Upper pod (as written) -> lower pod: the same workload, for the lower cluster's scheduler.

Pure: it sees the upper pod as the API stores it (references unresolved, see `PassThroughPods`)
and never the referenced objects, so no Secret value can reach the lower pod spec: env stays
`valueFrom`/`envFrom` and volumes stay `secret:`/`configMap:`, renamed to the lower copies the
dependency planner maintains.

What changes on the way down, and why:
- identity and bookkeeping of the upper API (uid, resourceVersion, ownerReferences, finalizers,
  managedFields, status, nodeName) would be rejected or would lie below; the owner stamps
  replace them;
- scheduling terms that only select the *virtual* node (its name, its own labels such as
  `type=virtual-kubelet`, its taints) are dropped, the rest steer the lower scheduler;
- fields an admission plugin computed upstairs (`priority`, `preemptionPolicy`, `overhead`)
  are dropped and recomputed below; `schedulerName` and `priorityClassName` name upper objects;
- the upper service-account token volume (`kube-api-access-*`) is dropped: the lower
  apiserver's ServiceAccount admission mounts a token of the lower service account instead, so
  no upper credential goes down (with `serviceAccountTokens: upper` it is kept, its token
  source reading a per-pod Secret of short-lived upper tokens instead, see `_tokens`);
- `readinessGates` are kept upstairs only: nobody below would ever set their conditions;
- `ephemeralContainers` cannot be set on create: `ephemeral_containers` translates them for
  the lower pod's `ephemeralcontainers` subresource (`kubectl debug` upstairs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._config import NamespaceMapping
from ._constraints import lower_view, set_or_drop
from ._refs import Reference, pod_references, rename_references
from ._stamps import Owner, dependency_name, stamp
from ._tokens import token_secret_name, token_sources, use_token_secret

__all__ = ["PodTranslation", "ephemeral_containers", "needed_references", "translate_pod"]

JSON = dict[str, Any]

_TOKEN_VOLUME_PREFIX = "kube-api-access-"  # noqa: S105  (a volume name)
_DROPPED_SPEC_FIELDS = (
    "nodeName",
    "priority",
    "preemptionPolicy",
    "overhead",
    "schedulerName",
    "priorityClassName",
    "readinessGates",
    "ephemeralContainers",
    "schedulingGates",
    "serviceAccount",  # deprecated alias of serviceAccountName, which we set
)
# The virtual node's taint that every pod scheduled to it tolerates; meaningless below.
VIRTUAL_TAINT_KEYS: frozenset[str] = frozenset({"virtual-kubelet.io/provider"})


@dataclass(frozen=True)
class PodTranslation:
    """How pods of one virtual node map onto its lower cluster."""

    owner: Owner
    namespaces: NamespaceMapping = field(default_factory=NamespaceMapping)
    dependency_names: Literal["suffixed", "same"] = "suffixed"
    service_accounts: Literal["lower", "none"] = "lower"
    # "upper": the pod's projected service-account tokens are upper tokens, minted by the
    # provider into a per-pod Secret (`_tokens`); "lower": the lower cluster mints its own.
    service_account_tokens: Literal["lower", "upper"] = "lower"
    # The virtual node's own labels (not those published from the lower nodes): terms on them
    # only chose this virtual node.
    virtual_labels: Mapping[str, str] = field(default_factory=dict)
    virtual_taint_keys: Collection[str] = VIRTUAL_TAINT_KEYS
    # Mirror mode: the one lower node this virtual node stands for; every lower pod is pinned
    # to it (required node affinity on its name, so the lower scheduler still checks it fits).
    lower_node: str | None = None
    # Label keys only virtual nodes carry (the cluster label): topology spread constraints and
    # pod (anti-)affinity terms over them spread or group *virtual* nodes and are kept upstairs;
    # below, where no node has the key, they would keep the pod from every node.
    virtual_topology_keys: Collection[str] = ()

    def lower_namespace(self, upper: str) -> str:
        return self.namespaces.lower(upper)

    def lower_name(self, kind: str, name: str) -> str:
        return dependency_name(self.owner, kind, name, self.dependency_names)


def translate_pod(upper: Mapping[str, Any], how: PodTranslation) -> JSON:
    """The lower pod for `upper` (an API pod as JSON). Raises nothing: whatever the lower API
    still rejects comes back as its own message (but an unreadable constraint annotation is
    the pod's ProviderError)."""
    upper = lower_view(upper)  # the constraint webhook's moved constraints put back
    metadata = upper.get("metadata") or {}
    namespace, name = str(metadata.get("namespace", "default")), str(metadata["name"])
    spec = _prepared_spec(upper, how)
    rename_references(spec, how.lower_name)
    if how.service_account_tokens == "upper" and token_sources(spec):
        use_token_secret(spec, token_secret_name(str(metadata.get("uid", ""))))
    _scheduling(spec, how)
    lower_metadata: JSON = {
        "name": name,
        "namespace": how.lower_namespace(namespace),
        "labels": dict(metadata.get("labels") or {}),
        "annotations": dict(metadata.get("annotations") or {}),
    }
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": lower_metadata, "spec": spec}
    return stamp(pod, how.owner, namespace=namespace, name=name, uid=str(metadata.get("uid", "")))


def ephemeral_containers(upper: Mapping[str, Any], how: PodTranslation) -> list[JSON]:
    """The upper pod's ephemeral containers as the lower pod gets them: their references
    renamed to the lower copies, like the other containers'."""
    spec = {
        "ephemeralContainers": copy.deepcopy(
            (upper.get("spec") or {}).get("ephemeralContainers") or []
        )
    }
    rename_references(spec, how.lower_name)
    return list(spec["ephemeralContainers"])


def needed_references(upper: Mapping[str, Any], how: PodTranslation) -> set[Reference]:
    """The objects the *lower* pod will reference (by their upper names): what the dependency
    planner must provide. Not the upper pod's own list: its token volume's `kube-root-ca.crt`,
    say, is not wanted below."""
    return pod_references(_prepared_spec(upper, how))


def _prepared_spec(upper: Mapping[str, Any], how: PodTranslation) -> JSON:
    """The upper spec minus what does not go down, references still under their upper names."""
    spec: JSON = copy.deepcopy(dict(upper.get("spec") or {}))
    for key in _DROPPED_SPEC_FIELDS:
        spec.pop(key, None)
    if how.service_account_tokens == "lower" or how.service_accounts == "none":
        _drop_token_volume(spec)
    _service_account(spec, how)
    return spec


def _drop_token_volume(spec: JSON) -> None:
    """Remove the upper ServiceAccount admission's token volume and its mounts."""
    dropped = {
        v.get("name")
        for v in spec.get("volumes") or []
        if str(v.get("name", "")).startswith(_TOKEN_VOLUME_PREFIX)
        and any("serviceAccountToken" in s for s in (v.get("projected") or {}).get("sources") or [])
    }
    if not dropped:
        return
    spec["volumes"] = [v for v in spec["volumes"] if v.get("name") not in dropped]
    for list_name in ("initContainers", "containers"):
        for container in spec.get(list_name) or []:
            mounts = container.get("volumeMounts")
            if mounts:
                container["volumeMounts"] = [m for m in mounts if m.get("name") not in dropped]


def _service_account(spec: JSON, how: PodTranslation) -> None:
    if how.service_accounts == "none":
        spec["serviceAccountName"] = "default"
        spec["automountServiceAccountToken"] = False
    else:
        spec["serviceAccountName"] = spec.get("serviceAccountName") or "default"


def _scheduling(spec: JSON, how: PodTranslation) -> None:
    virtual_keys = set(how.virtual_labels)
    selector = spec.get("nodeSelector")
    if selector:
        kept = {
            k: v
            for k, v in selector.items()
            if not (k in virtual_keys and how.virtual_labels.get(k) == v)
        }
        set_or_drop(spec, "nodeSelector", kept)
    tolerations = spec.get("tolerations")
    if tolerations:
        kept_tolerations = [t for t in tolerations if t.get("key") not in how.virtual_taint_keys]
        set_or_drop(spec, "tolerations", kept_tolerations)
    affinity = spec.get("affinity")
    if isinstance(affinity, dict):
        node_affinity = affinity.get("nodeAffinity")
        if isinstance(node_affinity, dict):
            _node_affinity(node_affinity, lambda key: key in virtual_keys)
            set_or_drop(affinity, "nodeAffinity", node_affinity)
        set_or_drop(spec, "affinity", affinity)
    if how.virtual_topology_keys:
        _drop_virtual_topology(spec, how.virtual_topology_keys)
    if how.lower_node is not None:
        _pin(spec, how.lower_node)


def _drop_virtual_topology(spec: JSON, keys: Collection[str]) -> None:
    spread = spec.get("topologySpreadConstraints")
    if spread:
        kept = [c for c in spread if c.get("topologyKey") not in keys]
        set_or_drop(spec, "topologySpreadConstraints", kept)
    affinity = spec.get("affinity")
    if not isinstance(affinity, dict):
        return
    for kind in ("podAffinity", "podAntiAffinity"):
        terms = affinity.get(kind)
        if not isinstance(terms, dict):
            continue
        required = terms.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(required, list):
            kept = [t for t in required if t.get("topologyKey") not in keys]
            set_or_drop(terms, "requiredDuringSchedulingIgnoredDuringExecution", kept)
        preferred = terms.get("preferredDuringSchedulingIgnoredDuringExecution")
        if isinstance(preferred, list):
            kept = [
                t
                for t in preferred
                if (t.get("podAffinityTerm") or {}).get("topologyKey") not in keys
            ]
            set_or_drop(terms, "preferredDuringSchedulingIgnoredDuringExecution", kept)
        set_or_drop(affinity, kind, terms)
    set_or_drop(spec, "affinity", affinity)


def _pin(spec: JSON, node: str) -> None:
    """Add `metadata.name In [node]` to every required term (they are ORed: each must pin),
    or make it the only term. matchFields on the name is what DaemonSets use: exact, and the
    lower scheduler still checks resources, taints and the rest."""
    pin = {"key": "metadata.name", "operator": "In", "values": [node]}
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*(term.get("matchFields") or []), pin]} for term in terms
    ]


def _node_affinity(node_affinity: JSON, virtual: Callable[[str], bool]) -> None:
    """Drop the expressions on the virtual node's own labels and name.

    Required terms are ORed: a term left empty was satisfied by the virtual node alone, so the
    lower scheduler is unconstrained (an empty term would match nothing, not everything).
    """
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if isinstance(required, dict):
        terms = [_term(t, virtual) for t in required.get("nodeSelectorTerms") or []]
        if any(not t for t in terms):
            node_affinity.pop("requiredDuringSchedulingIgnoredDuringExecution")
        else:
            required["nodeSelectorTerms"] = terms
    preferred = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution")
    if isinstance(preferred, list):
        kept = []
        for item in preferred:
            term = _term(item.get("preference") or {}, virtual)
            if term:
                kept.append({**item, "preference": term})
        set_or_drop(node_affinity, "preferredDuringSchedulingIgnoredDuringExecution", kept)


def _term(term: Mapping[str, Any], virtual: Callable[[str], bool]) -> JSON:
    expressions = [e for e in term.get("matchExpressions") or [] if not virtual(str(e.get("key")))]
    # matchFields only supports metadata.name: the virtual node's name.
    fields = [f for f in term.get("matchFields") or [] if f.get("key") != "metadata.name"]
    out: JSON = {}
    if expressions:
        out["matchExpressions"] = expressions
    if fields:
        out["matchFields"] = fields
    return out
