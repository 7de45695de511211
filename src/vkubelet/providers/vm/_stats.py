"""`kubectl top` for VMs: each VM's QEMU process (CPU time, resident memory) as its pod and its
container, formatted by `vkubelet.sdk.stats` like every provider that measures real usage.

A VM's cost to the host is its QEMU process, guest RAM included, so that is what is reported; the
node's figures are the sum over its VMs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from ...sdk.stats import ContainerUsage, CpuCounters, NodeUsage, PodUsage, Usage

__all__ = ["QemuReading", "VMUsage", "process_start"]


@dataclass(frozen=True)
class QemuReading:
    """One VM's QEMU process as read at a scrape."""

    namespace: str
    name: str
    uid: str
    container: str
    started: float  # the QEMU process's start, epoch seconds
    cpu_ns: int  # its CPU time so far
    memory_bytes: int  # its resident memory


class VMUsage:
    """The node's and its VMs' usage from each scrape's readings.

    A VM's container counter belongs to one QEMU process (a reboot or a migration starts a new
    one, hence a new counter); the pod's and the node's counters span processes and never go
    back when one ends (`CpuCounters`), as metrics-server needs.
    """

    def __init__(self, node_name: str) -> None:
        self._node_name = node_name
        self._counters = CpuCounters()

    def sample(
        self, readings: list[QemuReading], memory: int, when: float
    ) -> tuple[NodeUsage, list[PodUsage]]:
        """The usage at `when` (epoch seconds); `memory` is the node's allocatable memory."""
        pods: list[PodUsage] = []
        keys: list[Hashable] = ["node"]
        for r in readings:
            run = (r.uid, r.started)
            cpu, rate = self._counters.update(run, r.cpu_ns, when)
            container = ContainerUsage(r.container, r.started, Usage(cpu, rate, r.memory_bytes))
            cpu, rate = self._counters.update(r.uid, r.cpu_ns, when)
            usage = Usage(cpu, rate, r.memory_bytes)
            pods.append(PodUsage(r.namespace, r.name, r.uid, r.started, [container], usage))
            keys += [run, r.uid]
        used = sum(r.memory_bytes for r in readings)
        cpu, rate = self._counters.update("node", sum(r.cpu_ns for r in readings), when)
        node = NodeUsage(
            self._node_name, _boot_time(), Usage(cpu, rate, used), max(memory - used, 0)
        )
        self._counters.keep_only(keys)
        return node, pods


def process_start(pid: int) -> float:
    """When process `pid` started, in epoch seconds (now if it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    return time.time()


def _boot_time() -> float:
    """The host's boot, epoch seconds (`btime` of /proc/stat)."""
    return next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
