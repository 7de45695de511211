"""Benchmark: the cluster provider (a lower cluster as one virtual node of an upper cluster).
Prints figures.

    .venv/bin/python bench/cluster_provider.py [--paced-pods 200] [--rate 20] [--pods 1000]
        [--rounds 1] [--execs 30] [--upper NAME] [--lower NAME] [--profile PREFIX]

Two dev clusters on this machine: the upper one (runs `vkubelet run --provider cluster` as a
child process) and the lower one, whose nodes are three vkubelet mock nodes (child processes too).
`--upper`/`--lower` reuse running `vkubelet dev cluster`s; otherwise both are started and removed.

- **Provider overhead** at a steady rate (default 200 pods offered at 20 pods/s): each upper pod
  is created bound to the virtual node (`spec.nodeName`: the bind), and two watches, one per
  cluster, record when each pod is seen. overhead = (upper bind -> upper Running seen) - (lower
  pod first seen -> lower Running seen), i.e. the upper path minus the lower cluster's own create
  -> Running for the same pod (lower scheduler, mock kubelet). Also split: bind -> lower pod seen
  (down) and lower Running -> upper Running (status up).
- **Throughput**: N pods (default 1,000) created as fast as possible (64 in flight) through the
  virtual node, then N pods created directly in the lower cluster (unbound: the lower scheduler
  places them), in the same run: first create -> last pod Running, and the ratio of the rates.
- **kubectl exec / logs -f latency** through the virtual node vs directly against the lower
  cluster, alternating: wall time of `kubectl exec POD -- true`, and of `kubectl logs -f
  --tail=1 POD` until its first line.

`--profile PREFIX` samples the agent with py-spy (`pip install py-spy`) during each
virtual-node burst and writes `PREFIX-N.txt` (py-spy's raw format: one stack and its sample
count a line), from the first create to the last pod Running.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import yaml
from _common import (
    Pod,
    PodList,
    WatchEvent,
    cluster_for,
    cpu_seconds,
    http_client,
    log,
    new_namespace,
    pct,
    print_table,
    request_counts,
    wait_until,
)

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, MockNode, mock_node, node_ready, start_agent, wait_for

CONCURRENCY = 64
# Three lower nodes of different sizes, room for the whole throughput run.
LOWER_NODES = {
    "bench-lower-a": {"cpu": "64", "memory": "256Gi", "pods": "600"},
    "bench-lower-b": {"cpu": "32", "memory": "128Gi", "pods": "500"},
    "bench-lower-c": {"cpu": "16", "memory": "64Gi", "pods": "400"},
}


def pod_body(name: str, node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "tolerations": [{"operator": "Exists"}],
        "containers": [
            {
                "name": "c",
                "image": "bench/app:1",
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        # The mock writes the env to the log, so `logs --tail=1` has a line at once.
        "metadata": {
            "name": name,
            "labels": {"bench": "yes"},
            "annotations": {"mock.vkubelet.io/print-env": "true"},
        },
        "spec": spec,
    }


@dataclass
class Watcher:
    """When each pod of a namespace was first seen (any event) and first seen Running."""

    client: httpx.AsyncClient
    namespace: str
    seen_at: dict[str, float] = field(default_factory=dict)
    running_at: dict[str, float] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while True:  # (re-)list, then watch; a re-list records what the watch missed
            listed = msgspec.json.decode((await self.client.get(path)).content, type=PodList)
            now = time.monotonic()
            for pod in listed.items:
                self._saw(pod, now)
            version = listed.metadata.resourceVersion
            params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}
            async with self.client.stream("GET", path, params=params, timeout=None) as response:
                self.ready.set()
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    now = time.monotonic()
                    event = msgspec.json.decode(line, type=WatchEvent)
                    if event.type == "ERROR":
                        log(f"watch of {self.namespace}: {line[:200]!r}; re-listing")
                        break
                    if event.type != "BOOKMARK":
                        self._saw(event.object, now)

    def _saw(self, pod: Pod, now: float) -> None:
        name = pod.metadata.name
        self.seen_at.setdefault(name, now)
        if pod.status and pod.status.phase == "Running":
            self.running_at.setdefault(name, now)


async def create_pods(
    client: httpx.AsyncClient, ns: str, names: list[str], node: str | None, rate: float | None
) -> dict[str, float]:
    """Create pods (CONCURRENCY in flight, or paced at `rate`/s); when each create returned."""
    created: dict[str, float] = {}

    async def one(name: str) -> None:
        for _ in range(20):
            sent = time.monotonic()
            response = await client.post(f"/api/v1/namespaces/{ns}/pods", json=pod_body(name, node))
            if response.status_code in (409, 429, 500, 503, 504):
                await asyncio.sleep(0.2)
                continue
            response.raise_for_status()
            # Paced: the bind is the request (the apiserver answers in a few ms at this rate).
            created[name] = sent if rate else time.monotonic()
            return
        raise RuntimeError(f"could not create {name}: {response.status_code} {response.text}")

    if rate is None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for name in names:
            queue.put_nowait(name)

        async def worker() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    else:
        start = time.monotonic()
        tasks = []
        for i, name in enumerate(names):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(name)))
        await asyncio.gather(*tasks)
    return created


async def drop_namespace(
    upper: httpx.AsyncClient | None, lower: httpx.AsyncClient, ns: str, limit: float = 600
) -> float:
    """Delete the namespace (upstairs if the pods went through the virtual node, which then
    deletes the lower pods) and wait until no pod is left below; the seconds that took."""
    started = time.monotonic()
    body = {"propagationPolicy": "Background"}
    if upper is not None:
        await upper.request("DELETE", f"/api/v1/namespaces/{ns}", json=body)
    else:
        await lower.request("DELETE", f"/api/v1/namespaces/{ns}", json=body)
    while time.monotonic() - started < limit:
        left = (await lower.get(f"/api/v1/namespaces/{ns}/pods", params={"limit": 1})).json()
        if not left.get("items"):
            break
        await asyncio.sleep(0.5)
    took = time.monotonic() - started
    if upper is not None:  # the lower namespace the provider created (never deleted by it)
        await lower.request("DELETE", f"/api/v1/namespaces/{ns}", json=body)
    return took


# -- the clusters and the agent -------------------------------------------------------------------


@dataclass
class Setup:
    upper: Cluster
    lower: Cluster
    node: str  # the virtual node
    agent_pid: int
    lower_nodes: list[MockNode]


@contextlib.contextmanager
def setup(
    upper_name: str | None, lower_name: str | None, work: Path, log_level: str
) -> Iterator[Setup]:
    with contextlib.ExitStack() as stack:
        upper, owned = cluster_for(upper_name, "bench-upper")
        if owned:
            stack.callback(upper.down)
        lower, owned = cluster_for(lower_name, "bench-lower")
        if owned:
            stack.callback(lower.down)
        lk, uk = Kubectl(lower.kubeconfig), Kubectl(upper.kubeconfig)
        nodes = []
        for prefix, capacity in LOWER_NODES.items():
            nodes.append(
                stack.enter_context(
                    mock_node(
                        lower,
                        lk,
                        work / prefix,
                        prefix=prefix,
                        mock_config=capacity,
                        extra_args=("--disable-taint",),
                    )
                )
            )
        name = f"vk-bench-{uuid.uuid4().hex[:6]}"
        config = work / "lower.yaml"
        config.write_text(
            yaml.safe_dump({"kubeconfig": str(lower.kubeconfig), "upperClusterID": "bench"})
        )
        agent = start_agent(
            upper,
            work,
            provider="cluster",
            config=config,
            name=name,
            address="127.0.0.1",
            extra_args=("--log-level", log_level),
        )
        stack.callback(uk, "delete", "node", name, "--ignore-not-found", "--wait=false")
        stack.callback(agent.stop)
        wait_for(lambda: node_ready(uk, name), timeout=120, what=f"node {name} Ready")
        wait_for(
            lambda: (
                int(uk.json("get", "node", name)["status"]["allocatable"].get("pods", 0))
                >= sum(int(c["pods"]) for c in LOWER_NODES.values())
            ),
            timeout=60,
            what="the virtual node's capacity",
        )
        assert agent.proc is not None
        yield Setup(upper, lower, name, agent.proc.pid, nodes)


# -- provider overhead ----------------------------------------------------------------------------


@dataclass
class Overhead:
    pods: int
    rate: float
    upper: list[float]  # bind -> upper Running
    lower: list[float]  # lower seen -> lower Running
    overhead: list[float]
    down: list[float]  # bind -> lower pod seen
    up: list[float]  # lower Running -> upper Running
    agent_cpu_s: float


async def paced_overhead(
    s: Setup, upper: httpx.AsyncClient, lower: httpx.AsyncClient, pods: int, rate: float
) -> tuple[Overhead, str]:
    ns = await new_namespace(upper, "bench-ov")
    # The lower namespace exists already: its creation is not part of the first pod's time.
    await lower.post(
        "/api/v1/namespaces",
        json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
    )
    up_watch, low_watch = Watcher(upper, ns), Watcher(lower, ns)
    tasks = [asyncio.create_task(w.run()) for w in (up_watch, low_watch)]
    await asyncio.gather(up_watch.ready.wait(), low_watch.ready.wait())
    names = [f"ov-{i}" for i in range(pods)]
    cpu_before = cpu_seconds(s.agent_pid)
    created = await create_pods(upper, ns, names, s.node, rate)
    await wait_until(lambda: len(up_watch.running_at) >= pods, 300, "upper pods Running")
    cpu = cpu_seconds(s.agent_pid) - cpu_before
    for task in tasks:
        task.cancel()
    result = Overhead(pods, rate, [], [], [], [], [], cpu)
    for n in names:
        upper_s = up_watch.running_at[n] - created[n]
        lower_s = low_watch.running_at[n] - low_watch.seen_at[n]
        result.upper.append(upper_s)
        result.lower.append(lower_s)
        result.overhead.append(upper_s - lower_s)
        result.down.append(low_watch.seen_at[n] - created[n])
        result.up.append(up_watch.running_at[n] - low_watch.running_at[n])
    return result, ns


# -- throughput -----------------------------------------------------------------------------------


@dataclass
class Throughput:
    pods: int
    seconds: float
    p50: float
    p99: float

    @property
    def rate(self) -> float:
        return self.pods / self.seconds


async def burst(
    client: httpx.AsyncClient, lower: httpx.AsyncClient, pods: int, node: str | None
) -> tuple[Throughput, str]:
    """`pods` pods created at once in `client`'s cluster (bound to `node` if given)."""
    ns = await new_namespace(client, "bench-tp")
    if node is not None:
        await lower.post(
            "/api/v1/namespaces",
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        )
    watcher = Watcher(client, ns)
    task = asyncio.create_task(watcher.run())
    await watcher.ready.wait()
    names = [f"tp-{i}" for i in range(pods)]
    started = time.monotonic()
    created = await create_pods(client, ns, names, node, None)
    await wait_until(lambda: len(watcher.running_at) >= pods, 1800, "all pods Running")
    task.cancel()
    latencies = [watcher.running_at[n] - created[n] for n in names]
    elapsed = max(watcher.running_at.values()) - started
    return Throughput(pods, elapsed, statistics.median(latencies), pct(latencies, 0.99)), ns


async def measured_burst(
    client: httpx.AsyncClient,
    upper: httpx.AsyncClient,
    lower: httpx.AsyncClient,
    pods: int,
    node: str | None,
    spy: contextlib.AbstractContextManager[None] | None = None,
) -> tuple[Throughput, dict[str, Counter[str]]]:
    """A burst (under `spy`, if given), then its namespace removed; and the requests each
    apiserver served for it (until the last pod was Running, before the removal)."""
    before = {"upper": await request_counts(upper), "lower": await request_counts(lower)}
    with spy or contextlib.nullcontext():
        result, ns = await burst(client, lower, pods, node)
    after = {"upper": await request_counts(upper), "lower": await request_counts(lower)}
    took = await drop_namespace(upper if node else None, lower, ns)
    log(f"burst ({'virtual node' if node else 'direct'}) removed in {took:.1f} s")
    return result, {k: after[k] - before[k] for k in after}


# -- kubectl verbs --------------------------------------------------------------------------------


def exec_seconds(kubectl: Kubectl, ns: str, pod: str) -> float:
    started = time.monotonic()
    kubectl("-n", ns, "exec", pod, "--", "true")
    return time.monotonic() - started


def logs_first_line_seconds(kubectl: Kubectl, ns: str, pod: str) -> float:
    """`kubectl logs -f --tail=1` until its first line arrives (then it is stopped)."""
    argv = [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "-n", ns, "logs", "-f"]
    started = time.monotonic()
    with subprocess.Popen(
        [*argv, "--tail=1", pod], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        took = time.monotonic() - started
        proc.kill()
    if not line:
        raise RuntimeError(f"kubectl logs -f {pod}: no line")
    return took


def verbs(s: Setup, ns: str, pod: str, count: int) -> dict[str, dict[str, list[float]]]:
    """Both verbs, `count` times each, through the virtual node and directly, alternating."""
    paths = {
        "virtual node": Kubectl(s.upper.kubeconfig),
        "lower directly": Kubectl(s.lower.kubeconfig),
    }
    figures: dict[str, dict[str, list[float]]] = {p: {"exec": [], "logs": []} for p in paths}
    for kubectl in paths.values():  # warm-up: connections, kubectl's discovery cache
        exec_seconds(kubectl, ns, pod)
        logs_first_line_seconds(kubectl, ns, pod)
    for _ in range(count):
        for path, kubectl in paths.items():
            figures[path]["exec"].append(exec_seconds(kubectl, ns, pod))
            figures[path]["logs"].append(logs_first_line_seconds(kubectl, ns, pod))
    return figures


# -- main -----------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


@contextlib.contextmanager
def profiled(pid: int, path: Path | None) -> Iterator[None]:
    """py-spy sampling `pid` while the block runs (nothing when no path is given)."""
    if path is None:
        yield
        return
    binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    argv = [binary, "record", "--nonblocking", "-r", "50", "-f", "raw", "-o", str(path)]
    with subprocess.Popen(
        [*argv, "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as spy:
        try:
            yield
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(30)
    log(f"profile of the agent: {path}")


async def throughput(
    s: Setup,
    upper: httpx.AsyncClient,
    lower: httpx.AsyncClient,
    pods: int,
    rounds: int,
    profile: str | None = None,
) -> None:
    """`rounds` pairs of bursts, alternating through the virtual node and directly, so that a
    change in the machine's load hits both alike; the ratio is printed per pair."""
    rows: list[tuple[str, ...]] = [
        ("", "first create -> last Running", "pods/s", "p50 ms", "p99 ms", "load")
    ]
    ratios = []
    requests: dict[str, Counter[str]] = {"upper": Counter(), "lower": Counter()}
    direct_requests: Counter[str] = Counter()
    cpu = 0.0
    for i in range(rounds):
        cpu_before = cpu_seconds(s.agent_pid)
        spy = profiled(s.agent_pid, Path(f"{profile}-{i + 1}.txt") if profile else None)
        virtual, counts = await measured_burst(upper, upper, lower, pods, s.node, spy)
        cpu += cpu_seconds(s.agent_pid) - cpu_before
        load_virtual = os.getloadavg()[0]
        for k in requests:
            requests[k] += counts[k]
        direct, counts = await measured_burst(lower, upper, lower, pods, None)
        load_direct = os.getloadavg()[0]
        direct_requests += counts["lower"]
        ratios.append(virtual.rate / direct.rate)
        for label, t, load in (
            (f"through the virtual node, round {i + 1}", virtual, load_virtual),
            (f"directly into the lower cluster, round {i + 1}", direct, load_direct),
        ):
            rows.append(
                (label, f"{t.seconds:.1f} s", f"{t.rate:.1f}", ms(t.p50), ms(t.p99), f"{load:.1f}")
            )
    print(f"\n## {pods} pods at once ({CONCURRENCY} creates in flight)")
    print_table(rows)
    print(
        "virtual node / direct: "
        + ", ".join(f"{100 * r:.0f} %" for r in ratios)
        + f"; agent CPU {cpu / rounds:.1f} s per burst ({1000 * cpu / rounds / pods:.1f} ms/pod)"
    )
    print("\napiserver requests per pod (virtual-node bursts: upper, lower; direct: lower)")
    table: list[tuple[str, ...]] = [("", "upper", "lower", "direct")]
    whats = sorted(set(requests["upper"]) | set(requests["lower"]) | set(direct_requests))
    per = pods * rounds
    for what in whats:
        values = (requests["upper"][what], requests["lower"][what], direct_requests[what])
        if max(values) >= per / 100:
            table.append((what, *(f"{v / per:.2f}" for v in values)))
    totals = (requests["upper"].total(), requests["lower"].total(), direct_requests.total())
    table.append(("all", *(f"{v / per:.2f}" for v in totals)))
    # The lower kubelets write their Created/Started events after the pods are Running, so a
    # burst's count of them depends on its length more than on its path.
    events = (
        requests["upper"]["POST events"],
        requests["lower"]["POST events"],
        direct_requests["POST events"],
    )
    rest = (f"{(t - e) / per:.2f}" for t, e in zip(totals, events, strict=True))
    table.append(("all but POST events", *rest))
    print_table(table)


async def run(s: Setup, args: argparse.Namespace) -> None:
    upper = http_client(s.upper.kubeconfig, CONCURRENCY)
    lower = http_client(s.lower.kubeconfig, CONCURRENCY)
    print(
        f"# cluster provider benchmark — {os.cpu_count()} CPUs, Kubernetes "
        f"{s.upper.kubernetes_version}, {len(s.lower_nodes)} lower mock nodes; "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    try:
        if args.paced_pods:
            ov, ns = await paced_overhead(s, upper, lower, args.paced_pods, args.rate)
            print(f"\n## Provider overhead: {ov.pods} pods offered at {ov.rate:g} pods/s")
            rows: list[tuple[str, ...]] = [("ms", "p50", "p90", "p99", "max")]
            for label, values in (
                ("upper: bind -> Running (seen)", ov.upper),
                ("lower: created -> Running (seen)", ov.lower),
                ("overhead = upper - lower", ov.overhead),
                ("  down: bind -> lower pod seen", ov.down),
                ("  up: lower Running -> upper Running", ov.up),
            ):
                rows.append(
                    (
                        label,
                        ms(pct(values, 0.5)),
                        ms(pct(values, 0.9)),
                        ms(pct(values, 0.99)),
                        ms(max(values)),
                    )
                )
            print_table(rows)
            print(f"agent CPU for the run: {ov.agent_cpu_s:.1f} s")
            if args.execs:
                figures = verbs(s, ns, "ov-0", args.execs)
                print(f"\n## kubectl verbs, {args.execs} each, alternating (ms)")
                rows = [("", "p50", "p99", "mean")]
                for path, by_verb in figures.items():
                    for verb, label in (("exec", "exec -- true"), ("logs", "logs -f: 1st line")):
                        values = by_verb[verb]
                        rows.append(
                            (
                                f"{label}, {path}",
                                ms(pct(values, 0.5)),
                                ms(pct(values, 0.99)),
                                ms(statistics.mean(values)),
                            )
                        )
                print_table(rows)
            took = await drop_namespace(upper, lower, ns)
            log(f"overhead run removed in {took:.1f} s")
        if args.pods:
            await throughput(s, upper, lower, args.pods, args.rounds, args.profile)
    finally:
        await upper.aclose()
        await lower.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paced-pods", type=int, default=200, help="0 skips the overhead run")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--pods", type=int, default=1000, help="throughput run (0 skips it)")
    parser.add_argument("--rounds", type=int, default=1, help="throughput: alternating pairs")
    parser.add_argument("--execs", type=int, default=30, help="exec/logs rounds (0 skips)")
    parser.add_argument("--upper", help="reuse a running `vkubelet dev cluster` as the upper one")
    parser.add_argument("--lower", help="reuse a running `vkubelet dev cluster` as the lower one")
    parser.add_argument("--work", type=Path, help="keep the agents' logs here")
    parser.add_argument("--agent-log-level", default="warning")
    parser.add_argument("--profile", help="py-spy the agent in virtual-node bursts: PREFIX-N.txt")
    args = parser.parse_args()
    # Stopped with SIGTERM, still stop the agents and remove the nodes and namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        s = stack.enter_context(setup(args.upper, args.lower, work, args.agent_log_level))
        asyncio.run(run(s, args))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
