"""A real local Kubernetes control plane, built from Go modules, for development and tests."""

from .._files import write_kubeconfig
from ._build import (
    BuildFailed,
    GoToolchainMissing,
    cached_binaries,
    ensure_binaries,
    ensure_helm,
    ensure_worker_binaries,
    kubernetes_version,
)
from ._cluster import (
    COMPONENTS,
    Cluster,
    ClusterExists,
    ClusterNotFound,
    PortInUse,
    StartupFailed,
    list_clusters,
    state_root,
)
from ._errors import DevClusterError
from ._images import KINDS, ImageArchive, ImageBuildError, build_image
from ._network import NetworkUnavailable, preflight
from ._pki import csr_pem, new_key
from ._proc import processes_mentioning

__all__ = [
    "COMPONENTS",
    "KINDS",
    "BuildFailed",
    "Cluster",
    "ClusterExists",
    "ClusterNotFound",
    "DevClusterError",
    "GoToolchainMissing",
    "ImageArchive",
    "ImageBuildError",
    "NetworkUnavailable",
    "PortInUse",
    "StartupFailed",
    "build_image",
    "cached_binaries",
    "csr_pem",
    "ensure_binaries",
    "ensure_helm",
    "ensure_worker_binaries",
    "kubernetes_version",
    "list_clusters",
    "new_key",
    "preflight",
    "processes_mentioning",
    "state_root",
    "write_kubeconfig",
]
