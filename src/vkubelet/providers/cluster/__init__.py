"""The cluster provider: a whole lower Kubernetes cluster as one virtual node.

Registered as `cluster` (`vkubelet run --provider cluster --provider-config lower.yaml`).
`ClusterProvider` (`_provider`) is a pass-through provider: the agent hands it pods as written,
so no Secret value is ever copied into a lower pod spec. The parts, each pure logic or plain
API I/O in its own module:

- `_config`: `lower.yaml` (kubeconfig, namespace mapping, upper identity, resync, options);
- `_stamps`: owner stamps and the "is this lower object ours" predicate every write path asks;
- `_refs`: every place a pod spec names a ConfigMap, Secret, ServiceAccount or PVC;
- `_translate`: upper pod as written -> lower pod (references kept, never values);
- `_status`: lower pod status -> upper status, and the verdict on a vanished lower pod;
- `_capacity`: the virtual node's allocatable and labels from the lower nodes and pods;
- `_deps`: which dependencies must exist below (reference-counted, stamped objects only);
- `_lower`: the lower API client, with clear errors for a bad kubeconfig or missing RBAC;
- `_stats`: `kubectl top` numbers of our pods from the lower kubelets, renamed upstairs;
- `_services`: which upper Services go below and how (selector narrowed to our lower pods);
- `_tokens`: upper service-account tokens for lower pods (`serviceAccountTokens: upper`);
- `_convert`: JSON <-> lightkube models and small value helpers;
- `_fit`: does a pod fit some single lower node (aggregate mode's fit check), largest free;
- `_mirror`: `mode: mirror`, a fleet of one virtual node per lower node;
- `_constraints`, `_admission`, `_webhookconfig`: the constraint webhook (constraints moved into
  one annotation upstairs and restored below; its admission answers; `webhook:` options);
- `_provider`: the provider class: the pod lifecycle and the node protocol, composed of parts
  that own their state and see the pods through narrow callbacks: `_capacityloop` (capacity,
  labels, fit check), `_depsync` (dependency copies), `_servicesync` (Services below),
  `_tokenkeeper` (upper tokens), `_eventmirror` (lower Events) and `_verbs` (kubectl verbs).

See docs/cluster-provider.md.
"""

import dataclasses

from ...sdk import ConfigError, ProviderContext
from ._capacity import lower_capacity, pod_requests
from ._config import NamespaceMapping, cluster_label_value, load_lower_config
from ._deps import plan_dependencies
from ._lower import REQUIRED_PERMISSIONS, LowerCluster, MissingPermissions, open_lower
from ._mirror import ClusterFleet, member_name
from ._provider import ClusterProvider
from ._refs import pod_references
from ._stamps import Claim, Owner, claim, dependency_name, is_ours, stamp
from ._status import LOWER_POD_DELETED, gone_status, status_up, vanished_reason
from ._translate import PodTranslation, translate_pod

__all__ = [
    "LOWER_POD_DELETED",
    "REQUIRED_PERMISSIONS",
    "Claim",
    "ClusterFleet",
    "ClusterProvider",
    "LowerCluster",
    "MissingPermissions",
    "NamespaceMapping",
    "Owner",
    "PodTranslation",
    "claim",
    "create",
    "dependency_name",
    "gone_status",
    "is_ours",
    "load_lower_config",
    "lower_capacity",
    "member_name",
    "open_lower",
    "plan_dependencies",
    "pod_references",
    "pod_requests",
    "stamp",
    "status_up",
    "translate_pod",
    "vanished_reason",
]


def create(context: ProviderContext) -> ClusterProvider | ClusterFleet:
    """Factory for the `vkubelet.providers` entry point (`cluster`). It does not contact the
    lower cluster: an unreachable one only makes the node NotReady until it answers. With
    `mode: mirror`, a fleet: one virtual node per lower node."""
    if context.config_path is None:
        raise ConfigError("the cluster provider needs --provider-config: lower.yaml")
    config = load_lower_config(context.config_path)
    if config.cluster_name is None:  # default: the node's name (mirror mode: the fleet's prefix)
        config = dataclasses.replace(config, cluster_name=cluster_label_value(context.node_name))
    if config.mode == "mirror":
        return ClusterFleet(config, context, open_lower(config))
    return ClusterProvider(config, context, open_lower(config))
