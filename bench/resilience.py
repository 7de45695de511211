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
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from _common import cluster_for, log, new_namespace, print_table

from vkubelet.devcluster import Cluster
from vkubelet.testing import AgentProcess, Kubectl, node_ready, wait_for
from vkubelet.testing.churn import Churn, Outcome, agent_config, churn_with, http_client

Disrupt = Callable[[], Awaitable[tuple[str, float]]]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


async def scenario(
    cluster: Cluster,
    workdir: Path,
    name: str,
    args: argparse.Namespace,
    owned: bool,
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

        async def kill() -> tuple[str, float]:
            agent.stop(signal.SIGKILL)
            await asyncio.sleep(0.5)
            agent.start()
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
            await client.delete(f"/api/v1/namespaces/{namespace}")
        if name == "apiserver":
            for component in ("kube-controller-manager", "kube-scheduler"):
                await asyncio.to_thread(cluster.restart_component, component, tie_to_parent=False)
        return outcome, agent.log()
    finally:
        agent.stop()
        for node in nodes:
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)


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
                outcome, agent_log = asyncio.run(scenario(cluster, workdir, name, args, owned))
                show(name, outcome, agent_log)
                print(f"load after: {uptime()}")
    finally:
        if owned:
            cluster.down()


if __name__ == "__main__":
    main()
