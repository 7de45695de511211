"""Usage for `/stats/summary` and `/metrics/resource`: deterministic and plausible.

Each running container's usage is derived from a hash of its pod's UID and its name (5-200m CPU,
16-256 MiB): constant rates, so the cumulative CPU counters grow steadily and `kubectl top`
shows stable numbers. The node adds 50m and 256 MiB of its own, and its CPU counter keeps what
deleted pods used.

A metrics-server scrapes `/metrics/resource` every 15 s, so its cost grows with pods x time: on
a node with 10,000 pods, formatting every sample afresh was a third of the agent's CPU. What
never changes in a running pod's samples (rates, labels, start time, memory) is worked out once
per pod (`_Rates`); a scrape only multiplies and formats the CPU counters.
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
class _Rates:
    """What a running pod's usage derives from: its containers' rates, from a hash of the pod's
    UID and the container's name (so they stay put for the container's life), its start, and
    the text of its samples that never change."""

    containers: list[MockContainer]  # the list they come from: update_pod replaces it
    started: str
    started_at: datetime
    usage: list[tuple[MockContainer, int, int]]  # running container, nanocores, working set
    # Per running container: its label text, its start-time sample and the head of its
    # memory sample (the time stamp follows); then the same for the pod.
    texts: list[tuple[str, str, str]]
    pod_labels: str
    pod_memory: str

    @staticmethod
    def of(mock: MockPod) -> _Rates:
        assert mock.started is not None
        started_at = parse_time(mock.started)
        start_text = _go_float(started_at.timestamp())
        usage, texts = [], []
        for container in mock.containers:
            if container.init:
                continue
            digest = hashlib.sha256(f"{mock.uid}/{container.name}".encode()).digest()
            nanocores = (5 + int.from_bytes(digest[:2]) % 196) * 1_000_000
            working_set = (16 + int.from_bytes(digest[2:4]) % 241) * 2**20
            usage.append((container, nanocores, working_set))
            labels = _labels(mock.namespace, mock.name, container.name)
            memory = f"container_memory_working_set_bytes{labels} {_go_float(working_set)} "
            texts.append((labels, f"container_start_time_seconds{labels} {start_text}", memory))
        pod_labels = _labels(mock.namespace, mock.name, None)
        pod_working_set = sum(working_set for _, _, working_set in usage)
        return _Rates(
            containers=mock.containers,
            started=mock.started,
            started_at=started_at,
            usage=usage,
            texts=texts,
            pod_labels=pod_labels,
            pod_memory=f"pod_memory_working_set_bytes{pod_labels} {_go_float(pod_working_set)} ",
        )

    def fits(self, mock: MockPod) -> bool:
        return self.containers is mock.containers and self.started == mock.started

    def cpu(self, now: datetime) -> list[int]:
        """Each running container's cumulative core-nanoseconds at `now`."""
        elapsed = max((now - self.started_at).total_seconds(), 0.0)
        return [int(nanocores * elapsed) for _, nanocores, _ in self.usage]


class NodeStats:
    """A node's usage: its pods' and its own, and the CPU time of pods that are gone."""

    def __init__(self, node_name: str, memory: str) -> None:
        self.node_name = node_name
        self._memory = memory  # the node's capacity, a quantity
        self._booted = datetime.now(UTC)
        self._retired_cpu = 0  # core-nanoseconds used by pods that are gone (node counter)
        self._rates: dict[str, _Rates] = {}  # uid -> a running pod's rates
        self._layout: _Layout | None = None  # of the metrics; None: pods started or stopped

    def _rates_of(self, mock: MockPod) -> _Rates:
        rates = self._rates.get(mock.uid)
        if rates is None or not rates.fits(mock):
            rates = self._rates[mock.uid] = _Rates.of(mock)
            self._layout = None
        return rates

    def _running(self, pods: Iterable[MockPod]) -> list[tuple[MockPod, _Rates]]:
        """The running pods and their rates; the rates of pods no longer running are dropped."""
        running = [(mock, self._rates_of(mock)) for mock in pods if mock.running]
        if len(self._rates) > len(running):
            self._rates = {mock.uid: rates for mock, rates in running}
            self._layout = None
        return running

    def retire(self, mock: MockPod) -> None:
        """Count what a pod that is stopping used into the node's CPU counter."""
        if mock.running:
            self._retired_cpu += sum(self._rates_of(mock).cpu(datetime.now(UTC)))
            self._rates.pop(mock.uid, None)
            self._layout = None

    def _node(self, now: datetime, pods: _Usage) -> _Usage:
        system_cpu = int(_SYSTEM_NANOCORES * max((now - self._booted).total_seconds(), 0.0))
        return _Usage(
            nanocores=_SYSTEM_NANOCORES + pods.nanocores,
            cpu=system_cpu + self._retired_cpu + pods.cpu,
            working_set=_SYSTEM_MEMORY + pods.working_set,
        )

    def summary(self, pods: Iterable[MockPod]) -> dict[str, Any]:
        """A `stats/v1alpha1` Summary."""
        now = datetime.now(UTC).replace(microsecond=0)  # the JSON has whole seconds
        stamp = format_time(now)
        summaries, totals = [], []
        for mock, rates in self._running(pods):
            containers = [
                (container, _Usage(nanocores, cpu, working_set))
                for (container, nanocores, working_set), cpu in zip(
                    rates.usage, rates.cpu(now), strict=True
                )
            ]
            totals.append(_Usage.total(u for _, u in containers))
            summaries.append(_pod_summary(stamp, mock, containers, totals[-1]))
        node = self._node(now, _Usage.total(totals))
        available = max(int(parse_quantity(self._memory).to_fraction()) - node.working_set, 0)
        return {
            "node": {
                "nodeName": self.node_name,
                "startTime": format_time(self._booted),
                "cpu": _cpu_stats(stamp, node),
                "memory": _memory_stats(stamp, node, available),
            },
            "pods": summaries,
        }

    def resource_metrics(self, pods: Iterable[MockPod], now: datetime | None = None) -> str:
        """The text a v1.37 kubelet serves on /metrics/resource for the same numbers: families
        sorted by name, samples sorted by their labels and stamped in milliseconds."""
        now = now or datetime.now(UTC)
        ms = str(int(now.timestamp() * 1000))
        running = self._running(pods)
        layout = self._layout
        if layout is None or len(layout.pods) != len(running):
            layout = self._layout = _Layout.of([rates for _, rates in running])
        cpu = [rates.cpu(now) for rates in layout.pods]
        pod_cpu = [sum(used) for used in cpu]
        node = self._node(now, _Usage(layout.nanocores, sum(pod_cpu), layout.working_set))
        samples = {
            "container_cpu_usage_seconds_total": [
                f"container_cpu_usage_seconds_total{labels} {_go_float(cpu[pod][i] / 1e9)} {ms}"
                for labels, pod, i in layout.containers
            ],
            "container_memory_working_set_bytes": [head + ms for head in layout.memories],
            "container_start_time_seconds": layout.starts,
            "node_cpu_usage_seconds_total": [
                f"node_cpu_usage_seconds_total {_go_float(node.cpu / 1e9)} {ms}"
            ],
            "node_memory_working_set_bytes": [
                f"node_memory_working_set_bytes {_go_float(node.working_set)} {ms}"
            ],
            "pod_cpu_usage_seconds_total": [
                f"pod_cpu_usage_seconds_total{rates.pod_labels} {_go_float(used / 1e9)} {ms}"
                for rates, used in zip(layout.pods, pod_cpu, strict=True)
            ],
            "pod_memory_working_set_bytes": [head + ms for head in layout.pod_memories],
            "resource_scrape_error": ["resource_scrape_error 0"],
        }
        lines = []
        for name, (kind, text) in RESOURCE_METRIC_FAMILIES.items():
            if samples[name]:  # as Go's registry: no family without samples
                lines += [f"# HELP {name} [STABLE] {text}", f"# TYPE {name} {kind}"]
                lines += samples[name]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class _Layout:
    """The running pods' samples in the order a scrape prints them (sorted by labels), kept
    until a pod starts or stops, so that a scrape sorts nothing."""

    pods: list[_Rates]  # by their label text
    containers: list[tuple[str, int, int]]  # label text, index in `pods`, index in its usage
    memories: list[str]  # heads of the containers' memory samples, in the same order
    starts: list[str]  # start-time samples, whole
    pod_memories: list[str]  # heads of the pods' memory samples, in the order of `pods`
    nanocores: int
    working_set: int

    @staticmethod
    def of(running: list[_Rates]) -> _Layout:
        pods = sorted(running, key=lambda rates: rates.pod_labels)
        containers = sorted(
            (text, pod, i) for pod, rates in enumerate(pods) for i, text in enumerate(rates.texts)
        )
        return _Layout(
            pods=pods,
            containers=[(labels, pod, i) for (labels, _, _), pod, i in containers],
            memories=[memory for (_, _, memory), _, _ in containers],
            starts=[start for (_, start, _), _, _ in containers],
            pod_memories=[rates.pod_memory for rates in pods],
            nanocores=sum(rate for rates in pods for _, rate, _ in rates.usage),
            working_set=sum(memory for rates in pods for _, _, memory in rates.usage),
        )


def _pod_summary(
    stamp: str, mock: MockPod, containers: list[tuple[MockContainer, _Usage]], total: _Usage
) -> dict[str, Any]:
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
            for c, u in containers
        ],
        "cpu": _cpu_stats(stamp, total),
        "memory": _memory_stats(stamp, total),
        "process_stats": {"process_count": len(containers)},
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
