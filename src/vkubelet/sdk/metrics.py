"""The metric families of the kubelet's `/metrics/resource` endpoint (what metrics-server reads),
with their types and help texts, as the kubelet exposes them: a provider serving that endpoint,
or relaying another kubelet's, writes them exactly so.
"""

from __future__ import annotations

from typing import Final

# family -> (Prometheus type, help text)
RESOURCE_METRIC_FAMILIES: Final[dict[str, tuple[str, str]]] = {
    "container_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
    ),
    "container_memory_working_set_bytes": (
        "gauge",
        "Current working set of the container in bytes",
    ),
    "container_start_time_seconds": (
        "gauge",
        "Start time of the container since unix epoch in seconds",
    ),
    "node_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
    ),
    "node_memory_working_set_bytes": ("gauge", "Current working set of the node in bytes"),
    "pod_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
    ),
    "pod_memory_working_set_bytes": ("gauge", "Current working set of the pod in bytes"),
    "resource_scrape_error": (
        "gauge",
        "1 if there was an error while getting container metrics, 0 otherwise",
    ),
}

__all__ = ["RESOURCE_METRIC_FAMILIES"]
