"""`kubectl top` for VMs: each VM's QEMU process (CPU time, resident memory) as its pod and its
container, in the kubelet's `/stats/summary` JSON and `/metrics/resource` text.

A VM's cost to the host is its QEMU process, guest RAM included, so that is what is reported; the
node's figures are the sum over its VMs.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ...sdk.metrics import RESOURCE_METRIC_FAMILIES

__all__ = ["CpuRates", "VMUsage", "process_start", "resource_metrics", "summary"]


@dataclass(frozen=True)
class VMUsage:
    namespace: str
    name: str
    uid: str
    container: str
    started: float  # the QEMU process's start, epoch seconds
    cpu_ns: int  # cumulative
    memory_bytes: int
    nanocores: int  # the rate since the previous sample


class CpuRates:
    """CPU rates (nanocores) from cumulative CPU times sampled at each scrape."""

    def __init__(self) -> None:
        self._samples: dict[str, tuple[float, int]] = {}

    def rate(self, key: str, cpu_ns: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        before = self._samples.get(key)
        self._samples[key] = (now, cpu_ns)
        if before is None or now <= before[0]:
            return 0
        return max(int((cpu_ns - before[1]) / (now - before[0])), 0)


def summary(node_name: str, memory: int, usages: list[VMUsage]) -> dict[str, Any]:
    """A `stats/v1alpha1` Summary; `memory` is the node's allocatable memory."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    pods = []
    for u in usages:
        started = datetime.fromtimestamp(u.started, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cpu = {"time": stamp, "usageNanoCores": u.nanocores, "usageCoreNanoSeconds": u.cpu_ns}
        mem = {
            "time": stamp,
            "usageBytes": u.memory_bytes,
            "workingSetBytes": u.memory_bytes,
            "rssBytes": u.memory_bytes,
        }
        pods.append(
            {
                "podRef": {"name": u.name, "namespace": u.namespace, "uid": u.uid},
                "startTime": started,
                "containers": [
                    {"name": u.container, "startTime": started, "cpu": cpu, "memory": mem}
                ],
                "cpu": cpu,
                "memory": mem,
            }
        )
    used = sum(u.memory_bytes for u in usages)
    return {
        "node": {
            "nodeName": node_name,
            "cpu": {
                "time": stamp,
                "usageNanoCores": sum(u.nanocores for u in usages),
                "usageCoreNanoSeconds": sum(u.cpu_ns for u in usages),
            },
            "memory": {
                "time": stamp,
                "availableBytes": max(memory - used, 0),
                "usageBytes": used,
                "workingSetBytes": used,
            },
        },
        "pods": pods,
    }


def resource_metrics(usages: list[VMUsage]) -> str:
    """The kubelet's `/metrics/resource` (what metrics-server v0.6+ scrapes), Prometheus text."""
    stamp = str(int(time.time() * 1000))
    samples: dict[str, list[str]] = {name: [] for name in RESOURCE_METRIC_FAMILIES}

    def add(name: str, labels: dict[str, str], value: float, timed: bool = True) -> None:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        series = f"{name}{{{text}}}" if text else name
        samples[name].append(f"{series} {value!r}" + (f" {stamp}" if timed else ""))

    add("node_cpu_usage_seconds_total", {}, sum(u.cpu_ns for u in usages) / 1e9)
    add("node_memory_working_set_bytes", {}, float(sum(u.memory_bytes for u in usages)))
    for u in usages:
        pod = {"namespace": u.namespace, "pod": u.name}
        container = {**pod, "container": u.container}
        add("container_start_time_seconds", container, u.started, timed=False)
        add("container_cpu_usage_seconds_total", container, u.cpu_ns / 1e9)
        add("container_memory_working_set_bytes", container, float(u.memory_bytes))
        add("pod_cpu_usage_seconds_total", pod, u.cpu_ns / 1e9)
        add("pod_memory_working_set_bytes", pod, float(u.memory_bytes))
    add("resource_scrape_error", {}, 0.0, timed=False)
    lines = []
    for name, (kind, help_text) in RESOURCE_METRIC_FAMILIES.items():
        if samples[name]:
            lines += [f"# HELP {name} [STABLE] {help_text}", f"# TYPE {name} {kind}"]
            lines += sorted(samples[name])
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def process_start(pid: int) -> float:
    """When process `pid` started, in epoch seconds (now if it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    return time.time()
