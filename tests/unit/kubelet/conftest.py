"""The kubelet API server's fixtures (defined in harness.py, which the streaming tests share)."""

from .harness import kubelet, pki, start_kubelet

__all__ = ["kubelet", "pki", "start_kubelet"]
