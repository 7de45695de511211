"""The server's own Prometheus metrics, served on `/metrics` with the rest of the registry.

Metrics are registered once per registry: several servers (one per port) in one process share
them, told apart by the `port` label. Tests pass a registry of their own.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import REGISTRY


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "vkubelet_kubelet_http_requests_total",
            "Requests to the kubelet API, by route and status code.",
            ["port", "route", "code"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "vkubelet_kubelet_http_request_duration_seconds",
            "Time until a kubelet API request was answered (streams: until they ended).",
            ["port", "route"],
            registry=registry,
            buckets=(0.005, 0.025, 0.1, 0.5, 2.5, 10, 60, 600, 3600),
        )
        self.connections = Gauge(
            "vkubelet_kubelet_open_connections",
            "Open connections to the kubelet API.",
            ["port"],
            registry=registry,
        )
        self.rejected_connections = Counter(
            "vkubelet_kubelet_rejected_connections_total",
            "Connections closed at once because the connection limit was reached.",
            ["port"],
            registry=registry,
        )
        self.streams = Gauge(
            "vkubelet_kubelet_active_streams",
            "Exec, attach and port-forward sessions in progress, by kind and transport.",
            ["port", "kind", "transport"],
            registry=registry,
        )
        self.auth_failures = Counter(
            "vkubelet_kubelet_auth_failures_total",
            "Requests refused by authentication (401) or authorization (403).",
            ["port", "code"],
            registry=registry,
        )


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ServerMetrics] = (
    weakref.WeakKeyDictionary()
)


def metrics_for(registry: CollectorRegistry | None) -> tuple[CollectorRegistry, ServerMetrics]:
    registry = registry if registry is not None else REGISTRY
    metrics = _by_registry.get(registry)
    if metrics is None:
        metrics = _by_registry[registry] = ServerMetrics(registry)
    return registry, metrics
