"""Usage for `/stats/summary` and `/metrics/resource`: deterministic and plausible.

Each running container's usage is derived from a hash of its pod's UID and its name (5-200m CPU,
16-256 MiB): constant rates, so the cumulative CPU counters grow steadily and `kubectl top`
shows stable numbers. The node adds 50m and 256 MiB of its own, and its CPU counter keeps what
deleted pods used.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from ...sdk.metrics import RESOURCE_METRIC_FAMILIES
from ...sdk.quantity import parse_quantity
from ._records import MockContainer, MockPod, format_time, parse_time

_SYSTEM_NANOCORES = 50_000_000  # the node's own CPU use (50m) ...
_SYSTEM_MEMORY = 256 * 2**20  # ... and memory


@dataclass(frozen=True, slots=True)
class _Usage:
    nanocores: int  # the current rate
    cpu: int  # cumulative core-nanoseconds
    working_set: int  # bytes

    @staticmethod
    def total(usages: Iterable[_Usage]) -> _Usage:
        nanocores = cpu = working_set = 0
        for usage in usages:
            nanocores += usage.nanocores
            cpu += usage.cpu
            working_set += usage.working_set
        return _Usage(nanocores, cpu, working_set)


@dataclass(frozen=True, slots=True)
class _PodUsage:
    pod: MockPod
    containers: list[tuple[MockContainer, _Usage]]
    total: _Usage


@dataclass(frozen=True, slots=True)
class _Snapshot:
    time: datetime
    node: _Usage
    pods: list[_PodUsage]


def _pod_usage(mock: MockPod, now: datetime) -> _PodUsage:
    """The usage of a running pod's containers: rates from a hash of the pod's UID and the
    container's name, so they stay put for the container's life."""
    assert mock.started is not None
    elapsed = max((now - parse_time(mock.started)).total_seconds(), 0.0)
    containers = []
    for container in mock.containers:
        if container.init:
            continue
        digest = hashlib.sha256(f"{mock.uid}/{container.name}".encode()).digest()
        nanocores = (5 + int.from_bytes(digest[:2]) % 196) * 1_000_000
        working_set = (16 + int.from_bytes(digest[2:4]) % 241) * 2**20
        containers.append((container, _Usage(nanocores, int(nanocores * elapsed), working_set)))
    return _PodUsage(mock, containers, _Usage.total(u for _, u in containers))


class NodeStats:
    """A node's usage: its pods' and its own, and the CPU time of pods that are gone."""

    def __init__(self, node_name: str, memory: str) -> None:
        self.node_name = node_name
        self._memory = memory  # the node's capacity, a quantity
        self._booted = datetime.now(UTC)
        self._retired_cpu = 0  # core-nanoseconds used by pods that are gone (node counter)

    def retire(self, mock: MockPod) -> None:
        """Count what a pod that is stopping used into the node's CPU counter."""
        if mock.running:
            self._retired_cpu += _pod_usage(mock, datetime.now(UTC)).total.cpu

    def _snapshot(self, pods: Iterable[MockPod], now: datetime) -> _Snapshot:
        usages = [_pod_usage(mock, now) for mock in pods if mock.running]
        total = _Usage.total(u.total for u in usages)
        system_cpu = int(_SYSTEM_NANOCORES * max((now - self._booted).total_seconds(), 0.0))
        node = _Usage(
            nanocores=_SYSTEM_NANOCORES + total.nanocores,
            cpu=system_cpu + self._retired_cpu + total.cpu,
            working_set=_SYSTEM_MEMORY + total.working_set,
        )
        return _Snapshot(now, node, usages)

    def summary(self, pods: Iterable[MockPod]) -> dict[str, Any]:
        """A `stats/v1alpha1` Summary."""
        now = datetime.now(UTC).replace(microsecond=0)  # the JSON has whole seconds
        snapshot = self._snapshot(pods, now)
        stamp = format_time(now)
        node = snapshot.node
        available = max(int(parse_quantity(self._memory).to_fraction()) - node.working_set, 0)
        return {
            "node": {
                "nodeName": self.node_name,
                "startTime": format_time(self._booted),
                "cpu": _cpu_stats(stamp, node),
                "memory": _memory_stats(stamp, node, available),
            },
            "pods": [_pod_summary(stamp, usage) for usage in snapshot.pods],
        }

    def resource_metrics(self, pods: Iterable[MockPod]) -> str:
        """The text a v1.37 kubelet serves on /metrics/resource for the same numbers: families
        sorted by name, samples stamped in milliseconds."""
        return _resource_metrics(self._snapshot(pods, datetime.now(UTC)))


def _pod_summary(stamp: str, usage: _PodUsage) -> dict[str, Any]:
    mock = usage.pod
    return {
        "podRef": {"name": mock.name, "namespace": mock.namespace, "uid": mock.uid},
        "startTime": mock.created,
        "containers": [
            {
                "name": c.name,
                "startTime": mock.started,
                "cpu": _cpu_stats(stamp, u),
                "memory": _memory_stats(stamp, u),
            }
            for c, u in usage.containers
        ],
        "cpu": _cpu_stats(stamp, usage.total),
        "memory": _memory_stats(stamp, usage.total),
        "process_stats": {"process_count": len(usage.containers)},
    }


def _cpu_stats(stamp: str, usage: _Usage) -> dict[str, Any]:
    return {"time": stamp, "usageNanoCores": usage.nanocores, "usageCoreNanoSeconds": usage.cpu}


def _memory_stats(stamp: str, usage: _Usage, available: int | None = None) -> dict[str, Any]:
    working_set = usage.working_set
    stats: dict[str, Any] = {"time": stamp}
    if available is not None:  # the kubelet reports it where there is a limit (the node's)
        stats["availableBytes"] = available
    stats |= {
        "usageBytes": working_set + working_set // 8,  # plus some inactive page cache
        "workingSetBytes": working_set,
        "rssBytes": working_set * 3 // 4,
        "pageFaults": working_set // 4096,
        "majorPageFaults": 0,
    }
    return stats


def _resource_metrics(snapshot: _Snapshot) -> str:
    ms = str(int(snapshot.time.timestamp() * 1000))
    samples: dict[str, list[tuple[str, float, str | None]]] = {
        name: [] for name in RESOURCE_METRIC_FAMILIES
    }

    def add(name: str, labels: str, value: float, stamp: str | None = ms) -> None:
        samples[name].append((labels, value, stamp))

    add("node_cpu_usage_seconds_total", "", snapshot.node.cpu / 1e9)
    add("node_memory_working_set_bytes", "", snapshot.node.working_set)
    for usage in snapshot.pods:
        mock = usage.pod
        pod = _labels(mock.namespace, mock.name, None)
        assert mock.started is not None
        started = parse_time(mock.started).timestamp()
        for container, used in usage.containers:
            labels = _labels(mock.namespace, mock.name, container.name)
            add("container_start_time_seconds", labels, started, None)
            add("container_cpu_usage_seconds_total", labels, used.cpu / 1e9)
            add("container_memory_working_set_bytes", labels, used.working_set)
        add("pod_cpu_usage_seconds_total", pod, usage.total.cpu / 1e9)
        add("pod_memory_working_set_bytes", pod, usage.total.working_set)
    add("resource_scrape_error", "", 0, None)
    lines = []
    for name, (kind, text) in RESOURCE_METRIC_FAMILIES.items():
        if not samples[name]:
            continue  # as Go's registry: no family without samples
        lines += [f"# HELP {name} [STABLE] {text}", f"# TYPE {name} {kind}"]
        for label_text, value, stamp in sorted(samples[name]):
            tail = f" {stamp}" if stamp is not None else ""
            lines.append(f"{name}{label_text} {_go_float(value)}{tail}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=1 << 16)
def _labels(namespace: str, pod: str, container: str | None) -> str:
    """A sample's label text, sorted by name; cached, since a metrics-server scrape of a node
    with 10,000 pods formats the same labels 50,000 times (a third of the agent's CPU)."""
    labels = {"namespace": namespace, "pod": pod}
    if container is not None:
        labels["container"] = container
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items())) + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _go_float(value: float) -> str:
    """As Go's strconv.FormatFloat(value, 'g', -1, 64), which the Prometheus text format uses:
    the shortest digits, in exponent form from 1e+06 up and below 1e-04."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    if 1e-4 <= abs(value) < 1e6:
        # Python's repr is the same shortest form here (fixed-point), but for a trailing ".0":
        # the quick way for the bulk of a scrape (seconds, small counts).
        text = repr(float(value))
        return text[:-2] if text.endswith(".0") else text
    sign, digit_tuple, exponent = Decimal(repr(float(value))).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    exponent += len("".join(map(str, digit_tuple))) - len(digits)
    point = len(digits) + exponent  # digits before the decimal point
    prefix = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        power = point - 1
        return f"{prefix}{mantissa}e{'-' if power < 0 else '+'}{abs(power):02d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return prefix + digits + "0" * (point - len(digits))
    return f"{prefix}{digits[:point]}.{digits[point:]}"
