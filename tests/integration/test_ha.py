"""Agent replicas on a real control plane: a standby takes over a killed leader's node without
touching its pods; a paused or partitioned leader stops writing before (and after) the new one
acts; replicas share a fleet of nodes, and a dead replica's nodes are taken over by the others.

Each replica is a real `vkubelet run` process; the mock provider's state file stands for the
backend that outlives them. Who wrote what is read from the apiserver side: Lease holders and
renewal times, and for the old leader, the request log of a `kubectl proxy` it talks through.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from vkubelet.agent._leases import group_of, lease_name
from vkubelet.agent._sharding import buckets_of
from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    find_kubectl,
    node_ready,
    running_pod,
    wait_for,
)

LEADER_LEASE_SECONDS = 10  # the agent's default for --leader-elect
WRITES = re.compile(r"Filter accepting (POST|PUT|PATCH|DELETE) (\S+)")


@pytest.fixture
def ns(kubectl: Kubectl) -> Iterator[str]:
    """A namespace for this test's Leases and pods."""
    name = create_namespace(kubectl, f"ha-{uuid.uuid4().hex[:6]}")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def identity_prefix(replica: AgentProcess) -> str:
    assert replica.proc is not None
    return f"{socket.gethostname()}-{replica.proc.pid}-"


def holder(kubectl: Kubectl, ns: str, lease: str) -> str:
    result = kubectl("-n", ns, "get", "lease", lease, "-o", "json", check=False)
    if result.returncode != 0:
        return ""
    return str(json.loads(result.stdout)["spec"].get("holderIdentity") or "")


def node_lease_renewals(kubectl: Kubectl) -> dict[str, datetime]:
    """Node name -> the renewTime of its kube-node-lease Lease (written by its node agent)."""
    leases = kubectl.json("-n", "kube-node-lease", "get", "lease")["items"]
    return {
        item["metadata"]["name"]: datetime.fromisoformat(item["spec"]["renewTime"])
        for item in leases
        if item["spec"].get("renewTime")
    }


def log_time(log: str, pattern: str) -> datetime | None:
    """When (local time, the log's clock) a line matching `pattern` was first logged."""
    for line in log.splitlines():
        if re.search(pattern, line):
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return None


def get(url: str) -> tuple[int, str]:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # as a kubelet probes
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as answer:  # noqa: S310
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Replicas:
    """The replicas of one test, stopped (and their nodes deleted) at its end."""

    def __init__(self, cluster: Cluster, kubectl: Kubectl, tmp_path: Path) -> None:
        self.cluster, self.kubectl, self.tmp_path = cluster, kubectl, tmp_path
        self.started: list[AgentProcess] = []
        self.proxies: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], kubeconfig: Path | None = None) -> AgentProcess:
        replica = AgentProcess(
            kubeconfig or self.cluster.kubeconfig, args, self.tmp_path / f"{name}.log"
        ).start()
        self.started.append(replica)
        return replica

    def proxy(self, port: int, log: Path) -> tuple[subprocess.Popen[bytes], Path]:
        """`kubectl proxy` at `port` (its -v=6 log names every request it forwards) and a
        kubeconfig that goes through it."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [
                    *(find_kubectl(), "--kubeconfig", str(self.cluster.kubeconfig)),
                    *("proxy", f"--port={port}", "-v=6"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.proxies.append(proc)
        kubeconfig = self.tmp_path / f"proxy-{port}.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "p", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "p", "user": {}}],
                    "contexts": [{"name": "p", "context": {"cluster": "p", "user": "p"}}],
                    "current-context": "p",
                }
            )
        )
        wait_for(lambda: _listening(port), timeout=20, what=f"kubectl proxy on {port}")
        return proc, kubeconfig

    def close(self, nodes_selector: str) -> None:
        for replica in self.started:
            if replica.proc is not None and replica.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(replica.proc.pid, signal.SIGCONT)
            replica.stop()
        for proc in self.proxies:
            proc.kill()
            proc.wait()
        self.kubectl("delete", "node", "-l", nodes_selector, "--wait=false", check=False)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def replicas(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> Iterator[tuple[Replicas, str]]:
    label = f"ha-test-{uuid.uuid4().hex[:6]}"
    group = Replicas(kube_cluster, kubectl, tmp_path)
    yield group, label
    group.close(f"ha-test={label}")


def single_node_args(tmp_path: Path, node: str, label: str, ns: str, port: int) -> list[str]:
    config = tmp_path / "mock.json"
    config.write_text(json.dumps({node: {"pods": "20", "stateFile": str(tmp_path / "state")}}))
    return [
        *("--provider", "mock", "--provider-config", str(config), "--nodename", node),
        *("--label", f"ha-test={label}", "--kubelet-port", str(port)),
        *("--leader-elect", "--leader-elect-namespace", ns),
    ]


def creates(tmp_path: Path) -> int:
    """How many pods the backend ever started (the mock's state file counts them)."""
    count: int = json.loads((tmp_path / "state").read_text())["creates"]
    return count


def pods_as_they_are(kubectl: Kubectl, ns: str) -> dict[str, tuple[str, str, int]]:
    """Pod name -> (uid, phase, restarts)."""
    return {
        pod["metadata"]["name"]: (
            pod["metadata"]["uid"],
            pod["status"].get("phase", ""),
            sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or []),
        )
        for pod in kubectl.json("-n", ns, "get", "pods")["items"]
    }


class ReadyWatch:
    """Samples the node's Ready condition in the background; the longest NotReady stretch."""

    def __init__(self, kubectl: Kubectl, node: str) -> None:
        self.kubectl, self.node = kubectl, node
        self.longest_not_ready = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        since: float | None = None
        while not self._stop.wait(0.5):
            now = time.monotonic()
            if node_ready(self.kubectl, self.node):
                since = None
            else:
                since = now if since is None else since
                self.longest_not_ready = max(self.longest_not_ready, now - since)


def leader_and_standby(
    replicas: Replicas, tmp_path: Path, node: str, label: str, ns: str, *, via_proxy: bool
) -> tuple[AgentProcess, AgentProcess, subprocess.Popen[bytes] | None, Path]:
    """Replica `a` (through a kubectl proxy if asked) leads; `b` stands by."""
    proxy_log = tmp_path / "proxy.log"
    proxy, kubeconfig = (None, None)
    if via_proxy:
        proxy, kubeconfig = replicas.proxy(free_port(), proxy_log)
    lease = f"vkubelet-agent-{node}"
    a = replicas.start("a", single_node_args(tmp_path, node, label, ns, free_port()), kubeconfig)
    wait_for(
        lambda: holder(replicas.kubectl, ns, lease).startswith(identity_prefix(a)),
        timeout=30,
        what="replica a leading",
    )
    b = replicas.start("b", single_node_args(tmp_path, node, label, ns, free_port()))
    wait_for(lambda: "stands by" in b.log(), timeout=30, what="replica b standing by")
    wait_for(lambda: node_ready(replicas.kubectl, node), timeout=30, what=f"node {node} Ready")
    return a, b, proxy, proxy_log


def test_a_killed_leaders_node_is_taken_over_within_15_s_and_its_pods_are_neither_restarted_nor_recreated(  # noqa: E501
    replicas: tuple[Replicas, str], kubectl: Kubectl, tmp_path: Path, ns: str
) -> None:
    group, label = replicas
    node = f"ha-{uuid.uuid4().hex[:6]}"
    a, b, _, _ = leader_and_standby(group, tmp_path, node, label, ns, via_proxy=False)
    port_b = int(b.args[b.args.index("--kubelet-port") + 1])
    assert get(f"https://127.0.0.1:{port_b}/healthz") == (200, "ok")  # a standby is healthy
    assert get(f"https://127.0.0.1:{port_b}/readyz") == (503, "standby")
    for _ in range(2):
        running_pod(kubectl, node, namespace=ns)
    before = pods_as_they_are(kubectl, ns)
    started = creates(tmp_path)

    with ReadyWatch(kubectl, node) as ready:
        killed_at = datetime.now(UTC)
        a.stop(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(
            lambda: (
                holder(kubectl, ns, f"vkubelet-agent-{node}").startswith(identity_prefix(b))
                and node_lease_renewals(kubectl).get(node, killed_at) > killed_at
            ),
            timeout=30,
            interval=0.2,
            what="replica b leading and renewing the node",
        )
        took = time.monotonic() - t0
        running_pod(kubectl, node, namespace=ns)  # the new leader acts: a new pod runs
    assert took <= 15, f"takeover took {took:.1f}s"
    assert ready.longest_not_ready < LEADER_LEASE_SECONDS
    after = pods_as_they_are(kubectl, ns)
    assert {name: after[name] for name in before} == before  # same uid, Running, 0 restarts
    assert creates(tmp_path) == started + 1  # only the new pod was started in the backend


def test_a_paused_leader_writes_nothing_once_it_resumes_after_its_lease_was_taken(
    replicas: tuple[Replicas, str], kubectl: Kubectl, tmp_path: Path, ns: str
) -> None:
    group, label = replicas
    node = f"ha-{uuid.uuid4().hex[:6]}"
    a, b, _, proxy_log = leader_and_standby(group, tmp_path, node, label, ns, via_proxy=True)
    running_pod(kubectl, node, namespace=ns)
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    paused_at = datetime.now(UTC)
    wait_for(
        lambda: (
            holder(kubectl, ns, f"vkubelet-agent-{node}").startswith(identity_prefix(b))
            and node_lease_renewals(kubectl).get(node, paused_at) > paused_at
        ),
        timeout=30,
        what="replica b leading and renewing the node",
    )
    mark = len(proxy_log.read_text())
    os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(lambda: "stopping" in a.log(), timeout=15, what="replica a noticing it lost")
    # A window longer than a renewal period and a node heartbeat: the old leader's queued work
    # (status updates, lease renewals, pod syncs) would have written by now.
    time.sleep(LEADER_LEASE_SECONDS + 2)
    writes = WRITES.findall(proxy_log.read_text()[mark:])
    assert writes == [], f"the old leader wrote after resuming: {writes}"
    assert "fenced" in a.log() or "stopping (fencing)" in a.log()
    assert holder(kubectl, ns, f"vkubelet-agent-{node}").startswith(identity_prefix(b))


def test_a_partitioned_leader_stops_acting_before_the_standby_takes_over(
    replicas: tuple[Replicas, str], kubectl: Kubectl, tmp_path: Path, ns: str
) -> None:
    group, label = replicas
    node = f"ha-{uuid.uuid4().hex[:6]}"
    a, b, proxy, _ = leader_and_standby(group, tmp_path, node, label, ns, via_proxy=True)
    assert proxy is not None
    proxy.kill()  # the old leader's only way to the apiserver: cut
    proxy.wait()
    wait_for(lambda: "now leads" in b.log(), timeout=30, what="replica b leading")
    wait_for(lambda: "stopping" in a.log(), timeout=15, what="replica a stopping")
    stopped = log_time(a.log(), r"stopping \(fencing\)")
    took_over = log_time(b.log(), r"now leads")
    assert stopped is not None and took_over is not None
    assert stopped < took_over, f"a stopped at {stopped}, b led from {took_over}"
    wait_for(lambda: node_ready(kubectl, node), timeout=30, what=f"node {node} Ready under b")


# -- sharding -----------------------------------------------------------------------------------
# 3 replicas x 10 nodes in CI on a shared 2-core host; VKUBELET_HA_SHARD_NODES=300 for the
# full-size run (bench/agent_replicas.py measures 1,000).
SHARD_NODES = int(os.environ.get("VKUBELET_HA_SHARD_NODES", "30"))


def shard_holders(kubectl: Kubectl, ns: str, names: list[str]) -> dict[str, str]:
    """Node name -> the identity holding the Lease of its bucket."""
    leases = kubectl.json("-n", ns, "get", "lease", "-l", "vkubelet.io/replica-role=bucket")
    by_lease = {
        i["metadata"]["name"]: i["spec"].get("holderIdentity") or "" for i in leases["items"]
    }
    group = group_of(names)
    return {
        node: by_lease[lease_name("shard", group, str(index))] or ""
        for index, bucket in enumerate(buckets_of(names))
        for node in bucket
        if lease_name("shard", group, str(index)) in by_lease
    }


def owner(identity: str, replicas: list[AgentProcess]) -> int | None:
    return next(
        (i for i, r in enumerate(replicas) if identity.startswith(identity_prefix(r))), None
    )


def test_replicas_share_a_fleet_fairly_and_a_dead_replicas_nodes_are_taken_over_within_40_s(
    replicas: tuple[Replicas, str], kubectl: Kubectl, tmp_path: Path, ns: str
) -> None:
    group, label = replicas
    prefix = f"hs-{uuid.uuid4().hex[:4]}"
    names = [f"{prefix}-{i:03d}" for i in range(SHARD_NODES)]
    buckets = buckets_of(names)
    (tmp_path / "mock.json").write_text(
        json.dumps({n: {"pods": "20", "stateFile": str(tmp_path / f"{n}.state")} for n in names})
    )
    config = {
        "kubeletAPI": False,
        "nodes": [
            {"name": n, "provider": "mock", "providerConfig": "mock.json", "kubeletPort": 0}
            | {"labels": {"ha-test": label}}
            for n in names
        ],
    }
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", str(tmp_path / "agent.yaml"), "--shard", "--leader-elect-namespace", ns]
    started = [group.start(f"r{i}", [*args, "--kubelet-port", "0"]) for i in range(3)]

    def shared_fairly(alive: list[AgentProcess]) -> Counter[int | None] | None:
        held = shard_holders(kubectl, ns, names)
        counts = Counter(owner(held.get(b[0], ""), started) for b in buckets)  # in buckets
        everyone = set(held) == set(names) and all(
            i is not None and started[i] in alive for i in counts
        )
        fair = math.ceil(len(buckets) / len(alive))
        return counts if everyone and max(counts.values()) <= fair else None

    wait_for(lambda: shared_fairly(started), timeout=90, what="the fleet shared by 3 replicas")
    wait_for(lambda: all(node_ready(kubectl, n) for n in names[:5]), timeout=30, what="nodes Ready")
    held = shard_holders(kubectl, ns, names)
    victim = started[2]
    its_nodes = sorted(n for n, h in held.items() if owner(h, started) == 2)
    pod = running_pod(kubectl, its_nodes[0], namespace=ns)
    pod_uid = kubectl.json("-n", ns, "get", "pod", pod)["metadata"]["uid"]

    killed_at = datetime.now(UTC)
    victim.stop(signal.SIGKILL)
    t0 = time.monotonic()

    def taken_over() -> bool:
        renewals = node_lease_renewals(kubectl)
        return shared_fairly(started[:2]) is not None and all(
            renewals.get(n, killed_at) > killed_at for n in its_nodes
        )

    wait_for(taken_over, timeout=60, interval=1.0, what="the dead replica's nodes taken over")
    took = time.monotonic() - t0
    assert took <= 40, f"takeover of {len(its_nodes)} nodes took {took:.1f}s"
    now = kubectl.json("-n", ns, "get", "pod", pod)
    assert now["metadata"]["uid"] == pod_uid and now["status"]["phase"] == "Running"
    state = json.loads((tmp_path / f"{its_nodes[0]}.state").read_text())
    assert state["creates"] == 1  # adopted by the new holder, not started again
