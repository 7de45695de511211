"""The cluster provider's building blocks: a whole lower Kubernetes cluster as one virtual node.

Not registered as a provider yet (no entry point): the provider class that runs pods with these
parts needs the pass-through pods, node conditions, event sink and client-side streaming of the
provider SDK. What is here is pure logic and plain API I/O, each part in its own module:

- `_config`: `lower.yaml` (kubeconfig, namespace mapping, upper identity, resync, options);
- `_stamps`: owner stamps and the "is this lower object ours" predicate every write path asks;
- `_refs`: every place a pod spec names a ConfigMap, Secret, ServiceAccount or PVC;
- `_translate`: upper pod as written -> lower pod (references kept, never values);
- `_status`: lower pod status -> upper status, and the verdict on a vanished lower pod;
- `_capacity`: the virtual node's allocatable and labels from the lower nodes and pods;
- `_deps`: which dependencies must exist below (reference-counted, stamped objects only);
- `_lower`: the lower API client, with clear errors for a bad kubeconfig or missing RBAC.

See docs/cluster-provider.md.
"""

from ._capacity import LowerCapacity, common_labels, lower_capacity, node_usable, pod_requests
from ._config import LowerConfig, NamespaceMapping, Resync, load_lower_config
from ._deps import DependencyPlan, lower_copy, plan_dependencies
from ._lower import (
    REQUIRED_PERMISSIONS,
    LowerCluster,
    MissingPermissions,
    Permission,
    open_lower,
)
from ._refs import Reference, pod_references, rename_references
from ._stamps import Claim, Owner, claim, dependency_name, is_ours, stamp
from ._status import LOWER_POD_DELETED, gone_status, status_up, vanished_reason
from ._translate import PodTranslation, translate_pod

__all__ = [
    "LOWER_POD_DELETED",
    "REQUIRED_PERMISSIONS",
    "Claim",
    "DependencyPlan",
    "LowerCapacity",
    "LowerCluster",
    "LowerConfig",
    "MissingPermissions",
    "NamespaceMapping",
    "Owner",
    "Permission",
    "PodTranslation",
    "Reference",
    "Resync",
    "claim",
    "common_labels",
    "dependency_name",
    "gone_status",
    "is_ours",
    "load_lower_config",
    "lower_capacity",
    "lower_copy",
    "node_usable",
    "open_lower",
    "plan_dependencies",
    "pod_references",
    "pod_requests",
    "rename_references",
    "stamp",
    "status_up",
    "translate_pod",
    "vanished_reason",
]
