"""Benchmark: pods on one node, vkubelet vs Go virtual-kubelet, alternating. Prints figures.

    .venv/bin/python bench/agent_vs_govk.py [--pods 1000 10000] [--rounds 1] [--cluster NAME]

Three agents, each a child process with its own fresh node, take turns (the order alternates
from round to round) on the same job: N pods bound to the node by `spec.nodeName`, created with
64 requests in flight, observed Running by a watch, then all deleted (30 s grace) until the API
objects are gone:

- vkubelet, mock provider, its defaults;
- Go virtual-kubelet v1.13.0 built from its module (bench/govk: its node and pod controllers, a
  provider that runs every pod at once) with its **defaults**: client 5 QPS / burst 10, every
  queue behind client-go's default limiter (global 10/s after a burst of 100), nodeutil's
  workers (one per CPU). It is far too slow to finish 10,000 pods, so it gets a time budget
  (`--budget`, per phase) and its pods/s counts the pods Running within it;
- the same Go node **unthrottled**: no client QPS limit, 32 workers, queues with per-item
  back-off only.

Each run waits, before it starts, for the last one's namespace to be deleted and for the
control plane to be quiet (< 0.2 cores over 2 s): otherwise the second agent of a round pays
for the deletion of the first one's namespace and events.

Per agent it prints pods/s (first create to last pod Running), p50/p99 creation -> Running
(creation = when our client got the API's answer), delete time, RSS with all pods Running, and
agent CPU seconds per 1,000 pods — user + system from /proc of the agent and its children, for
the start (first create until all Running plus `--settle` seconds, which covers the events sent
after a burst) and for the deletion. Then the ratios vkubelet / unthrottled Go. CPU per pod is
the figure to trust on a loaded machine; `uptime` is printed with each run.

`--profile FILE.svg` also records a py-spy flame graph of the vkubelet agent (pip install py-spy)
during its start phase at the largest pod count of the first round.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
from _common import (
    cluster_for,
    control_plane_cpu,
    cpu_seconds,
    http_client,
    log,
    new_namespace,
    pct,
    print_table,
    quiet_control_plane,
    request_counts,
)
from agent_pods import (
    CONCURRENCY,
    Watcher,
    create_pods,
    delete_all,
    rss_kib,
    start_agent,
    wait_node_ready,
)
from exec_portforward import build_govk, start_govk

from vkubelet.devcluster import Cluster

VKUBELET = "vkubelet"
GO_UNTHROTTLED = "Go vk unthrottled"
GO_DEFAULTS = "Go vk defaults"
AGENTS = (VKUBELET, GO_UNTHROTTLED, GO_DEFAULTS)
GO_FLAGS = {
    GO_DEFAULTS: ["-kube-api-qps", "5", "-kube-api-burst", "10"],
    GO_UNTHROTTLED: ["-kube-api-qps", "-1", "-workers", "32", "-queue-rate-limit=false"],
}
TICKS = os.sysconf("SC_CLK_TCK")
# The control plane's processes by `comm` (cut at 15 characters), for the machine's CPU split.
COMPONENTS = ("kube-apiserver", "etcd", "kube-controller", "kube-scheduler", "metrics-server")


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(times.get(pid, 0.0) for pid in tree)


def machine_cpu(cluster: Cluster, agent_pid: int) -> dict[str, float]:
    """CPU seconds so far of every process that works on a run's pods."""
    split = {name: control_plane_cpu(cluster, (name,)) for name in COMPONENTS}
    return split | {"bench": cpu_seconds(os.getpid()), "agent": tree_cpu_seconds(agent_pid)}


def load() -> str:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load average {one}, {five}, {fifteen}"


@dataclass
class Run:
    agent: str
    pods: int
    running: int  # pods seen Running (fewer than `pods` if the budget ran out)
    pods_per_s: float
    p50: float
    p99: float
    deleted: int
    delete_s: float
    rss_mib: float
    start_cpu_s: float
    delete_cpu_s: float
    load: str
    # From the first create until all pods are Running: CPU seconds by process (control plane,
    # this bench, the agent) and the requests the apiserver served, by "VERB resource".
    machine_cpu_s: dict[str, float]
    requests: dict[str, int]

    @property
    def finished(self) -> bool:
        return self.running == self.pods and self.deleted == self.pods

    def cpu_per_1000(self) -> float:
        return 1000 * self.start_cpu_s / max(self.running, 1)


@dataclass
class Agent:
    pid: int
    node: str
    stop: Callable[[], None]


def start(agent: str, cluster: Cluster, govk: Path, work: Path) -> Agent:
    if agent == VKUBELET:
        node = f"bench-vk-{uuid.uuid4().hex[:6]}"
        proc = start_agent(cluster.kubeconfig, node, work)

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        return Agent(proc.pid, node, stop)
    extra = [*GO_FLAGS[agent], "-pods", "100000"]
    target = start_govk(cluster, govk, work, extra, agent)
    return Agent(target.pid, target.node, target.stop)


async def wait_for(check: Callable[[], bool], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def force_delete(client: httpx.AsyncClient, ns: str, names: list[str]) -> None:
    """Remove what an agent left behind (a throttled one out of time): grace 0, no kubelet."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for name in names:
        queue.put_nowait(name)

    async def worker() -> None:
        while not queue.empty():
            name = queue.get_nowait()
            await client.request(
                "DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", json={"gracePeriodSeconds": 0}
            )

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def namespace_gone(client: httpx.AsyncClient, ns: str, within: float = 300) -> None:
    """Its deletion (its events: thousands) loads the apiserver: not during the next run."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (await client.get(f"/api/v1/namespaces/{ns}")).status_code == 404:
            return
        await asyncio.sleep(1)
    log(f"namespace {ns} still there after {within:.0f} s")


def profile(pid: int, svg: Path) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.prefix) / "bin" / "py-spy")
    if not Path(spy).exists():
        log("--profile: py-spy not found (pip install py-spy); not profiling")
        return None
    svg.parent.mkdir(parents=True, exist_ok=True)
    raw = ["--format", "raw"] if svg.suffix == ".txt" else []  # collapsed stacks, to count
    record = ["record", "--pid", str(pid), "--output", str(svg), "--rate", "100", "--nonblocking"]
    return subprocess.Popen(
        [spy, *record, *raw],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def one_run(
    cluster: Cluster,
    govk: Path,
    agent: str,
    pods: int,
    args: argparse.Namespace,
    svg: Path | None,
) -> Run:
    budget = args.budget if agent == GO_DEFAULTS else args.limit
    with tempfile.TemporaryDirectory() as tmp:
        client = http_client(cluster.kubeconfig, CONCURRENCY)
        target = start(agent, cluster, govk, Path(tmp))
        names = [f"p-{i}" for i in range(pods)]
        ns = ""
        try:
            await wait_node_ready(client, target.node)
            ns = await new_namespace(client, "vs")
            # Settle: neither the agent's start-up nor the last run's aftermath is measured.
            await quiet_control_plane(cluster)
            watcher = Watcher(client, ns)
            watch_task = asyncio.create_task(watcher.run())
            await watcher.ready.wait()
            spy = profile(target.pid, svg) if svg else None
            requests0 = await request_counts(client)
            machine0 = machine_cpu(cluster, target.pid)
            cpu0 = machine0["agent"]
            started = time.monotonic()
            created = await create_pods(client, ns, names, target.node, None)
            await wait_for(lambda: len(watcher.running_at) >= pods, budget)
            machine1 = machine_cpu(cluster, target.pid)
            requests1 = await request_counts(client)
            running = dict(watcher.running_at)
            last = max(running.values()) if running else time.monotonic()
            elapsed = (last if len(running) == pods else time.monotonic()) - started
            await asyncio.sleep(args.settle)
            rss = rss_kib(target.pid) / 1024
            cpu1 = tree_cpu_seconds(target.pid)
            if spy is not None:
                spy.send_signal(2)  # SIGINT: py-spy writes the flame graph and exits
                spy.wait(60)
            deleting = time.monotonic()
            await delete_all(client, ns, names)
            await wait_for(lambda: len(watcher.deleted_at) >= pods, budget)
            gone = dict(watcher.deleted_at)
            delete_s = (max(gone.values()) if len(gone) == pods else time.monotonic()) - deleting
            cpu2 = tree_cpu_seconds(target.pid)
            watch_task.cancel()
            latencies = [running[n] - created[n] for n in names if n in running]
            return Run(
                agent=agent,
                pods=pods,
                running=len(running),
                pods_per_s=len(running) / elapsed,
                p50=statistics.median(latencies) if latencies else float("nan"),
                p99=pct(latencies, 0.99),
                deleted=len(gone),
                delete_s=delete_s,
                rss_mib=rss,
                start_cpu_s=cpu1 - cpu0,
                delete_cpu_s=cpu2 - cpu1,
                load=load(),
                machine_cpu_s={k: machine1[k] - machine0[k] for k in machine0},
                requests=dict(requests1 - requests0),
            )
        finally:
            target.stop()
            if ns:
                await force_delete(client, ns, names)
                await client.request("DELETE", f"/api/v1/namespaces/{ns}")
                await namespace_gone(client, ns)
            await client.request("DELETE", f"/api/v1/nodes/{target.node}")
            await client.aclose()


def show(pods: int, runs: list[Run]) -> None:
    print(f"\n## {pods} pods ({CONCURRENCY} creates in flight), {len(runs)} runs")
    rows: list[tuple[str, ...]] = [
        (
            "agent",
            "Running",
            "pods/s",
            "p50 s",
            "p99 s",
            "delete s",
            "RSS MiB",
            "CPU s/1k start",
            "CPU s/1k delete",
            "load",
        )
    ]
    for r in runs:
        rows.append(
            (
                r.agent,
                f"{r.running}/{r.pods}",
                f"{r.pods_per_s:.1f}",
                f"{r.p50:.2f}",
                f"{r.p99:.2f}",
                f"{r.delete_s:.1f}" + ("" if r.deleted == r.pods else f" ({r.deleted} gone)"),
                f"{r.rss_mib:.0f}",
                f"{r.cpu_per_1000():.2f}",
                f"{1000 * r.delete_cpu_s / max(r.deleted, 1):.2f}",
                r.load.removeprefix("load average "),
            )
        )
    print_table(rows)
    show_machine(runs)

    def mean(agent: str, value: Callable[[Run], float]) -> float:
        values = [value(r) for r in runs if r.agent == agent]
        return statistics.fmean(values) if values else float("nan")

    print("\nratios, vkubelet / Go (means over the rounds):")
    for other in (GO_UNTHROTTLED, GO_DEFAULTS):
        if not any(r.agent == other for r in runs) or not any(r.agent == VKUBELET for r in runs):
            continue
        figures: list[tuple[str, Callable[[Run], float]]] = [
            ("pods/s", lambda r: r.pods_per_s),
            ("p50", lambda r: r.p50),
            ("p99", lambda r: r.p99),
            ("delete time", lambda r: r.delete_s),
            ("RSS", lambda r: r.rss_mib),
            ("CPU per 1,000 pods started", Run.cpu_per_1000),
            ("CPU per 1,000 pods deleted", lambda r: 1000 * r.delete_cpu_s / max(r.deleted, 1)),
        ]
        parts = [f"{name} {mean(VKUBELET, f) / mean(other, f):.2f}x" for name, f in figures]
        unfinished = "" if all(r.finished for r in runs if r.agent == other) else " (Go capped)"
        print(f"  vs {other}{unfinished}: " + ", ".join(parts))


def show_machine(runs: list[Run]) -> None:
    """Where the machine's CPU went until all pods were Running, and what the apiserver was
    asked: on two shared cores every process's share of a pod bounds pods/s."""
    print("\nCPU ms per pod started, by process (first create until all Running):")
    names = [*COMPONENTS, "bench", "agent"]
    rows: list[tuple[str, ...]] = [("agent", *names, "total", "cores busy")]
    for r in runs:
        per_pod = [1000 * r.machine_cpu_s[n] / max(r.running, 1) for n in names]
        busy = sum(r.machine_cpu_s.values()) * r.pods_per_s / max(r.running, 1)
        rows.append((r.agent, *(f"{v:.2f}" for v in per_pod), f"{sum(per_pod):.2f}", f"{busy:.2f}"))
    print_table(rows)
    print("\nrequests per pod served by the apiserver meanwhile (>= 0.01):")
    kinds = sorted({k for r in runs for k, n in r.requests.items() if n >= 0.01 * r.running})
    rows = [("agent", *kinds)]
    for r in runs:
        rows.append((r.agent, *(f"{r.requests.get(k, 0) / max(r.running, 1):.3f}" for k in kinds)))
    print_table(rows)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, nargs="*", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--agents", nargs="*", default=list(AGENTS), choices=AGENTS)
    parser.add_argument("--budget", type=float, default=120.0, help="Go defaults: s per phase")
    parser.add_argument("--limit", type=float, default=1800.0, help="any agent: s per phase")
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument(
        "--profile", type=Path, help="py-spy flame graph of vkubelet (SVG; .txt: collapsed stacks)"
    )
    parser.add_argument("--cluster", help="reuse a running `vkubelet dev cluster`")
    args = parser.parse_args()
    govk = build_govk() if set(args.agents) - {VKUBELET} else Path("/nonexistent")
    cluster, owned = cluster_for(args.cluster, "vs")
    try:
        version = "Go virtual-kubelet"
        if govk.exists():
            version = subprocess.run(  # noqa: ASYNC221 - once, before measuring
                [str(govk), "-version"], capture_output=True, text=True, check=False
            ).stdout.strip()
        print(
            f"# vkubelet vs {version} — {os.cpu_count()} CPUs, Kubernetes "
            f"{cluster.kubernetes_version}; {load()} at start"
        )
        profiled = False
        top = max(args.pods)
        for pods in args.pods:
            runs: list[Run] = []
            for round_ in range(args.rounds):
                order = list(args.agents) if round_ % 2 == 0 else list(reversed(args.agents))
                for agent in order:
                    svg = None
                    if args.profile and not profiled and (agent, pods) == (VKUBELET, top):
                        svg, profiled = args.profile, True
                    log(f"{pods} pods, round {round_ + 1}: {agent}")
                    run = await one_run(cluster, govk, agent, pods, args, svg)
                    log(f"  {run}")
                    runs.append(run)
            show(pods, runs)
    finally:
        if owned:
            cluster.down()


if __name__ == "__main__":
    asyncio.run(main())
