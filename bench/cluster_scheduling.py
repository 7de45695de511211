"""Benchmark: scheduling accuracy across two lower clusters, aggregate vs mirror mode. Prints
figures.

    .venv/bin/python bench/cluster_scheduling.py [--pods 500] [--mix tight|light] [--window 60]
        [--settle 180] [--rounds 6] [--upper NAME] [--lower1 NAME] [--lower2 NAME]
        [--modes aggregate,mirror]

Three dev clusters on this machine: the upper one and two lower ones, whose nodes are vkubelet
mock nodes (one `vkubelet run --config` process per lower cluster), 32 CPUs each, with pods of
another owner ("fillers") leaving a *fragmented* free room: from 0.5 to 16 CPUs per node. The
cluster provider runs as one agent (`vkubelet run --config agent.yaml`) with one entry per lower
cluster, in aggregate mode (one virtual node per lower cluster) or mirror mode (one per lower
node); the modes run one after the other on the same lower clusters.

- **Accuracy**: a generated mix of pods (fixed seed; 25m to 3 CPUs, mostly small; in the default
  `tight` mix 3-CPU pods ask half the free room, and fit only the few large holes) is created as
  one ReplicaSet per size, pinned to the mode's virtual nodes. After `--window` seconds, and
  again once settled (`--settle`): the fraction of pods Running, Pending upstairs (unbound),
  Pending below (bound, not Running yet; of those, found unschedulable by the lower scheduler),
  and the **wasted bind attempts**: pods bound to a virtual node and then failed
  `LowerClusterCannotFit` (each replaced by its ReplicaSet). For scale, a first-fit-decreasing
  packing of the same mix into the free room says how many pods could run at best.
- **Node change -> virtual node update**: a lower node cordoned and uncordoned, and a small pod
  of another owner bound to a lower node and force-deleted (a capacity change): the time from
  the lower API's answer to the change being visible on the upper virtual node (polled every
  50 ms), p50/p99.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx2 as httpx
import yaml
from _common import cluster_for, http_client, log, new_namespace, pct, print_table

from vkubelet.devcluster import Cluster
from vkubelet.sdk import parse_quantity
from vkubelet.testing import AgentProcess, Kubectl, node_ready, wait_for

JSON = dict[str, Any]
NODE_CPU = 32
# Free CPUs per lower node once the fillers run: fragmented, as a busy cluster is.
FREE = {
    "c1": ["0.5", "1", "2", "2.5", "4", "6", "12", "16"],
    "c2": ["1", "1.5", "2", "3", "3.5", "6", "10", "16"],
}
# CPU request -> share of the pods. "tight": 3-CPU pods take half the room, and fit only the
# few large holes that the small pods (spread by the lower scheduler) have not eaten yet: the
# case aggregate mode's summed allocatable hides. "light": mostly small pods, few big ones.
MIXES = {
    "tight": [
        ("25m", 0.51),
        ("50m", 0.25),
        ("100m", 0.13),
        ("250m", 0.06),
        ("500m", 0.01),
        ("1", 0.01),
        ("3", 0.03),
    ],
    "light": [
        ("25m", 0.48),
        ("50m", 0.25),
        ("100m", 0.12),
        ("250m", 0.08),
        ("500m", 0.04),
        ("1", 0.02),
        ("3", 0.01),
    ],
}
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
CANNOT_FIT = "LowerClusterCannotFit"


def cpu(value: str) -> Fraction:
    return parse_quantity(value).to_fraction()


def mix(pods: int, name: str = "tight", seed: int = 11) -> dict[str, int]:
    """How many pods of each size: the shares, rounded, with a seeded remainder."""
    shares = MIXES[name]
    counts = {size: int(pods * share) for size, share in shares}
    rng = random.Random(seed)  # noqa: S311 - a reproducible mix, not security
    while sum(counts.values()) < pods:
        counts[rng.choices([s for s, _ in shares], [w for _, w in shares])[0]] += 1
    return counts


def best_packing(counts: dict[str, int]) -> int:
    """First-fit decreasing of the mix into every lower node's free room: about the most pods
    any scheduler could run."""
    bins = sorted((cpu(f) for frees in FREE.values() for f in frees), reverse=True)
    placed = 0
    for size in sorted(counts, key=cpu, reverse=True):
        for _ in range(counts[size]):
            for i, room in enumerate(bins):
                if room >= cpu(size):
                    bins[i] = room - cpu(size)
                    placed += 1
                    break
    return placed


# -- the lower clusters ---------------------------------------------------------------------------


@dataclass
class Lower:
    name: str  # c1, c2
    cluster: Cluster
    kubectl: Kubectl
    nodes: list[str]
    fillers: str  # the namespace of the other owner's pods


@contextlib.contextmanager
def lower_clusters(names: dict[str, str | None], work: Path) -> Iterator[list[Lower]]:
    """Both lower clusters, their mock nodes (one agent each) and the fillers."""
    with contextlib.ExitStack() as stack:
        lowers = []
        for key, reuse in names.items():
            cluster, owned = cluster_for(reuse, f"bench-{key}")
            if owned:
                stack.callback(cluster.down)
            kubectl = Kubectl(cluster.kubeconfig)
            nodes = [f"{key}-n{i}" for i in range(len(FREE[key]))]
            where = work / key
            where.mkdir(parents=True, exist_ok=True)
            capacity = {"cpu": str(NODE_CPU), "memory": "64Gi", "pods": "110"}
            (where / "mock.json").write_text(json.dumps({n: capacity for n in nodes}))
            entries = [
                {
                    "name": n,
                    "provider": "mock",
                    "providerConfig": "mock.json",
                    "internalIP": "127.0.0.1",
                    "kubeletPort": 0,
                    "taints": [],
                    "labels": {"topology.kubernetes.io/zone": f"{key}-z{i % 3}"},
                }
                for i, n in enumerate(nodes)
            ]
            (where / "agent.yaml").write_text(yaml.safe_dump({"certDir": "pki", "nodes": entries}))
            agent = AgentProcess(
                cluster.kubeconfig,
                [
                    "--config",
                    str(where / "agent.yaml"),
                    "--approve-own-csrs",
                    "--log-level",
                    "warning",
                ],
                where / "agent.log",
            ).start()
            stack.callback(kubectl, "delete", "nodes", *nodes, "--ignore-not-found", "--wait=false")
            stack.callback(agent.stop)
            lowers.append(Lower(key, cluster, kubectl, nodes, f"fillers-{uuid.uuid4().hex[:6]}"))
        for lower in lowers:
            for node in lower.nodes:
                wait_for(functools.partial(node_ready, lower.kubectl, node), timeout=120, what=node)
            lower.kubectl("create", "namespace", lower.fillers)
            for node, free in zip(lower.nodes, FREE[lower.name], strict=True):
                millis = int((NODE_CPU - cpu(free)) * 1000)
                body = pod_body(f"filler-{node}", f"{millis}m", node_name=node)
                lower.kubectl("-n", lower.fillers, "apply", "-f", "-", input=json.dumps(body))
            stack.callback(lower.kubectl, "delete", "namespace", lower.fillers, "--wait=false")
        for lower in lowers:
            wait_for(
                functools.partial(fillers_running, lower),
                timeout=120,
                what="fillers Running",
            )
        yield lowers


def fillers_running(lower: Lower) -> bool:
    pods = lower.kubectl.json("-n", lower.fillers, "get", "pods")["items"]
    running = sum(p["status"].get("phase") == "Running" for p in pods)
    return bool(running == len(lower.nodes))


def pod_body(name: str, cpu_request: str, *, node_name: str | None = None) -> JSON:
    spec: JSON = {
        "containers": [
            {
                "name": "app",
                "image": "registry.example/app:1",
                "resources": {"requests": {"cpu": cpu_request}},
            }
        ]
    }
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# -- the agent under test -------------------------------------------------------------------------


@dataclass
class Virtual:
    mode: str
    agent: AgentProcess
    nodes: list[str]  # the virtual nodes upstairs
    by_lower: dict[str, str]  # lower node -> the virtual node that shows it


@contextlib.contextmanager
def provider_agent(upper: Cluster, lowers: list[Lower], mode: str, work: Path) -> Iterator[Virtual]:
    where = work / mode
    where.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:4]
    entries = []
    nodes: list[str] = []
    by_lower: dict[str, str] = {}
    for lower in lowers:
        name = f"vks-{tag}-{lower.name}"
        config = {
            "kubeconfig": str(lower.cluster.kubeconfig),
            "upperClusterID": f"bench-{tag}",
            "clusterName": lower.name,
            "mode": mode,
        }
        (where / f"{lower.name}.yaml").write_text(yaml.safe_dump(config))
        entries.append(
            {
                "name": name,
                "provider": "cluster",
                "providerConfig": f"{lower.name}.yaml",
                "internalIP": "127.0.0.1",
                "kubeletPort": 0,
            }
        )
        if mode == "mirror":
            members = {n: f"{name}-{n}" for n in lower.nodes}
        else:
            members = dict.fromkeys(lower.nodes, name)
        by_lower.update(members)
        nodes.extend(sorted(set(members.values())))
    (where / "agent.yaml").write_text(yaml.safe_dump({"certDir": "pki", "nodes": entries}))
    agent = AgentProcess(
        upper.kubeconfig,
        ["--config", str(where / "agent.yaml"), "--approve-own-csrs", "--log-level", "warning"],
        where / "agent.log",
    ).start()
    uk = Kubectl(upper.kubeconfig)
    try:
        for node in nodes:
            wait_for(functools.partial(node_ready, uk, node), timeout=180, what=f"{node} Ready")
        yield Virtual(mode, agent, nodes, by_lower)
    finally:
        agent.stop()
        uk("delete", "nodes", *nodes, "--ignore-not-found", "--wait=false")


# -- node change -> virtual node update ----------------------------------------------------------


def _watched(node: JSON) -> tuple[Any, ...]:
    """What a lower change must alter upstairs: cordon and allocatable cpu."""
    return (bool(node["spec"].get("unschedulable")), node["status"]["allocatable"].get("cpu"))


async def node_changes(
    upper: httpx.AsyncClient, lowers: list[Lower], virtual: Virtual, rounds: int
) -> list[float]:
    """Per round, on a lower node (alternating clusters): cordon, uncordon, a 250m pod bound to
    it, that pod force-deleted; seconds from the lower API's answer to the upper node's change.
    The changes go through the API directly (not kubectl, whose exit would blur the start)."""
    samples: list[float] = []

    async def upstairs(node: str) -> tuple[Any, ...]:
        answer = await upper.get(f"/api/v1/nodes/{node}")
        answer.raise_for_status()
        return _watched(answer.json())

    async def timed(node: str, what: str, change: Any) -> None:
        await asyncio.sleep(1.2)  # the capacity loop recomputes at most once a second
        before = await upstairs(node)
        (await change).raise_for_status()
        started = time.monotonic()
        while (await upstairs(node)) == before:
            if time.monotonic() - started > 60:
                log(f"no change upstairs on {node} after {what}")
                return
            await asyncio.sleep(0.05)
        samples.append(time.monotonic() - started)

    merge = {"Content-Type": "application/merge-patch+json"}
    for i in range(rounds):
        lower = lowers[i % len(lowers)]
        pods = f"/api/v1/namespaces/{lower.fillers}/pods"
        target = lower.nodes[(i // len(lowers)) % len(lower.nodes)]
        node = virtual.by_lower[target]
        client = http_client(lower.cluster.kubeconfig, 2)
        try:
            for flag in (True, False):
                body = json.dumps({"spec": {"unschedulable": flag}})
                patch = client.patch(f"/api/v1/nodes/{target}", content=body, headers=merge)
                await timed(node, f"cordon={flag}", patch)
            bump = pod_body(f"bump-{i}", "250m", node_name=target)
            await timed(node, "a pod bound", client.post(pods, json=bump))
            gone = client.delete(f"{pods}/bump-{i}", params={"gracePeriodSeconds": "0"})
            await timed(node, "the pod deleted", gone)
        finally:
            await client.aclose()
    return samples


# -- accuracy -------------------------------------------------------------------------------------


@dataclass
class Tally:
    at: float
    running: int
    pending_upstairs: int
    pending_below: int  # bound to a virtual node, not Running yet
    unschedulable_below: int  # of those, the lower scheduler has found no node for
    wasted: int  # pods failed LowerClusterCannotFit (replaced by their ReplicaSet)
    other_failed: int


async def tally(upper: httpx.AsyncClient, ns: str, at: float) -> Tally:
    answer = await upper.get(f"/api/v1/namespaces/{ns}/pods")
    answer.raise_for_status()
    t = Tally(at, 0, 0, 0, 0, 0, 0)
    for pod in answer.json()["items"]:
        phase = (pod.get("status") or {}).get("phase")
        if phase == "Running":
            t.running += 1
        elif phase == "Failed":
            if pod["status"].get("reason") == CANNOT_FIT:
                t.wasted += 1
            else:
                t.other_failed += 1
        elif not pod["spec"].get("nodeName"):
            t.pending_upstairs += 1
        else:
            t.pending_below += 1
            t.unschedulable_below += pod["status"].get("reason") == "Unschedulable"
    return t


async def accuracy(
    upper: httpx.AsyncClient, virtual: Virtual, counts: dict[str, int], window: float, settle: float
) -> tuple[Tally, Tally, str]:
    ns = await new_namespace(upper, f"bench-{virtual.mode[:3]}")
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "In",
                                "values": virtual.nodes,
                            }
                        ]
                    }
                ]
            }
        }
    }
    started = time.monotonic()
    for size, replicas in counts.items():
        name = f"p-{size.replace('.', '-').lower()}"
        template = pod_body(name, size)
        template["metadata"]["labels"] = {"app": name}
        template["spec"] |= {"affinity": affinity, "tolerations": [TOLERATION]}
        body = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": template["metadata"], "spec": template["spec"]},
            },
        }
        (
            await upper.post(f"/apis/apps/v1/namespaces/{ns}/replicasets", json=body)
        ).raise_for_status()
    at_window: Tally | None = None
    last: Tally | None = None
    steady_since = time.monotonic()
    while True:
        now = time.monotonic() - started
        current = await tally(upper, ns, now)
        if at_window is None and now >= window:
            at_window = current
        if last is None or (current.running, current.wasted) != (last.running, last.wasted):
            steady_since = time.monotonic()
        last = current
        # Settled: nothing on its way (every bound pod Running or found unschedulable below)
        # and no change for 20 s.
        in_flight = current.pending_below - current.unschedulable_below
        settled = in_flight == 0 and time.monotonic() - steady_since > 20 and at_window is not None
        if now >= settle or settled:
            break
        await asyncio.sleep(1.0)
    assert at_window is not None and last is not None
    return at_window, last, ns


async def drop(upper: httpx.AsyncClient, lowers: list[Lower], ns: str) -> None:
    await upper.delete(f"/api/v1/namespaces/{ns}")
    for lower in lowers:
        for _ in range(240):
            pods = await asyncio.to_thread(lower.kubectl.json, "-n", ns, "get", "pods")
            if not pods["items"]:
                break
            await asyncio.sleep(1.0)
        await asyncio.to_thread(
            lower.kubectl, "delete", "namespace", ns, "--wait=false", "--ignore-not-found"
        )


# -- the run --------------------------------------------------------------------------------------


async def run_mode(
    upper_cluster: Cluster, lowers: list[Lower], mode: str, args: argparse.Namespace, work: Path
) -> tuple[Tally, Tally, list[float]]:
    counts = mix(args.pods, args.mix)
    upper = http_client(upper_cluster.kubeconfig, 8)
    try:
        with provider_agent(upper_cluster, lowers, mode, work) as virtual:
            log(f"{mode}: {len(virtual.nodes)} virtual node(s) Ready")
            changes = await node_changes(upper, lowers, virtual, args.rounds)
            log(f"{mode}: node changes p50 {pct(changes, 0.5):.2f}s")
            at_window, final, ns = await accuracy(upper, virtual, counts, args.window, args.settle)
            log(f"{mode}: {at_window} / {final}")
            await drop(upper, lowers, ns)
            return at_window, final, changes
    finally:
        await upper.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=500)
    parser.add_argument("--mix", choices=sorted(MIXES), default="tight")
    parser.add_argument("--window", type=float, default=60.0, help="seconds to the first tally")
    parser.add_argument("--settle", type=float, default=180.0, help="at most this long in all")
    parser.add_argument("--rounds", type=int, default=6, help="node change rounds (4 changes each)")
    parser.add_argument("--modes", default="aggregate,mirror")
    parser.add_argument("--upper", help="reuse a running `vkubelet dev cluster` as the upper one")
    parser.add_argument("--lower1", help="reuse a running dev cluster as the first lower one")
    parser.add_argument("--lower2", help="reuse a running dev cluster as the second lower one")
    parser.add_argument("--work", type=Path, help="keep the agents' logs here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    counts = mix(args.pods, args.mix)
    demand = sum(cpu(s) * n for s, n in counts.items())
    room = sum(cpu(f) for frees in FREE.values() for f in frees)
    print(
        f"mix: {', '.join(f'{n} x {s}' for s, n in counts.items())}: {float(demand):.1f} CPUs "
        f"asked of {float(room):.1f} free over {sum(map(len, FREE.values()))} lower nodes "
        f"(largest free on one node: {max(cpu(f) for v in FREE.values() for f in v)}); "
        f"first-fit decreasing places {best_packing(counts)} of {args.pods}"
    )
    results: dict[str, tuple[Tally, Tally, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        upper, owned = cluster_for(args.upper, "bench-upper")
        if owned:
            stack.callback(upper.down)
        lowers = stack.enter_context(lower_clusters({"c1": args.lower1, "c2": args.lower2}, work))
        for mode in args.modes.split(","):
            results[mode] = asyncio.run(run_mode(upper, lowers, mode, args, work))
    n = args.pods
    rows: list[tuple[str, ...]] = [
        (
            "mode",
            f"Running@{args.window:.0f}s",
            "settled",
            "at (s)",
            "wasted binds",
            "pending up",
            "pending below",
            "unschedulable below",
            "change p50",
            "change p99",
        )
    ]
    for mode, (w, f, changes) in results.items():
        rows.append(
            (
                mode,
                f"{100 * w.running / n:.1f} %",
                f"{100 * f.running / n:.1f} %",
                f"{f.at:.0f}",
                f"{f.wasted}",
                f"{f.pending_upstairs}",
                f"{f.pending_below}",
                f"{f.unschedulable_below}",
                f"{pct(changes, 0.5):.2f} s",
                f"{pct(changes, 0.99):.2f} s",
            )
        )
    print_table(rows)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
