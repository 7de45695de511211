"""Benchmark: pods on one mock node, against a real local control plane. Prints figures.

    .venv/bin/python bench/agent_pods.py [--pods 1000 10000] [--paced-rate 100] [--cluster NAME]

For each pod count it measures, with the agent (`vkubelet run`, mock provider) as a child process:
- pods/s from the first create to the last pod observed Running by a watch, and p50/p99 of
  creation -> Running (creation = when our client got the API's answer);
- the time to delete them all (API objects gone);
- agent RSS and CPU seconds, RSS per pod, and idle CPU with all pods running;
and, in the same run, the apiserver's own ceiling: a plain client creating pods bound to a node
with no agent and patching their status to Running as fast as it can. A paced run offers pods at
a fixed rate (default 100/s) to report latency under a steady load.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
from _common import WatchEvent, cpu_seconds, http_client, new_namespace, pct, wait_until

from vkubelet.devcluster import Cluster, list_clusters
from vkubelet.kube import ClientOptions, KubeClient

CONCURRENCY = 64


def pod_body(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "yes"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "c", "image": "bench/app:1"}],
        },
    }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Watcher:
    """Watches the namespace's pods and records when each was first seen Running, or deleted."""

    def __init__(self, client: httpx.AsyncClient, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.running_at: dict[str, float] = {}
        self.deleted_at: dict[str, float] = {}
        self.ready = asyncio.Event()

    async def run(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        listed = (await self.client.get(path)).json()
        version = listed["metadata"]["resourceVersion"]
        while True:
            params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}
            async with self.client.stream("GET", path, params=params, timeout=None) as response:
                self.ready.set()
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    now = time.monotonic()
                    event = msgspec.json.decode(line, type=WatchEvent)
                    if event.type == "ERROR":  # e.g. 410 Gone after a long burst: relist
                        break
                    version = event.object.metadata.resourceVersion or version
                    name = event.object.metadata.name
                    if event.type == "DELETED":
                        self.deleted_at.setdefault(name, now)
                    elif event.object.status and event.object.status.phase == "Running":
                        self.running_at.setdefault(name, now)


async def create_pods(
    client: httpx.AsyncClient, ns: str, names: list[str], node: str, rate: float | None
) -> dict[str, float]:
    """Create pods (concurrently, or paced at `rate`/s); return when each create was answered."""
    created: dict[str, float] = {}
    queue: asyncio.Queue[str] = asyncio.Queue()
    start = time.monotonic()

    async def one(name: str) -> None:
        for _ in range(10):
            try:
                response = await client.post(
                    f"/api/v1/namespaces/{ns}/pods", json=pod_body(name, node)
                )
            except httpx.TransportError:  # the apiserver shedding connections under load
                await asyncio.sleep(0.2)
                continue
            if response.status_code in (429, 500, 503, 504):
                await asyncio.sleep(0.2)
                continue
            response.raise_for_status()
            created[name] = time.monotonic()
            return
        raise RuntimeError(f"could not create {name}: {response.status_code} {response.text}")

    async def worker() -> None:
        while not queue.empty():
            await one(queue.get_nowait())

    if rate is None:
        for name in names:
            queue.put_nowait(name)
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    else:
        tasks = []
        for i, name in enumerate(names):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(name)))
        await asyncio.gather(*tasks)
    return created


async def delete_all(client: httpx.AsyncClient, ns: str, names: list[str]) -> None:
    """Delete every pod with the default grace period, as a scale-down would, 64 at a time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for name in names:
        queue.put_nowait(name)

    async def worker() -> None:
        while not queue.empty():
            name = queue.get_nowait()
            response = await client.request(
                "DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", json={"gracePeriodSeconds": 30}
            )
            if response.status_code != 404:
                response.raise_for_status()

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


@dataclass
class Ceiling:
    pods: int
    create_per_s: float
    patch_per_s: float
    same_load_per_s: float  # a plain watch+patch client, with pods created as in the agent run


async def apiserver_ceiling(kubeconfig: Path, pods: int) -> Ceiling:
    """A plain client, no agent: create pods bound to a node, then patch each to Running."""
    client = http_client(kubeconfig, CONCURRENCY)
    ns = await new_namespace(client, "bench")
    names = [f"c-{i}" for i in range(pods)]
    started = time.monotonic()
    await create_pods(client, ns, names, "no-such-node", None)
    create_rate = pods / (time.monotonic() - started)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for name in names:
        queue.put_nowait(name)
    status = running_status()
    headers = {"Content-Type": "application/strategic-merge-patch+json"}

    async def worker() -> None:
        while not queue.empty():
            name = queue.get_nowait()
            response = await client.patch(
                f"/api/v1/namespaces/{ns}/pods/{name}/status",
                content=json.dumps(status),
                headers=headers,
            )
            response.raise_for_status()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    patch_rate = pods / (time.monotonic() - started)
    await client.request(
        "DELETE", f"/api/v1/namespaces/{ns}", json={"propagationPolicy": "Background"}
    )

    # The same job as the agent's, done by the thinnest possible client in its own process (as
    # the agent is): pods are created as in the agent run, and a watch-driven patcher marks each
    # Running as soon as it appears.
    ns = await new_namespace(client, "bench")
    watcher = Watcher(client, ns)
    watch_task = asyncio.create_task(watcher.run())
    await watcher.ready.wait()
    patcher = subprocess.Popen(  # noqa: ASYNC220 - started once, before measuring
        [
            sys.executable,
            __file__,
            "--cluster",
            "-",
            "--plain-patcher",
            ns,
            "--kubeconfig",
            str(kubeconfig),
        ]
    )
    await asyncio.sleep(1.5)
    started = time.monotonic()
    await create_pods(client, ns, [f"s-{i}" for i in range(pods)], "no-such-node", None)
    await wait_until(lambda: len(watcher.running_at) >= pods, 600, "plain client: all Running")
    same_load = pods / (max(watcher.running_at.values()) - started)
    patcher.terminate()
    patcher.wait(10)
    watch_task.cancel()
    await client.request(
        "DELETE", f"/api/v1/namespaces/{ns}", json={"propagationPolicy": "Background"}
    )
    await client.aclose()
    return Ceiling(pods, create_rate, patch_rate, same_load)


def running_status() -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    container = {
        "name": "c",
        "ready": True,
        "restartCount": 0,
        "image": "bench/app:1",
        "imageID": "",
        "state": {"running": {"startedAt": now}},
    }
    return {
        "status": {
            "phase": "Running",
            "podIP": "10.1.0.1",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [container],
        }
    }


async def plain_patcher(kubeconfig: Path, ns: str) -> None:
    """Watch a namespace and patch each new pod to Running, CONCURRENCY at a time, until killed."""
    client = http_client(kubeconfig, CONCURRENCY)
    todo: asyncio.Queue[str] = asyncio.Queue()
    body = json.dumps(running_status())
    headers = {"Content-Type": "application/strategic-merge-patch+json"}

    async def worker() -> None:
        while True:
            name = await todo.get()
            path = f"/api/v1/namespaces/{ns}/pods/{name}/status"
            for _ in range(20):  # a plain client still retries what the apiserver sheds
                try:
                    response = await client.patch(path, content=body, headers=headers)
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
                    continue
                if response.status_code < 300:
                    break
                await asyncio.sleep(0.1)

    workers = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)]
    path = f"/api/v1/namespaces/{ns}/pods"
    seen: set[str] = set()
    while True:  # re-list and re-watch whenever a watch ends, as any controller must
        listed = (await client.get(path)).json()
        for item in listed["items"]:
            name = item["metadata"]["name"]
            if name not in seen and (item.get("status") or {}).get("phase") != "Running":
                seen.add(name)
                todo.put_nowait(name)
        params = {"watch": "true", "resourceVersion": listed["metadata"]["resourceVersion"]}
        try:
            async with client.stream("GET", path, params=params, timeout=None) as response:
                async for line in response.aiter_lines():
                    event = msgspec.json.decode(line, type=WatchEvent) if line else None
                    if event is not None and event.type == "ADDED":
                        name = event.object.metadata.name
                        if name not in seen:
                            seen.add(name)
                            todo.put_nowait(name)
        except httpx.TransportError as e:
            print(f"plain patcher: watch ended ({e!r}); re-listing", file=sys.stderr)
    del workers


@dataclass
class AgentRun:
    pods: int
    offered_rate: float | None
    pods_per_s: float
    p50: float
    p99: float
    delete_s: float
    rss_before_mib: float
    rss_running_mib: float
    rss_per_pod_kib: float
    cpu_s: float
    idle_cpu_pct: float


def start_agent(kubeconfig: Path, node: str, work: Path) -> subprocess.Popen[bytes]:
    config = work / "mock.json"
    config.write_text(json.dumps({node: {"cpu": "1000", "memory": "4Ti", "pods": "100000"}}))
    exe = Path(sys.prefix) / "bin" / "vkubelet"
    log = (work / "agent.log").open("wb")
    return subprocess.Popen(
        [
            str(exe),
            "run",
            "--kubeconfig",
            str(kubeconfig),
            "--provider",
            "mock",
            "--provider-config",
            str(config),
            "--nodename",
            node,
            # Ready waits for the kubelet API, whose serving CSR nobody else approves here.
            "--approve-own-csrs",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


async def wait_node_ready(client: httpx.AsyncClient, node: str) -> None:
    for _ in range(600):
        response = await client.get(f"/api/v1/nodes/{node}")
        if response.is_success:
            conditions = response.json()["status"].get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"node {node} never became Ready")


async def agent_run(kubeconfig: Path, pods: int, rate: float | None, idle_s: float) -> AgentRun:
    node = f"vk-bench-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(kubeconfig, node, Path(tmp))
        client = http_client(kubeconfig, CONCURRENCY)
        try:
            await wait_node_ready(client, node)
            ns = await new_namespace(client, "bench")
            await asyncio.sleep(2)  # let the agent settle before measuring its baseline
            rss_before = rss_kib(agent.pid)
            cpu_before = cpu_seconds(agent.pid)
            watcher = Watcher(client, ns)
            watch_task = asyncio.create_task(watcher.run())
            await watcher.ready.wait()
            names = [f"p-{i}" for i in range(pods)]
            started = time.monotonic()
            created = await create_pods(client, ns, names, node, rate)
            await wait_until(lambda: len(watcher.running_at) >= pods, 600, "all pods Running")
            elapsed = max(watcher.running_at.values()) - started
            latencies = [watcher.running_at[n] - created[n] for n in names]
            # Events are rate-limited (50/s, at most 1000 queued), so the agent keeps sending
            # them for up to ~20 s after a burst; idle is measured after that.
            await asyncio.sleep(25)
            rss_running = rss_kib(agent.pid)
            cpu_busy = cpu_seconds(agent.pid) - cpu_before
            idle_start = cpu_seconds(agent.pid)
            await asyncio.sleep(idle_s)
            idle_pct = 100 * (cpu_seconds(agent.pid) - idle_start) / idle_s
            deleting = time.monotonic()
            await delete_all(client, ns, names)
            await wait_until(lambda: len(watcher.deleted_at) >= pods, 600, "all pods deleted")
            delete_s = max(watcher.deleted_at.values()) - deleting
            watch_task.cancel()
            await client.request("DELETE", f"/api/v1/namespaces/{ns}")
            await client.request("DELETE", f"/api/v1/nodes/{node}")
        finally:
            agent.terminate()
            agent.wait(10)
            await client.aclose()
    return AgentRun(
        pods=pods,
        offered_rate=rate,
        pods_per_s=pods / elapsed,
        p50=statistics.median(latencies),
        p99=pct(latencies, 0.99),
        delete_s=delete_s,
        rss_before_mib=rss_before / 1024,
        rss_running_mib=rss_running / 1024,
        rss_per_pod_kib=(rss_running - rss_before) / pods,
        cpu_s=cpu_busy,
        idle_cpu_pct=idle_pct,
    )


async def many_nodes(kubeconfig: Path, count: int, duration: float) -> dict[str, Any]:
    """`count` mock nodes in one process: are their leases renewed on time?"""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        names = [f"vk-many-{i}" for i in range(count)]
        (work / "mock.json").write_text(json.dumps({n: {"pods": "110"} for n in names}))
        config = {
            "nodes": [{"name": n, "provider": "mock", "providerConfig": "mock.json"} for n in names]
        }
        (work / "agent.yaml").write_text(json.dumps(config))
        exe = Path(sys.prefix) / "bin" / "vkubelet"
        log = (work / "agent.log").open("wb")
        agent = subprocess.Popen(  # noqa: ASYNC220 - started once, before measuring
            [
                str(exe),
                "run",
                "--kubeconfig",
                str(kubeconfig),
                "--config",
                str(work / "agent.yaml"),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        client = KubeClient.from_kubeconfig(kubeconfig, options=ClientOptions())
        started = time.monotonic()
        registered_at = None
        worst_age = 0.0
        late = 0
        samples = 0
        try:
            while time.monotonic() - started < duration + 120:
                leases = await client.get(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
                )
                now = datetime.now(UTC)
                ours = [i for i in leases["items"] if i["metadata"]["name"].startswith("vk-many-")]
                if registered_at is None:
                    if len(ours) < count:
                        await asyncio.sleep(1)
                        continue
                    registered_at = time.monotonic()
                for lease in ours:
                    renewed = datetime.fromisoformat(lease["spec"]["renewTime"])
                    age = (now - renewed).total_seconds()
                    worst_age = max(worst_age, age)
                    late += age > 15  # renewed every 10 s; the node is lost after 40 s
                samples += 1
                if time.monotonic() - registered_at > duration:
                    break
                await asyncio.sleep(2)
            rss = rss_kib(agent.pid) / 1024
            cpu = cpu_seconds(agent.pid)
        finally:
            agent.terminate()
            agent.wait(30)
            for name in names:
                with contextlib.suppress(Exception):  # best-effort cleanup
                    await client.delete(f"/api/v1/nodes/{name}")
            await client.aclose()
    return {
        "nodes": count,
        "registration_s": (registered_at or time.monotonic()) - started,
        "samples": samples,
        "late_lease_observations": late,
        "worst_lease_age_s": worst_age,
        "agent_rss_mib": rss,
        "agent_cpu_s": cpu,
    }


def cluster_for(name: str | None) -> tuple[Cluster, bool]:
    if name:
        found = {c.name: c for c in list_clusters()}
        return found[name], False
    cluster = Cluster(f"bench-{os.getpid()}")
    cluster.up(progress=lambda m: print(m, file=sys.stderr))
    return cluster, True


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, nargs="*", default=[1000, 10000])
    parser.add_argument("--paced-rate", type=float, default=100.0)
    parser.add_argument("--paced-pods", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=1000, help="many-nodes run (0 to skip)")
    parser.add_argument("--nodes-seconds", type=float, default=60.0)
    parser.add_argument("--cluster", help="reuse a running `vkubelet dev cluster`")
    parser.add_argument("--plain-patcher", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_patcher:
        await plain_patcher(Path(args.kubeconfig), args.plain_patcher)
        return
    cluster, owned = cluster_for(args.cluster)
    kubeconfig = cluster.kubeconfig
    try:
        print(
            f"# vkubelet agent benchmark — {os.cpu_count()} CPUs, Kubernetes "
            f"{cluster.kubernetes_version}, mock provider"
        )
        for pods in args.pods:
            ceiling = await apiserver_ceiling(kubeconfig, pods)
            run = await agent_run(kubeconfig, pods, None, args.idle_seconds)
            share = 100 * run.pods_per_s / ceiling.same_load_per_s
            print(f"\n## {pods} pods, created as fast as possible ({CONCURRENCY} in flight)")
            print(
                f"apiserver alone, plain client: create {ceiling.create_per_s:.0f}/s; "
                f"status patch {ceiling.patch_per_s:.0f}/s; creates + watch-driven patches "
                f"together {ceiling.same_load_per_s:.0f} pods/s to Running"
            )
            print(
                f"agent: {run.pods_per_s:.0f} pods/s to Running = {share:.0f}% of the plain "
                f"client under the same load; creation->Running p50 {run.p50 * 1000:.0f} ms, "
                f"p99 {run.p99 * 1000:.0f} ms"
            )
            print(
                f"delete all: {run.delete_s:.1f} s; agent RSS {run.rss_before_mib:.0f} -> "
                f"{run.rss_running_mib:.0f} MiB ({run.rss_per_pod_kib:.1f} KiB/pod); "
                f"CPU {run.cpu_s:.1f} s; idle CPU {run.idle_cpu_pct:.2f}% of a core"
            )
        if args.paced_pods:
            run = await agent_run(kubeconfig, args.paced_pods, args.paced_rate, 10)
            print(f"\n## {args.paced_pods} pods offered at {args.paced_rate:.0f}/s")
            print(f"creation->Running p50 {run.p50 * 1000:.0f} ms, p99 {run.p99 * 1000:.0f} ms")
        if args.nodes:
            result = await many_nodes(kubeconfig, args.nodes, args.nodes_seconds)
            print(f"\n## {result['nodes']} mock nodes in one process, {args.nodes_seconds:.0f} s")
            print(
                f"all registered after {result['registration_s']:.1f} s; late lease "
                f"observations (>15 s old) {result['late_lease_observations']} over "
                f"{result['samples']} samples; worst lease age "
                f"{result['worst_lease_age_s']:.1f} s; agent RSS "
                f"{result['agent_rss_mib']:.0f} MiB, CPU {result['agent_cpu_s']:.0f} s"
            )
    finally:
        if owned:
            cluster.down()


if __name__ == "__main__":
    asyncio.run(main())
