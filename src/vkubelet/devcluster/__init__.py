"""A real local Kubernetes control plane, built from Go modules, for development and tests."""

from .._files import write_kubeconfig
from ._build import (
    GoToolchainMissing,
    ensure_binaries,
    ensure_helm,
    ensure_worker_binaries,
    kubernetes_version,
)
from ._cluster import Cluster, ClusterNotFound, PortInUse, StartupFailed, list_clusters
from ._errors import DevClusterError
from ._images import KINDS, build_image
from ._network import NetworkUnavailable, preflight
from ._pki import csr_pem, new_key
from ._proc import processes_mentioning

__all__ = [
    "KINDS",
    "Cluster",
    "ClusterNotFound",
    "DevClusterError",
    "GoToolchainMissing",
    "NetworkUnavailable",
    "PortInUse",
    "StartupFailed",
    "build_image",
    "csr_pem",
    "ensure_binaries",
    "ensure_helm",
    "ensure_worker_binaries",
    "kubernetes_version",
    "list_clusters",
    "new_key",
    "preflight",
    "processes_mentioning",
    "write_kubeconfig",
]
