"""The streaming client's unit tests run against the real kubelet server with a fake provider,
over TLS on 127.0.0.1: the same fixtures as the kubelet server's own tests."""

from ..kubelet.harness import kubelet, pki, start_kubelet

__all__ = ["kubelet", "pki", "start_kubelet"]
