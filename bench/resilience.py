"""Benchmark: pod churn through agent crashes and apiserver restarts. Prints figures.

    .venv/bin/python bench/resilience.py [--pods 1000] [--nodes 10] [--rate 50] [--cluster NAME]
                                         [--scenario crash apiserver]

One agent process (`vkubelet run --config`) serves `--nodes` mock nodes, each with its state
file (the fake backend outlives the agent, as a real one does). `vkubelet.testing.churn` creates
`--pods` pods at `--rate` per second, bound round-robin to the nodes, and updates or deletes
most of them a few seconds later (a quarter kept, three eighths updated, a quarter deleted
gracefully, an eighth force-deleted). During that:

- crash: the agent is SIGKILLed three times and restarted 0.5 s later;
- apiserver: etcd is compacted to its current revision and the kube-apiserver restarted, twice,
  so that the agent's watches resume from a compacted resourceVersion (410 Gone, relist).

After each agent restart, from the agent's log: how long from `exec` to its first log line, to
each node having adopted the provider's pods, and to each node being first in sync with the API
(every pod found at start synced), with the CPU seconds the process had used by then.

After each disruption: how long until every pod whose last operation the API acknowledged
before the component came back is consistent (Running and run exactly once with its latest
update, or deleted from both the API and the provider). At the end: the counts of pods missing,
duplicated, not deleted, stale, stuck Terminating or not Running (all zero is the goal), and the
410s the agent saw. It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from _common import cluster_for, log, new_namespace, print_table

from vkubelet.devcluster import Cluster
from vkubelet.testing import AgentProcess, Kubectl, node_ready, wait_for
from vkubelet.testing.churn import Churn, Outcome, agent_config, churn_with, http_client

Disrupt = Callable[[], Awaitable[tuple[str, float]]]


@dataclass
class Startup:
    """One agent start, read from its log: seconds after `exec`, and CPU seconds used by then."""

    first_log: float | None = None
    adopted: list[float] = field(default_factory=list)  # per node
    in_sync: list[float] = field(default_factory=list)
    cpu_adopted: float | None = None
    cpu_in_sync: float | None = None


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _seconds(line: str, since: float) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - since


async def watch_startup(log: Path, offset: int, pid: int, nodes: int, startup: Startup) -> None:
    """Fill `startup` from the log written after `offset`, until every node is in sync."""
    since = time.time()
    while startup.cpu_in_sync is None:
        await asyncio.sleep(0.05)
        with log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        if lines and startup.first_log is None:
            startup.first_log = _seconds(lines[0], since)
        adopted = [_seconds(x, since) for x in lines if ": adopted " in x]
        in_sync = [_seconds(x, since) for x in lines if "in sync with the API" in x]
        if len(adopted) >= nodes and startup.cpu_adopted is None:
            startup.adopted, startup.cpu_adopted = adopted, _cpu_seconds(pid)
        if len(in_sync) >= nodes:
            startup.in_sync, startup.cpu_in_sync = in_sync, _cpu_seconds(pid)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


async def scenario(
    cluster: Cluster,
    workdir: Path,
    name: str,
    args: argparse.Namespace,
    owned: bool,
    startups: list[Startup],
) -> tuple[Outcome, str]:
    nodes = [f"res-{uuid.uuid4().hex[:4]}-{i}" for i in range(args.nodes)]
    config, states = agent_config(workdir / name, nodes)
    agent = AgentProcess(
        cluster.kubeconfig,
        ["--config", str(config), "--approve-own-csrs", *args.agent_arg],
        workdir / name / "agent.log",
    ).start()
    kubectl = Kubectl(cluster.kubeconfig)
    try:
        for node in nodes:
            ready = functools.partial(node_ready, kubectl, node)
            await asyncio.to_thread(wait_for, ready, timeout=120, what=f"node {node} Ready")

        watches: list[asyncio.Task[None]] = []

        async def kill() -> tuple[str, float]:
            agent.stop(signal.SIGKILL)
            await asyncio.sleep(0.5)
            offset = agent.log_path.stat().st_size
            agent.start()
            assert agent.proc is not None
            startups.append(Startup())
            watch = watch_startup(agent.log_path, offset, agent.proc.pid, len(nodes), startups[-1])
            watches.append(asyncio.create_task(watch))
            return "agent SIGKILL", 0.5

        async def restart_apiserver() -> tuple[str, float]:
            revision = await asyncio.to_thread(cluster.compact_etcd)
            down = await asyncio.to_thread(
                cluster.restart_component, "kube-apiserver", tie_to_parent=False
            )
            return f"etcd compacted at {revision}, apiserver restarted", down

        plan: tuple[list[float], Disrupt] = (
            (args.kills, kill) if name == "crash" else (args.restarts, restart_apiserver)
        )
        async with http_client(cluster.kubeconfig) as client:
            namespace = await new_namespace(client, "res")
            churn = Churn(client, namespace, nodes, states, pods=args.pods, rate=args.rate)
            log(f"{name}: {args.pods} pods at {args.rate}/s on {args.nodes} nodes")
            outcome = await churn_with(churn, plan[0], plan[1], limit=args.limit)
            for watch in watches:
                watch.cancel()
            await client.delete(f"/api/v1/namespaces/{namespace}")
        if name == "apiserver":
            for component in ("kube-controller-manager", "kube-scheduler"):
                await asyncio.to_thread(cluster.restart_component, component, tie_to_parent=False)
        return outcome, agent.log()
    finally:
        agent.stop()
        for node in nodes:
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def show_startups(startups: list[Startup]) -> None:
    if not startups:
        return
    print("agent starts (seconds after exec; CPU seconds of the process by then):")
    rows: list[tuple[str, ...]] = [
        ("start", "first log", "nodes adopted", "CPU", "nodes in sync", "CPU")
    ]
    for i, s in enumerate(startups, 1):
        adopted = f"{min(s.adopted):.1f}-{max(s.adopted):.1f}" if s.adopted else "-"
        in_sync = f"{min(s.in_sync):.1f}-{max(s.in_sync):.1f}" if s.in_sync else "-"
        cpu_adopted, cpu_in_sync = _figure(s.cpu_adopted), _figure(s.cpu_in_sync)
        rows.append((str(i), _figure(s.first_log), adopted, cpu_adopted, in_sync, cpu_in_sync))
    print_table(rows)


def show(name: str, outcome: Outcome, agent_log: str) -> None:
    print(f"\n== {name}: plan {outcome.duration:.1f} s, {outcome.retries} requests retried")
    rows: list[tuple[str, ...]] = [
        ("disruption", "at (s)", "down (s)", "reconciled (s)", "pods checked")
    ]
    for d in outcome.disruptions:
        reconciled = f"{d.reconciled:.1f}" if d.reconciled is not None else "never"
        checked = str(d.report.checked) if d.report else "-"
        rows.append((d.what, f"{d.at:.1f}", f"{d.down:.1f}", reconciled, checked))
    print_table(rows)
    print(f"final ({outcome.settle:.1f} s after the plan): {outcome.final}")
    for key, value in outcome.final.counts().items():
        print(f"  {key}: {value}")
    print(f"  agent relists after 410 Gone: {agent_log.count('410 Gone')}")
    for d in outcome.disruptions:
        if d.reconciled is None or d.reconciled > 10:
            print(f"  waiting after {d.what} at {d.at:.1f}s:")
            for t, what in d.trace:
                print(f"    +{t:.1f}s {what}")


def main() -> None:
    # An installed agent has its modules compiled; without this, each restart of the agent would
    # compile them all again (PYTHONDONTWRITEBYTECODE in some shells) and measure that.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rate", type=float, default=50.0, help="pods created per second")
    parser.add_argument("--kills", type=float, nargs="+", default=[3.0, 9.0, 15.0])
    parser.add_argument("--restarts", type=float, nargs="+", default=[4.0, 12.0])
    parser.add_argument(
        "--limit", type=float, default=120.0, help="seconds to wait for consistency"
    )
    parser.add_argument("--scenario", nargs="+", default=["crash", "apiserver"])
    parser.add_argument("--cluster", help="a running dev cluster (default: a new one)")
    parser.add_argument("--workdir", type=Path, help="keep agent logs and state files here")
    parser.add_argument("--agent-arg", action="append", default=[], help="e.g. --log-level=debug")
    args = parser.parse_args()
    cluster, owned = cluster_for(args.cluster, "res")
    print(f"load before: {uptime()}")
    try:
        with tempfile.TemporaryDirectory(prefix="vkubelet-res-") as tmp:
            for name in args.scenario:
                workdir = args.workdir or Path(tmp)
                startups: list[Startup] = []
                outcome, agent_log = asyncio.run(
                    scenario(cluster, workdir, name, args, owned, startups)
                )
                show(name, outcome, agent_log)
                show_startups(startups)
                print(f"load after: {uptime()}")
    finally:
        if owned:
            cluster.down()


if __name__ == "__main__":
    main()
