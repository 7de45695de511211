"""Measured usage as the kubelet reports it: a `stats/v1alpha1` Summary (`/stats/summary`) and
the Prometheus text of `/metrics/resource` (what metrics-server scrapes for `kubectl top`).

A provider that measures real usage (processes on a device, a container runtime's `stats`) fills
the records below from one sample and formats both answers with `summary` and
`resource_metrics`, so every such provider speaks the kubelet's formats the same way. Counters
must not go backwards within one container run (metrics-server drops a container whose CPU
counter decreases): `CpuCounters` makes raw readings that may (a process leaving its group takes
its CPU time with it) into counters that only grow, with the Summary's `usageNanoCores` from
two samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .metrics import RESOURCE_METRIC_FAMILIES

__all__ = [
    "ContainerUsage",
    "CpuCounters",
    "NodeUsage",
    "PodUsage",
    "Usage",
    "resource_metrics",
    "summary",
]


@dataclass(frozen=True)
class Usage:
    cpu_ns: int  # cumulative core-nanoseconds
    nanocores: int  # the rate since the previous sample (0 for the first one)
    working_set: int  # bytes


@dataclass(frozen=True)
class ContainerUsage:
    name: str
    started: float  # this run's start, epoch seconds (a new run is a new counter)
    usage: Usage


@dataclass(frozen=True)
class PodUsage:
    namespace: str
    name: str
    uid: str
    started: float  # epoch seconds
    containers: list[ContainerUsage]
    usage: Usage  # the pod's: its containers' and what its ended runs used


@dataclass(frozen=True)
class NodeUsage:
    name: str
    started: float  # boot, epoch seconds
    usage: Usage
    available_memory: int | None  # bytes; None where unknown


class CpuCounters:
    """Cumulative CPU counters that only grow, from raw readings that may drop, and their rates.

    A reading above the key's previous one adds the difference; one below it (a process that
    left, a container run that ended) adds nothing, so the counter stays put rather than going
    back. Keys that a sample no longer has are dropped by `keep_only`.
    """

    def __init__(self) -> None:
        self._last: dict[Hashable, tuple[float, int, int]] = {}  # key -> (when, raw, counted)

    def update(self, key: Hashable, raw_ns: int, when: float) -> tuple[int, int]:
        """The counter of `key` (core-nanoseconds) after a reading of `raw_ns` at `when`
        (seconds), and its rate since the previous reading in nanocores (0 for the first)."""
        before = self._last.get(key)
        if before is None:
            self._last[key] = (when, raw_ns, raw_ns)
            return raw_ns, 0
        then, raw, counted = before
        now_counted = counted + max(raw_ns - raw, 0)
        self._last[key] = (when, raw_ns, now_counted)
        rate = int((now_counted - counted) / (when - then)) if when > then else 0
        return now_counted, rate

    def keep_only(self, keys: Iterable[Hashable]) -> None:
        kept = set(keys)
        self._last = {k: v for k, v in self._last.items() if k in kept}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cpu(stamp: str, usage: Usage) -> dict[str, Any]:
    return {"time": stamp, "usageNanoCores": usage.nanocores, "usageCoreNanoSeconds": usage.cpu_ns}


def _memory(stamp: str, usage: Usage, available: int | None = None) -> dict[str, Any]:
    memory: dict[str, Any] = {"time": stamp}
    if available is not None:
        memory["availableBytes"] = available
    memory |= {"usageBytes": usage.working_set, "workingSetBytes": usage.working_set}
    return memory


def summary(node: NodeUsage, pods: list[PodUsage], when: float) -> dict[str, Any]:
    """A `stats/v1alpha1` Summary of one sample taken at `when` (epoch seconds)."""
    stamp = _time(when)
    return {
        "node": {
            "nodeName": node.name,
            "startTime": _time(node.started),
            "cpu": _cpu(stamp, node.usage),
            "memory": _memory(stamp, node.usage, node.available_memory),
        },
        "pods": [
            {
                "podRef": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid},
                "startTime": _time(pod.started),
                "containers": [
                    {
                        "name": c.name,
                        "startTime": _time(c.started),
                        "cpu": _cpu(stamp, c.usage),
                        "memory": _memory(stamp, c.usage),
                    }
                    for c in pod.containers
                ],
                "cpu": _cpu(stamp, pod.usage),
                "memory": _memory(stamp, pod.usage),
            }
            for pod in pods
        ],
    }


def resource_metrics(node: NodeUsage, pods: list[PodUsage], when: float) -> str:
    """The kubelet's `/metrics/resource` text for one sample taken at `when`: samples stamped
    with that time (metrics-server computes rates between stamps), families in name order."""
    stamp = str(int(when * 1000))
    samples: dict[str, list[str]] = {name: [] for name in RESOURCE_METRIC_FAMILIES}

    def add(name: str, labels: dict[str, str], value: float, timed: bool = True) -> None:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        series = f"{name}{{{text}}}" if text else name
        samples[name].append(f"{series} {float(value)!r}" + (f" {stamp}" if timed else ""))

    add("node_cpu_usage_seconds_total", {}, node.usage.cpu_ns / 1e9)
    add("node_memory_working_set_bytes", {}, node.usage.working_set)
    for pod in pods:
        labels = {"namespace": pod.namespace, "pod": pod.name}
        add("pod_cpu_usage_seconds_total", labels, pod.usage.cpu_ns / 1e9)
        add("pod_memory_working_set_bytes", labels, pod.usage.working_set)
        for c in pod.containers:
            container = {**labels, "container": c.name}
            add("container_start_time_seconds", container, c.started, timed=False)
            add("container_cpu_usage_seconds_total", container, c.usage.cpu_ns / 1e9)
            add("container_memory_working_set_bytes", container, c.usage.working_set)
    add("resource_scrape_error", {}, 0, timed=False)
    lines = []
    for name, (kind, help_text) in RESOURCE_METRIC_FAMILIES.items():
        if samples[name]:
            lines += [f"# HELP {name} [STABLE] {help_text}", f"# TYPE {name} {kind}"]
            lines += sorted(samples[name])
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
