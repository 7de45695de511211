"""Benchmark: agent replicas against a real local control plane. Prints figures.

    .venv/bin/python bench/agent_replicas.py [--takeovers 3] [--nodes 1000] [--replicas 3]
                                             [--cluster NAME] [--log-level info] [--logs DIR]

- Leader election: two `vkubelet run --leader-elect` replicas of one mock node; the leader is
  SIGKILLed `--takeovers` times (a fresh standby started after each) and the time from the kill
  to the standby holding the Lease *and* having renewed the node's heartbeat Lease is measured.
- Sharding: `--replicas` replicas share `--nodes` mock nodes (`--shard`); the time until every
  bucket of nodes is claimed within the fair share, the replicas' CPU per node and minute once
  settled, then one replica is SIGKILLed and the time until all its buckets are held by the
  others and every node's heartbeat renewed is measured; and how many times a replica stopped
  a bucket's nodes because it could not renew its Lease in time (fencing), before and after.

Times are read from the apiserver (Lease holders and renewTime), polled every 0.2 s. It is a
benchmark, not a test: it asserts nothing and only prints, with the host's load next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2 as httpx
import yaml
from _common import cluster_for, cpu_seconds, http_client, log, new_namespace, pct, print_table

from vkubelet.agent._leases import group_of, lease_name
from vkubelet.agent._sharding import buckets_of

EXE = str(Path(sys.prefix) / "bin" / "vkubelet")


class Replica:
    def __init__(
        self, kubeconfig: Path, args: list[str], logfile: Path, level: str = "warning"
    ) -> None:
        with logfile.open("ab") as out:
            self.proc = subprocess.Popen(
                [EXE, "run", "--kubeconfig", str(kubeconfig), "--log-level", level, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.prefix = f"{socket.gethostname()}-{self.proc.pid}-"
        self.logfile = logfile

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def leases(client: httpx.AsyncClient, ns: str, selector: str = "") -> list[dict[str, Any]]:
    params = {"labelSelector": selector} if selector else {}
    answer = await client.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", params=params)
    answer.raise_for_status()
    items: list[dict[str, Any]] = answer.json()["items"]
    return items


async def node_renewals(client: httpx.AsyncClient) -> dict[str, datetime]:
    items = await leases(client, "kube-node-lease")
    return {
        i["metadata"]["name"]: datetime.fromisoformat(i["spec"]["renewTime"])
        for i in items
        if i["spec"].get("renewTime")
    }


async def poll(check: Any, limit: float, what: str) -> float:
    """Seconds until `await check()` is true."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > limit:
            raise TimeoutError(f"{what}: not within {limit:.0f} s")
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def leader_takeovers(
    kubeconfig: Path, client: httpx.AsyncClient, ns: str, work: Path, count: int
) -> list[float]:
    node = f"bench-ha-{uuid.uuid4().hex[:6]}"
    config = work / "mock.json"
    config.write_text(json.dumps({node: {"pods": "20", "stateFile": str(work / "state")}}))
    args = [
        *("--provider", "mock", "--provider-config", str(config), "--nodename", node),
        *("--no-kubelet-api", "--kubelet-port", "0"),  # no standby /healthz either
        *("--leader-elect", "--leader-elect-namespace", ns),
    ]
    lease = f"vkubelet-agent-{node}"

    async def holder() -> str:
        answer = await client.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{lease}")
        if not answer.is_success:
            return ""
        return str(answer.json()["spec"].get("holderIdentity") or "")

    replicas = [Replica(kubeconfig, args, work / "leader-0.log")]
    times: list[float] = []
    try:

        async def first_leads() -> bool:
            return (await holder()).startswith(replicas[0].prefix)

        await poll(first_leads, 60, "the first replica leading")
        for n in range(count):
            standby_log = work / f"leader-{n + 1}.log"
            replicas.append(Replica(kubeconfig, args, standby_log, level="info"))

            async def standing_by(path: Path = standby_log) -> bool:
                return "stands by" in path.read_text()  # noqa: ASYNC240 - a small local log

            await poll(standing_by, 120, "the standby started")  # a loaded host: tens of s
            await asyncio.sleep(1)  # its first look at the Lease
            old, new = replicas[-2], replicas[-1]
            killed = datetime.now(UTC)
            old.kill()

            async def new_leads(new: Replica = new, killed: datetime = killed) -> bool:
                renewed = (await node_renewals(client)).get(node, killed)
                return (await holder()).startswith(new.prefix) and renewed > killed

            took = await poll(new_leads, 60, "takeover")
            log(f"  takeover {n + 1}: {took:.1f} s")
            times.append(took)
    finally:
        for replica in replicas:
            replica.kill(signal.SIGTERM)
        await client.delete(f"/api/v1/nodes/{node}")
    return times


async def sharding(
    kubeconfig: Path,
    client: httpx.AsyncClient,
    ns: str,
    work: Path,
    nodes: int,
    count: int,
    level: str = "warning",
) -> dict[str, float]:
    prefix = f"bs-{uuid.uuid4().hex[:4]}"
    names = [f"{prefix}-{i:04d}" for i in range(nodes)]
    (work / "fleet.json").write_text(
        json.dumps({n: {"pods": "20", "stateFile": str(work / f"{n}.state")} for n in names})
    )
    config = {
        "kubeletAPI": False,
        "nodes": [
            {"name": n, "provider": "mock", "providerConfig": "fleet.json", "kubeletPort": 0}
            | {"labels": {"bench": prefix}}
            for n in names
        ],
    }
    (work / "fleet.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", str(work / "fleet.yaml"), "--shard", "--leader-elect-namespace", ns]
    args += ["--kubelet-port", "0"]
    started = time.monotonic()
    replicas = [Replica(kubeconfig, args, work / f"shard-{i}.log", level) for i in range(count)]
    figures: dict[str, float] = {}

    def owner(identity: str, among: list[Replica]) -> Replica | None:
        return next((r for r in among if identity.startswith(r.prefix)), None)

    buckets = buckets_of(names)
    bucket_leases = [lease_name("shard", group_of(names), str(i)) for i in range(len(buckets))]

    async def holders() -> dict[str, str]:
        """Bucket Lease name -> its holder."""
        items = await leases(client, ns, "vkubelet.io/replica-role=bucket")
        return {i["metadata"]["name"]: i["spec"].get("holderIdentity") or "" for i in items}

    async def shared(alive: list[Replica], renewed_after: datetime | None = None) -> bool:
        """Every bucket held by a live replica, none above its fair share of buckets, and (after
        a kill) every node's heartbeat renewed since."""
        held = await holders()
        if any(name not in held for name in bucket_leases):
            return False
        owners = [owner(held[name], alive) for name in bucket_leases]
        if any(o is None for o in owners):
            return False
        fair = math.ceil(len(buckets) / len(alive))
        if max(owners.count(r) for r in alive) > fair:
            return False
        if renewed_after is not None:
            renewals = await node_renewals(client)
            return all(renewals.get(n, renewed_after) > renewed_after for n in names)
        return True

    def fencing_stops(among: list[Replica] = replicas) -> int:
        """Buckets stopped because their Lease could not be renewed in time (from the logs)."""
        return sum(r.logfile.read_text(errors="replace").count("stopping (fencing)") for r in among)

    try:
        first = datetime.now(UTC)
        await poll(lambda: shared(replicas, first), 600, "the fleet shared")
        figures["shared after start (s)"] = time.monotonic() - started
        figures["fencing stops until shared"] = fencing_stops()
        cpu0 = {r.proc.pid: cpu_seconds(r.proc.pid) for r in replicas}
        await asyncio.sleep(60)
        cpu = sum(cpu_seconds(r.proc.pid) - cpu0[r.proc.pid] for r in replicas)
        figures["CPU s per 1,000 node-minutes (settled)"] = cpu / nodes * 1000
        victim = replicas[-1]
        survivors_before = fencing_stops(replicas[:-1])
        load = os.getloadavg()[0]
        killed = datetime.now(UTC)
        victim.kill()
        try:
            figures["takeover of a dead replica's nodes (s)"] = await poll(
                lambda: shared(replicas[:-1], killed), 300, "the dead replica's nodes taken over"
            )
        except TimeoutError as e:
            log(str(e))
            figures["takeover of a dead replica's nodes (s)"] = float("nan")  # not in 300 s
        figures["load average (1 min) at the kill"] = load
        await asyncio.sleep(30)  # settled: no stop in the 30 s after the takeover either
        figures["fencing stops by the survivors, kill + takeover + 30 s"] = (
            fencing_stops(replicas[:-1]) - survivors_before
        )
    finally:
        for replica in replicas:
            replica.kill(signal.SIGTERM)
        await client.delete("/api/v1/nodes", params={"labelSelector": f"bench={prefix}"})
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--takeovers", type=int, default=3, help="0: no leader election run")
    parser.add_argument("--nodes", type=int, default=1000, help="0: no sharding run")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--cluster", help="a running dev cluster (default: a new one)")
    parser.add_argument("--log-level", default="warning", help="of the sharding replicas")
    parser.add_argument("--logs", type=Path, help="keep the replicas' logs in this directory")
    options = parser.parse_args()
    cluster, ours = cluster_for(options.cluster, "bench-ha")
    try:
        async with http_client(cluster.kubeconfig, 16) as client:
            ns = await new_namespace(client, "bench-ha")
            with tempfile.TemporaryDirectory() as tmp:
                work = options.logs or Path(tmp)
                work.mkdir(parents=True, exist_ok=True)
                times: list[float] = []
                if options.takeovers:
                    log(f"leader election: {options.takeovers} takeovers")
                    times = await leader_takeovers(
                        cluster.kubeconfig, client, ns, work, options.takeovers
                    )
                figures = {}
                if options.nodes:
                    log(f"sharding: {options.replicas} replicas x {options.nodes} nodes")
                    figures = await sharding(
                        cluster.kubeconfig,
                        client,
                        ns,
                        work,
                        options.nodes,
                        options.replicas,
                        options.log_level,
                    )
            await client.delete(f"/api/v1/namespaces/{ns}")
    finally:
        if ours:
            cluster.down()
    print(f"host load (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows: list[tuple[str, ...]] = [("figure", "value")]
    if times:
        rows.append(
            (
                f"leader takeover after SIGKILL, p50 / max of {len(times)} (s)",
                f"{pct(times, 0.5):.1f} / {max(times):.1f}",
            )
        )
    for name, value in figures.items():
        rows.append((f"{options.replicas} x {options.nodes} nodes: {name}", f"{value:.1f}"))
    print_table(rows)


if __name__ == "__main__":
    asyncio.run(main())
