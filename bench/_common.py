"""What the benchmarks share: /proc readings, percentiles and tables, the API client and the
pod watch's types, and the dev cluster to run against.

The scripts are run as `.venv/bin/python bench/NAME.py`, which puts this directory on sys.path,
so they import this module as `_common`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
from lightkube.config.kubeconfig import KubeConfig

from vkubelet.devcluster import Cluster, list_clusters

TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- figures --------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it (so with
    100 values p50 is the 50th, p99 the second largest, and with 50 values p99 is the largest).
    NaN when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), 9))  # rounded: 0.07 * 100 is 7.000000000000001
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the live process `pid` (not of its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree_cpu(selected: Callable[[Path], bool]) -> float:
    """CPU seconds of the live processes `selected` picks, with their reaped children's."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not selected(proc):
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / TICKS


def control_plane_cpu(cluster: Cluster, only: Collection[str] = ()) -> float:
    """etcd, kube-apiserver, scheduler and controller-manager (or those of them named in
    `only`): their command lines name files in the cluster's directory."""
    marker = str(cluster.directory).encode()

    def selected(proc: Path) -> bool:
        if only and (proc / "comm").read_text().strip() not in only:
            return False
        return marker in (proc / "cmdline").read_bytes()

    return tree_cpu(selected)


async def quiet_control_plane(cluster: Cluster, cores: float = 0.2, within: float = 180) -> float:
    """Wait until the cluster's control plane uses less than `cores` over 2 s (at most `within`
    seconds); the CPU it used last. A run measured while the last one's aftermath (a namespace
    and its events being deleted, a compaction) still loads the apiserver measures that too."""
    deadline = time.monotonic() + within
    while True:
        before = control_plane_cpu(cluster)
        await asyncio.sleep(2)
        used = (control_plane_cpu(cluster) - before) / 2
        if used < cores or time.monotonic() > deadline:
            return used


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


# -- the API --------------------------------------------------------------------------------------


def http_client(kubeconfig: Path, concurrency: int) -> httpx.AsyncClient:
    """A client as the kubeconfig's admin, keeping connections for `concurrency` requests in
    flight (twice as many, for a watch and the stragglers)."""
    from lightkube.config.client_adapter import ConnectionParams

    config = KubeConfig.from_file(kubeconfig).get()
    assert config is not None
    params = ConnectionParams(timeout=httpx.Timeout(60.0), trust_env=False)
    return httpx.AsyncClient(
        **params.httpx_params(config),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=concurrency * 2),
    )


# What a pod watch reads of the pods (msgspec skips the rest of each object).


class ObjectMeta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""


class PodStatus(msgspec.Struct):
    phase: str | None = None


class Pod(msgspec.Struct):
    metadata: ObjectMeta
    status: PodStatus | None = None


class WatchEvent(msgspec.Struct):
    type: str
    object: Pod


class PodList(msgspec.Struct):
    metadata: ObjectMeta
    items: list[Pod]


async def request_counts(client: httpx.AsyncClient) -> Counter[str]:
    """The apiserver's own request counters (`apiserver_request_total`), summed per
    "VERB resource[/subresource]": diffs of two readings say what a run asked of it."""
    counts: Counter[str] = Counter()
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if not labels.get("resource"):
            continue
        what = labels["resource"] + (f"/{labels['subresource']}" if labels["subresource"] else "")
        counts[f"{labels['verb']} {what}"] += int(float(line.rsplit(" ", 1)[1]))
    return counts


async def wait_until(check: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


async def watch_pods(
    client: httpx.AsyncClient,
    namespace: str,
    on_event: Callable[[str, dict[str, Any], float], None],
) -> None:
    """Every pod event of the namespace, with the monotonic time it arrived, for ever: the
    watch resumes from the last resourceVersion when the apiserver ends it."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    version = (await client.get(path)).json()["metadata"]["resourceVersion"]
    while True:
        params = {"watch": "true", "resourceVersion": version}
        async with client.stream("GET", path, params=params, timeout=None) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                now = time.monotonic()
                event = json.loads(line)
                if event["type"] == "ERROR":
                    break
                pod = event["object"]
                version = pod["metadata"]["resourceVersion"]
                on_event(event["type"], pod, now)


async def new_namespace(client: httpx.AsyncClient, prefix: str) -> str:
    """A fresh namespace `<prefix>-<random>`, once pods can be created in it."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    (await client.post("/api/v1/namespaces", json=body)).raise_for_status()
    # The ServiceAccount admission plugin refuses pods until the namespace's account exists.
    for _ in range(200):
        if (await client.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default")).is_success:
            break
        await asyncio.sleep(0.1)
    return ns


# -- the control plane ----------------------------------------------------------------------------


def cluster_for(name: str | None, prefix: str) -> tuple[Cluster, bool]:
    """The running dev cluster `name`, or a new one `<prefix>-<pid>` that dies with this process;
    and whether it is ours to take down."""
    if name:
        found = {c.name: c for c in list_clusters()}
        if name not in found or not found[name].is_up():
            raise SystemExit(f"--cluster {name}: no such cluster is up")
        return found[name], False
    cluster = Cluster(f"{prefix}-{os.getpid()}")
    cluster.up(progress=log, tie_to_parent=True)
    return cluster, True


def run_vm_bench(
    benchmark: Callable[[Cluster, Path], Coroutine[Any, Any, None]],
    cluster_name: str | None,
    prefix: str,
) -> None:
    """What a VM benchmark's main needs around its run: root and QEMU, a dev cluster (started
    and stopped here unless one is named), and a short scratch directory (QEMU's socket paths
    have a length limit) removed at the end."""
    if os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None:
        raise SystemExit("needs root and qemu-system-x86_64")
    cluster, ours = cluster_for(cluster_name, prefix)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix[:3]}-", dir="/tmp"))
    try:
        asyncio.run(benchmark(cluster, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if ours:
            cluster.down()
