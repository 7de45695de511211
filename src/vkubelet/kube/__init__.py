"""The one Kubernetes client stack: client, errors, reflector, work queue, events and leases.

Every part of vkubelet that talks to an apiserver (the node agent, the providers, the VM
controller) goes through this package, so that the hard-won details live once: watches that
resume from bookmarks and relist on 410, back-off that does not hammer a loaded apiserver,
events that are deduplicated and rate-limited, leader election that fences its work. It sits
below the node agent and the providers and knows nothing of either.
"""

from .._kubeconfig import httpx_params, load_context, load_kubeconfig, service_account_kubeconfig
from ._client import STRATEGIC_MERGE_PATCH, ClientOptions, KubeClient
from ._errors import ApiError, Unreachable
from ._events import NORMAL, WARNING, EventRecorder, ObjectRef
from ._lease import (
    KubeLeases,
    LeaderElector,
    LeaseConflict,
    LeaseStore,
    LeaseTiming,
    default_identity,
)
from ._reflector import Handler, Reflector, key_of
from ._resources import (
    APPLY_PATCH,
    CUSTOM_RESOURCE_DEFINITIONS,
    EVENTS,
    LEASES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Resource,
    label_selector,
)
from ._workqueue import WorkQueue

__all__ = [
    "APPLY_PATCH",
    "CUSTOM_RESOURCE_DEFINITIONS",
    "EVENTS",
    "LEASES",
    "NODES",
    "NORMAL",
    "PERSISTENT_VOLUMES",
    "PERSISTENT_VOLUME_CLAIMS",
    "PODS",
    "STRATEGIC_MERGE_PATCH",
    "WARNING",
    "ApiError",
    "ClientOptions",
    "EventRecorder",
    "Handler",
    "KubeClient",
    "KubeLeases",
    "LeaderElector",
    "LeaseConflict",
    "LeaseStore",
    "LeaseTiming",
    "ObjectRef",
    "Reflector",
    "Resource",
    "Unreachable",
    "WorkQueue",
    "default_identity",
    "httpx_params",
    "key_of",
    "label_selector",
    "load_context",
    "load_kubeconfig",
    "service_account_kubeconfig",
]
