"""Where a kind of object lives in the API, so that callers name a resource once and build its
paths from it instead of spelling URLs at each request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply (JSON is YAML)


@dataclass(frozen=True)
class Resource:
    api_version: str  # "v1", "vkubelet.io/v1alpha1"
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str = "", sub: str = "") -> str:
        """The collection (all namespaces when `namespace` is None), one object, or one of its
        subresources."""
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace is not None:
            root += f"/namespaces/{quote(namespace, safe='')}"
        path = f"{root}/{self.plural}"
        if name:
            path += f"/{quote(name, safe='')}"
            if sub:
                path += f"/{sub}"
        return path


def label_selector(labels: Mapping[str, str | None]) -> str:
    """`key=value` for each label, `key` alone (the label exists) where the value is None."""
    return ",".join(key if value is None else f"{key}={value}" for key, value in labels.items())


PODS = Resource("v1", "Pod", "pods")
NODES = Resource("v1", "Node", "nodes", namespaced=False)
EVENTS = Resource("v1", "Event", "events")
PERSISTENT_VOLUME_CLAIMS = Resource("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
PERSISTENT_VOLUMES = Resource("v1", "PersistentVolume", "persistentvolumes", namespaced=False)
LEASES = Resource("coordination.k8s.io/v1", "Lease", "leases")
CUSTOM_RESOURCE_DEFINITIONS = Resource(
    "apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", False
)
