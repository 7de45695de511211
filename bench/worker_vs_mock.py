"""Benchmark: pod create -> Running on a real kubelet worker beside a vkubelet mock node, in one
dev cluster. Prints figures.

    .venv/bin/python bench/worker_vs_mock.py [--bursts 10 100] [--rounds 2] [--cluster NAME]

The real kubelet (containerd, runc, the CNI bridge, the pause and busybox images loaded locally) is
the anchor a user compares a virtual node with. For each burst size, pods are created as fast as
the API takes them, bound by nodeName to the worker or to the mock node (the mock's pods tolerate
its taint), and a watch notes when each is first seen Running. Latency is from our client's
create answer to that event; p50/p99 and the wall time of the whole burst are printed per node.
Rounds alternate worker and mock so that neither always runs on a warmer machine. Without
`--cluster` it starts a cluster with one worker (root needed) and stops it at the end.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2 as httpx
from _common import http_client, log, new_namespace, pct, print_table, wait_until, watch_pods

from vkubelet.devcluster import Cluster, list_clusters
from vkubelet.testing import Kubectl, mock_node


def pod(name: str, node: str, image: str, virtual: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeName": node,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "main",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "3600"],
            }
        ],
    }
    if virtual:
        spec["tolerations"] = [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def busy_cores() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def quiet_machine(below: float = 0.25, within: float = 180) -> float:
    """Wait until the whole machine uses less than `below` of its cores over 2 s: after a burst
    of 100 real containers, the kubelet and containerd keep tearing down for a while, and a
    burst measured meanwhile (on either node) would pay for it. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        busy0, total0 = busy_cores()
        await asyncio.sleep(2)
        busy1, total1 = busy_cores()
        if (busy1 - busy0) / max(total1 - total0, 1) < below:
            break
    return time.monotonic() - started


async def burst(
    client: httpx.AsyncClient, node: str, image: str, count: int, virtual: bool
) -> tuple[list[float], float]:
    """Create `count` pods on `node` at once; (latencies to Running, wall time), then delete."""
    ns = await new_namespace(client, "bench-worker")
    created: dict[str, float] = {}
    running: dict[str, float] = {}

    def on_event(kind: str, obj: dict[str, Any], at: float) -> None:
        name = obj["metadata"]["name"]
        if obj.get("status", {}).get("phase") == "Running" and name not in running:
            running[name] = at

    watcher = asyncio.create_task(watch_pods(client, ns, on_event))
    await asyncio.sleep(0.5)  # the watch is open before the first create
    names = [f"p-{uuid.uuid4().hex[:6]}-{i}" for i in range(count)]
    started = time.monotonic()

    async def create(name: str) -> None:
        response = await client.post(
            f"/api/v1/namespaces/{ns}/pods", json=pod(name, node, image, virtual)
        )
        response.raise_for_status()
        created[name] = time.monotonic()

    await asyncio.gather(*(create(n) for n in names))
    await wait_until(lambda: len(running) == count, 600, f"{count} pods Running on {node}")
    wall = max(running.values()) - started
    watcher.cancel()
    latencies = [running[n] - created[n] for n in names]
    # The next burst starts on a quiet machine: tearing down 100 real containers takes the CPU
    # for a while, and a burst measured meanwhile would pay for it.
    await client.delete(f"/api/v1/namespaces/{ns}")
    gone = time.monotonic() + 300
    while (await client.get(f"/api/v1/namespaces/{ns}")).status_code != 404:
        if time.monotonic() > gone:
            raise TimeoutError(f"namespace {ns} still there after 300 s")
        await asyncio.sleep(0.5)
    return latencies, wall


async def main_async(cluster: Cluster, bursts: list[int], rounds: int) -> None:
    kubectl = Kubectl(cluster.kubeconfig)
    worker = cluster.workers()[0].name
    image = cluster.image_reference("busybox")
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock_node(
            cluster, kubectl, Path(tmp), prefix="vk-bench", mock_config={"pods": "1000"}
        ) as mock,
    ):
        log(f"worker {worker}, mock node {mock.name}; image {image}")
        async with http_client(cluster.kubeconfig, 100) as client:
            results: dict[tuple[str, int], list[float]] = {}
            walls: dict[tuple[str, int], list[float]] = {}
            for size in bursts:
                for r in range(rounds):
                    order = [("kubelet", worker, False), ("vkubelet mock", mock.name, True)]
                    for label, node, virtual in order if r % 2 == 0 else order[::-1]:
                        await quiet_machine()
                        latencies, wall = await burst(client, node, image, size, virtual)
                        results.setdefault((label, size), []).extend(latencies)
                        walls.setdefault((label, size), []).append(wall)
                        log(
                            f"{label} burst of {size}: p50 {pct(latencies, 0.5):.2f}s, "
                            f"wall {wall:.1f}s"
                        )
    rows: list[tuple[str, ...]] = [
        ("node", "burst", "p50 (s)", "p99 (s)", "max (s)", "burst wall (s)")
    ]
    for (label, size), latencies in results.items():
        rows.append(
            (
                label,
                str(size),
                f"{pct(latencies, 0.5):.2f}",
                f"{pct(latencies, 0.99):.2f}",
                f"{max(latencies):.2f}",
                "/".join(f"{w:.1f}" for w in walls[(label, size)]),
            )
        )
    print(f"\npod create -> Running, {rounds} round(s) per burst size, cluster {cluster.name}")
    print_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cluster", help="a running dev cluster with workers (default: a new one)")
    args = parser.parse_args()
    if args.cluster:
        found = {c.name: c for c in list_clusters()}
        if args.cluster not in found or not found[args.cluster].workers():
            raise SystemExit(f"--cluster {args.cluster}: no such cluster with workers is up")
        cluster, ours = found[args.cluster], False
    else:
        if os.geteuid() != 0:
            raise SystemExit("worker nodes need root")
        cluster, ours = Cluster(f"bench-workers-{os.getpid()}"), True
        cluster.up(workers=1, progress=log, tie_to_parent=True)
    try:
        asyncio.run(main_async(cluster, args.bursts, args.rounds))
    finally:
        if ours:
            cluster.down()


if __name__ == "__main__":
    main()
