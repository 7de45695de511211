"""Benchmark: request latency and throughput on the pod network, from a real worker pod.

    .venv/bin/python bench/pod_network.py [--cluster NAME] [--requests 400] [--seconds 5]
        [--concurrency 8] [--no-vm] [--no-cluster] [--no-migration] [--migration-rounds 2]

In a dev cluster with two workers (started here unless `--cluster` names one that has them), a
client pod on worker 0 measures HTTP requests to busybox httpd replicas:
- pod -> pod by address (the replica on the other worker): the network's own cost;
- pod -> pod through a ClusterIP Service (kube-proxy's nftables on the way);
- pod -> a host-side *virtual pod* through a Service: a network namespace linked to the host the
  way the vm provider links a VM (a veth whose host end holds the gateway and forwards, a /32
  route), serving from busybox httpd like the replicas. It is the VM path without QEMU: what
  routing through the hypervisor host costs;
- pod -> VM through a Service: a vm node on this machine (`vkubelet run --provider vm`, routed
  mode, podCIDR a /24 of the cluster's virtual range), the small test guest serving with busybox
  httpd. Caveat: QEMU here runs under TCG (software emulation) with a user-space virtio-net (no
  vhost-net), so this figure is mostly the emulator's cost, not what KVM hardware would show;
  the virtual-pod row is the network path alone. `--no-vm` leaves the VM out (no root/QEMU).
- pod -> pod *below* through an upper Service: a second dev cluster with one worker, joined to
  this one as a virtual node by a cluster-provider agent on this machine; the Service's endpoint
  is the lower pod's own address, routed through this machine. `--no-cluster` leaves it out.

Then the poll gap during live migration (`--no-migration` leaves it out; it needs the VM too):
two routed vm nodes with a /24 each of the virtual range and the whole range as
`sharedPodCIDRs`, `vkubelet vm-controller`, a VirtualMachine behind a Service; from the client
pod's netns one GET every 100 ms to the Service and one to the VM's address, while a
VirtualMachineMigration moves it, back and forth (`--migration-rounds`). Printed per move: the
longest time without an answer of each, beside QEMU's own downtime figure (the migration's
status). The poll gap includes what QEMU's figure leaves out: the target's network taking over
the address and, through the Service, the endpoint changing hands.

Requests are made from the client pod's own network namespace (entered with nsenter from the
host, found by the pod's cgroup), by a small Python client: one new TCP connection and one
HTTP/1.0 GET per request, as busybox `wget` does. Latency: `--requests` sequential requests,
p50/p99. Throughput: `--concurrency` connections in a loop for `--seconds`. Each target's
figures are also given as a ratio to the pod -> pod Service figures. Targets take turns, twice.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from _common import log, pct, print_table

from vkubelet.devcluster import Cluster, list_clusters
from vkubelet.providers.vm._net import PodNetwork
from vkubelet.testing import (
    Kubectl,
    local_test_address,
    node_ready,
    start_agent,
    virtual_pod,
    wait_for,
)

BIN = Path(sys.executable).parent
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists"}
DNS = "10.96.0.10"  # the dev cluster's CoreDNS Service
#: Started in the guest after each boot (the test guest has busybox, no init for services).
SERVE = "mkdir -p /tmp/www && echo ok > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
#: Label of the two vm nodes the migrated VM may run on.
PAIR = "bench.vkubelet.io/migrate"
TAGS = ("Service", "address")  # what the poller polls during a migration

#: Runs inside the client pod's network namespace. argv: (tag url)...: one GET every 100 ms to
#: each url, each answer printed as `tag <monotonic time>` (the host's clock: netns share it).
POLLER = r"""
import http.client, sys, threading, time
from urllib.parse import urlsplit
lock = threading.Lock()

def poll(tag, url):
    parts = urlsplit(url)
    while True:
        try:
            connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=2)
            connection.request("GET", parts.path or "/")
            if connection.getresponse().status == 200:
                with lock:
                    sys.stdout.write(f"{tag} {time.monotonic()}\n")
                    sys.stdout.flush()
            connection.close()
        except OSError:
            pass
        time.sleep(0.1)

for tag, url in zip(sys.argv[1::2], sys.argv[2::2]):
    threading.Thread(target=poll, args=(tag, url), daemon=True).start()
threading.Event().wait()
"""

#: Runs inside the client pod's network namespace. argv: url requests seconds concurrency.
CLIENT = r"""
import asyncio, json, sys, time
from urllib.parse import urlsplit
url = sys.argv[1]
requests, seconds, concurrency = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
parts = urlsplit(url)
host, port, path = parts.hostname, parts.port or 80, parts.path or "/"
request = f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()

async def one():
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    body = await reader.read()
    writer.close()
    if not body.startswith(b"HTTP/1.") or b" 200 " not in body.split(b"\r\n", 1)[0]:
        raise RuntimeError(body[:80])

async def main():
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        await one()
        latencies.append(time.perf_counter() - started)
    done = 0
    deadline = time.perf_counter() + seconds
    async def loop():
        nonlocal done
        while time.perf_counter() < deadline:
            await one()
            done += 1
    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    print(json.dumps({"latencies": latencies, "rate": done / (time.perf_counter() - started)}))

asyncio.run(main())
"""


@dataclass
class Figures:
    latencies: list[float]
    rates: list[float]

    def p(self, q: float) -> float:
        return pct(self.latencies, q) * 1000

    @property
    def rate(self) -> float:
        return sum(self.rates) / len(self.rates)


def httpd(name: str, image: str, node: str | None, labels: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "httpd",
                "image": image,
                "imagePullPolicy": "Never",
                "command": [
                    "sh",
                    "-c",
                    "mkdir -p /www && echo ok > /www/index.html && exec httpd -f -p 8080 -h /www",
                ],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }


def service(name: str, selector: dict[str, str] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    if selector:
        spec["selector"] = selector
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def pod_netns(kubectl: Kubectl, ns: str, pod: str) -> str:
    """/proc/<pid>/ns/net of a process of the pod (found by the pod UID in its cgroup path)."""
    uid = kubectl.json("-n", ns, "get", "pod", pod)["metadata"]["uid"]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"pod{uid}" in (proc / "cgroup").read_text():
                    return str(proc / "ns" / "net")
            except OSError:
                continue
    raise SystemExit(f"no process of pod {pod} ({uid}) found on this machine")


@contextmanager
def vm_serving(cluster: Cluster, kubectl: Kubectl, ns: str) -> Iterator[None]:
    """A vm node (routed) and a VM pod `vm` serving HTTP on :8080 behind the Service `vm`."""
    image = guest_image()
    base = str(cluster.virtual_pod_cidr()).rsplit(".", 2)[0]
    work = Path(tempfile.mkdtemp(prefix="vkbn-", dir="/tmp"))  # short: QEMU's socket paths
    node = f"hv-bench-{uuid.uuid4().hex[:5]}"
    config = work / "vm.yaml"
    config.write_text(
        json.dumps(
            {
                "stateDir": "state",
                "accel": "tcg",
                "podCIDR": f"{base}.252.0/24",
                "reserved": {"memory": "1Gi"},
                "translations": [{"name": "tiny", "url": image.as_uri()}],
                "network": {"clusterDNS": [DNS]},
            }
        )
    )
    with ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        agent = start_agent(cluster, work, provider="vm", config=config, name=node, address=address)
        try:
            wait_for(lambda: node_ready(kubectl, node), timeout=90, what=f"node {node} Ready")
            vm = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "vm", "labels": {"app": "vm"}},
                "spec": {
                    "nodeName": node,
                    "tolerations": [TOLERATION],
                    "containers": [
                        {
                            "name": "vm",
                            "image": "vm.vkubelet.io/tiny",
                            "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                            "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                        }
                    ],
                },
            }
            for item in (vm, service("vm", {"app": "vm"})):
                kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(item))
            wait_for(
                lambda: (
                    kubectl("-n", ns, "exec", "vm", "--", "sh", "-c", SERVE, check=False).returncode
                    == 0
                ),
                timeout=300,
                interval=2,
                what="the VM's guest serving HTTP",
            )
            kubectl(
                "-n", ns, "wait", "--for=condition=Ready", "pod/vm", "--timeout=2m", timeout=150
            )
            yield
        finally:
            kubectl("-n", ns, "delete", "pod", "vm", "--wait=true", check=False, timeout=120)
            agent.stop()
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)
            shutil.rmtree(work, ignore_errors=True)


def guest_image() -> Path:
    """The small test guest (`vkubelet dev vm-image` builds it once and caches it)."""
    built = subprocess.run(
        [str(BIN / "vkubelet"), "dev", "vm-image"], capture_output=True, text=True, check=True
    )
    return Path(built.stdout.split()[-1])


@contextmanager
def lower_serving(cluster: Cluster, kubectl: Kubectl, ns: str, image: str) -> Iterator[None]:
    """A second dev cluster with one worker, joined to `cluster` as a virtual node by a
    cluster-provider agent on this machine, and `below` (httpd bound to that node, so a real
    container on the lower worker) behind the upper Service `below`."""
    lower = Cluster(f"bench-low-{uuid.uuid4().hex[:4]}")
    work = Path(tempfile.mkdtemp(prefix="vkbl-", dir="/tmp"))
    node = f"vk-below-{uuid.uuid4().hex[:5]}"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        stack.callback(lower.down)
        lower.up(workers=1, progress=log, tie_to_parent=True)
        config = work / "lower.yaml"
        config.write_text(
            json.dumps(
                {
                    "kubeconfig": str(lower.kubeconfig),
                    "upperClusterID": f"bench-{uuid.uuid4().hex[:6]}",
                    "namespaces": {"prefix": "up-"},
                }
            )
        )
        agent = start_agent(
            cluster, work, provider="cluster", config=config, name=node, address="127.0.0.1"
        )
        stack.callback(kubectl, "delete", "node", node, "--ignore-not-found", "--wait=false")
        stack.callback(agent.stop)
        stack.callback(kubectl, "-n", ns, "delete", "pod", "below", "--wait=true", check=False)
        wait_for(lambda: node_ready(kubectl, node), timeout=90, what=f"node {node} Ready")
        below = httpd("below", image, None, {"app": "below"})
        below["spec"] |= {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [TOLERATION],
        }
        for item in (below, service("below", {"app": "below"})):
            kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(item))
        kubectl(
            "-n", ns, "wait", "--for=condition=Ready", "pod/below", "--timeout=180s", timeout=200
        )
        yield


@dataclass
class Move:
    """One live migration seen by the poller."""

    source: str
    target: str
    downtime_ms: int | None  # QEMU's own figure (the migration's status)
    gaps: dict[str, float]  # per poll tag, the longest time without an answer, s
    answers: dict[str, int]
    seconds: float  # migration created -> target Ready and polled 20 times since
    load: str


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def vm_status(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return dict(kubectl.json("-n", ns, "get", "vm", "keep").get("status") or {})


def ready_on(kubectl: Kubectl, ns: str, node: str) -> bool:
    status = vm_status(kubectl, ns)
    ready: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c["type"] == "Ready"), {}
    )
    return status.get("nodeName") == node and ready.get("status") == "True"


def answers(poll_log: Path) -> list[tuple[str, float]]:
    return [
        (tag, float(at))
        for tag, at in (line.split() for line in poll_log.read_text().splitlines() if line)
    ]


def longest_gap(start: float, end: float, seen: list[float]) -> float:
    times = [start, *(t for t in seen if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(times))


def release_node(kubectl: Kubectl, node: str, state: Path, cidr: str) -> None:
    """What outlives a vm agent: its QEMU processes and their pod networks; then the node."""
    for pid_file in state.glob("vms/*/m/pid"):
        try:
            os.kill(int(pid_file.read_text().split()[0]), 9)
        except (OSError, ValueError):
            continue
    network = PodNetwork(cidr)
    for run_dir in state.glob("vms/*"):
        try:
            asyncio.run(network.detach(run_dir.name))
        except Exception as error:  # clean-up goes on; say what stayed
            log(f"detaching {run_dir.name} of {node}: {error}")
    kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def migration_gaps(
    cluster: Cluster, kubectl: Kubectl, ns: str, netns: str, rounds: int
) -> tuple[list[Move], str | None]:
    """A VirtualMachine on two routed vm nodes sharing the virtual range, behind the Service
    `keep`, moved back and forth `rounds` times while the client pod's netns polls it through
    the Service and by its address; and why a move failed (the moves after it are not made,
    and the scratch directory with the agents' and the controller's logs is kept)."""
    virtual = cluster.virtual_pod_cidr()
    base = str(virtual).rsplit(".", 2)[0]
    image = guest_image()
    subprocess.run(
        [str(BIN / "vkubelet"), "vm", "install-crds", "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True,
        check=True,
    )
    work = Path(tempfile.mkdtemp(prefix="vkbm-", dir="/tmp"))  # short: QEMU's socket paths
    nodes: list[str] = []
    moves: list[Move] = []
    with ExitStack() as stack:
        failure: str | None = None

        def tidy() -> None:
            if failure is None:
                shutil.rmtree(work, ignore_errors=True)
            else:
                log(f"kept for a look: {work} (controller.log, n*/agent.log)")

        stack.callback(tidy)
        for index, third in enumerate(random.sample(range(1, 250), 2)):
            workdir = work / f"n{index}"
            workdir.mkdir()
            cidr, name = f"{base}.{third}.0/24", f"hv-mig{index}-{uuid.uuid4().hex[:5]}"
            config = workdir / "vm.yaml"
            config.write_text(
                json.dumps(
                    {
                        "stateDir": "state",
                        "accel": "tcg",
                        "podCIDR": cidr,
                        "sharedPodCIDRs": [str(virtual)],
                        "reserved": {"memory": "1Gi"},
                        "translations": [{"name": "tiny", "url": image.as_uri()}],
                        "network": {"clusterDNS": [DNS]},
                    }
                )
            )
            address = stack.enter_context(local_test_address())
            agent = start_agent(
                cluster, workdir, provider="vm", config=config, name=name, address=address
            )
            stack.callback(release_node, kubectl, name, workdir / "state", cidr)
            stack.callback(agent.stop)
            nodes.append(name)
        for name in nodes:
            wait_for(lambda name=name: node_ready(kubectl, name), timeout=90, what=f"{name} Ready")  # type: ignore[misc]
            kubectl("label", "node", name, f"{PAIR}=yes", "--overwrite")
        with (work / "controller.log").open("wb") as controller_log:
            controller = subprocess.Popen(
                [str(BIN / "vkubelet"), "vm-controller", "--kubeconfig", str(cluster.kubeconfig),
                 "--namespace", ns, "--lease-namespace", ns, "--identity", "bench"],
                stdout=controller_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        stack.callback(stop_process, controller)
        k = ("-n", ns)
        stack.callback(kubectl, *k, "delete", "vm", "keep", "--wait=true", check=False, timeout=180)
        vm = {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "keep"},
            "spec": {
                "replicas": 1,
                "template": {
                    "metadata": {"labels": {"app": "keep"}},
                    "spec": {
                        "nodeSelector": {PAIR: "yes"},
                        "tolerations": [TOLERATION],
                        "terminationGracePeriodSeconds": 10,
                        "containers": [
                            {
                                "name": "vm",
                                "image": "vm.vkubelet.io/tiny",
                                "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                                "readinessProbe": {
                                    "httpGet": {"path": "/", "port": 8080},
                                    "periodSeconds": 1,
                                },
                            }
                        ],
                    },
                },
            },
        }
        for item in (vm, service("keep", {"app": "keep"})):
            kubectl(*k, "apply", "-f", "-", input=json.dumps(item))
        first = str(wait_for(lambda: vm_status(kubectl, ns).get("nodeName"), timeout=120))

        def serving() -> bool:
            pod = vm_status(kubectl, ns).get("podName")
            started = pod and kubectl(*k, "exec", pod, "--", "sh", "-c", SERVE, check=False)
            return bool(started and started.returncode == 0)

        wait_for(serving, timeout=300, interval=2, what="httpd started in the guest")
        wait_for(lambda: ready_on(kubectl, ns, first), timeout=120, what=f"keep Ready on {first}")
        address = vm_status(kubectl, ns)["ip"]
        cluster_ip = kubectl.json(*k, "get", "service", "keep")["spec"]["clusterIP"]
        poll_log = work / "poll.log"
        with poll_log.open("wb") as out:
            poller = subprocess.Popen(
                ["nsenter", f"--net={netns}", sys.executable, "-c", POLLER,
                 "Service", f"http://{cluster_ip}/", "address", f"http://{address}:8080/"],
                stdout=out, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        stack.callback(stop_process, poller)

        now = time.monotonic()
        wait_for(partial(answered_since, poll_log, now, 20), timeout=60, what="both polls")
        for number in range(rounds):
            try:
                moves.append(move_once(kubectl, ns, nodes, f"keep-move-{number}", poll_log))
            except (Exception, pytest.fail.Exception) as error:  # report the moves made
                failure = f"move {number + 1} failed: {str(error).strip()[:300]}"
                log(f"{failure}\nVM status: {json.dumps(vm_status(kubectl, ns))}")
                break
            log(f"migration {number + 1}: {moves[-1]}")
    return moves, failure


def move_once(kubectl: Kubectl, ns: str, nodes: list[str], name: str, poll_log: Path) -> Move:
    """Migrate the VM to the other node; the poll's gaps from the migration's creation until
    the VM is Ready on the target and both polls answered 20 times since."""
    k = ("-n", ns)
    source = str(vm_status(kubectl, ns)["nodeName"])
    target = next(n for n in nodes if n != source)
    figures_at = load()
    start = time.monotonic()
    migration = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": name},
        "spec": {"vmName": "keep", "targetNode": target},
    }
    kubectl(*k, "apply", "-f", "-", input=json.dumps(migration))

    def succeeded() -> dict[str, Any] | None:
        found = kubectl.json(*k, "get", "vmmigration", name).get("status") or {}
        if found.get("phase") == "Failed":
            raise RuntimeError(f"migration {name} failed: {found}")
        return found if found.get("phase") == "Succeeded" else None

    done = wait_for(succeeded, timeout=300, interval=1, what=f"{name} Succeeded")
    wait_for(partial(ready_on, kubectl, ns, target), timeout=120, what=f"Ready on {target}")
    after = time.monotonic()
    wait_for(partial(answered_since, poll_log, after, 20), timeout=60, what="the polls answered")
    end = time.monotonic()
    seen = answers(poll_log)
    downtime = done.get("downtimeMilliseconds")
    return Move(
        source,
        target,
        None if downtime is None else int(downtime),
        {tag: longest_gap(start, end, [at for t, at in seen if t == tag]) for tag in TAGS},
        {tag: sum(t == tag and start <= at <= end for t, at in seen) for tag in TAGS},
        end - start,
        figures_at,
    )


def answered_since(poll_log: Path, start: float, count: int) -> bool:
    """Whether each of the poller's targets answered `count` times since `start`."""
    seen = answers(poll_log)
    return all(sum(t == tag and at > start for t, at in seen) >= count for tag in TAGS)


def measure(netns: str, url: str, args: argparse.Namespace) -> tuple[list[float], float]:
    argv = [str(args.requests), str(args.seconds), str(args.concurrency)]
    done = subprocess.run(
        ["nsenter", f"--net={netns}", sys.executable, "-c", CLIENT, url, *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=120 + args.seconds,
    )
    if done.returncode != 0:
        raise SystemExit(f"{url}: {done.stderr.strip()[-400:]}")
    result = json.loads(done.stdout)
    return result["latencies"], result["rate"]


def run(cluster: Cluster, args: argparse.Namespace) -> None:
    kubectl = Kubectl(cluster.kubeconfig)
    workers = [w.name for w in cluster.workers()]
    image = cluster.image_reference("busybox")
    ns = f"bench-net-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    try:
        k = ["-n", ns]
        client = httpd("client", image, workers[0], {"role": "client"})
        for item in (
            client,
            httpd("web", image, workers[1], {"app": "web"}),
            service("web", {"app": "web"}),
            service("virt", None),
        ):
            kubectl(*k, "apply", "-f", "-", input=json.dumps(item))
        for pod in ("client", "web"):
            kubectl(
                *k, "wait", "--for=condition=Ready", f"pod/{pod}", "--timeout=120s", timeout=150
            )
        with ExitStack() as stack:
            address = stack.enter_context(virtual_pod(cluster, "ok\n"))
            if args.vm:
                stack.enter_context(vm_serving(cluster, kubectl, ns))
            if args.lower:
                stack.enter_context(lower_serving(cluster, kubectl, ns, image))
            kubectl(*k, "apply", "-f", "-", input=json.dumps(endpoint_slice(address)))
            web_ip = kubectl.json(*k, "get", "pod", "web")["status"]["podIP"]
            ip_of = {
                s: kubectl.json(*k, "get", "service", s)["spec"]["clusterIP"]
                for s in (
                    "web",
                    "virt",
                    *(["vm"] if args.vm else []),
                    *(["below"] if args.lower else []),
                )
            }
            targets = {
                "pod -> pod (address)": f"http://{web_ip}:8080/",
                "pod -> pod (Service)": f"http://{ip_of['web']}/",
                "pod -> virtual pod (Service)": f"http://{ip_of['virt']}/",
            }
            if args.vm:
                targets["pod -> VM (Service; TCG)"] = f"http://{ip_of['vm']}/"
            if args.lower:
                targets["pod -> pod below (cross-cluster Service)"] = f"http://{ip_of['below']}/"
            netns = pod_netns(kubectl, ns, "client")
            figures = {name: Figures([], []) for name in targets}
            wait_for(
                lambda: all(measure_ok(netns, url) for url in targets.values()),
                timeout=60,
                what="every target answers the client pod",
            )
            for turn in range(2):
                for name, url in targets.items():
                    log(f"turn {turn + 1}: {name}")
                    latencies, rate = measure(netns, url, args)
                    figures[name].latencies += latencies
                    figures[name].rates.append(rate)
            measured_at = load()
        report(figures, args, measured_at)  # first: the migrations take minutes
        if args.vm and args.migration:
            report_moves(*migration_gaps(cluster, kubectl, ns, netns, args.migration_rounds))
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def measure_ok(netns: str, url: str) -> bool:
    probe = argparse.Namespace(requests=1, seconds=0, concurrency=1)
    try:
        measure(netns, url, probe)
    except SystemExit:
        return False
    return True


def endpoint_slice(address: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "virt-1", "labels": {"kubernetes.io/service-name": "virt"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def report(figures: dict[str, Figures], args: argparse.Namespace, at_load: str) -> None:
    base = figures["pod -> pod (Service)"]
    rows: list[tuple[str, ...]] = [
        ("target", "p50 ms", "p99 ms", "req/s", "p50 vs Service", "req/s vs Service")
    ]
    for name, f in figures.items():
        rows.append(
            (
                name,
                f"{f.p(0.5):.2f}",
                f"{f.p(0.99):.2f}",
                f"{f.rate:.0f}",
                f"{f.p(0.5) / base.p(0.5):.2f}x",
                f"{f.rate / base.rate:.2f}x",
            )
        )
    print(
        f"\n{args.requests} sequential requests x2 (latency), {args.concurrency} connections "
        f"for {args.seconds:g} s x2 (throughput); one TCP connection per request; "
        f"load average (1/5/15 min) after: {at_load}"
    )
    print_table(rows)


def report_moves(moves: list[Move], failure: str | None) -> None:
    print(
        "\nlive migration (TCG, 256 MiB guest), polled every 100 ms from the client pod: "
        "longest time without an answer"
    )
    rows: list[tuple[str, ...]] = [
        ("move", "QEMU downtime ms", "gap via Service s", "gap to address s", "move s", "load")
    ]
    for number, move in enumerate(moves, start=1):
        downtime = "n/a" if move.downtime_ms is None else str(move.downtime_ms)
        rows.append(
            (
                f"{number}: {move.source} -> {move.target}",
                downtime,
                f"{move.gaps['Service']:.2f}",
                f"{move.gaps['address']:.2f}",
                f"{move.seconds:.1f}",
                move.load,
            )
        )
    print_table(rows)
    if failure:
        print(failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="a running dev cluster with two workers")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-vm", dest="vm", action="store_false", help="leave the VMs out")
    parser.add_argument(
        "--no-cluster", dest="lower", action="store_false", help="leave the lower cluster out"
    )
    parser.add_argument(
        "--no-migration", dest="migration", action="store_false", help="leave migration out"
    )
    parser.add_argument("--migration-rounds", type=int, default=2)
    args = parser.parse_args()
    if args.cluster:
        found = {c.name: c for c in list_clusters()}
        if args.cluster not in found or len(found[args.cluster].workers()) < 2:
            raise SystemExit(f"--cluster {args.cluster}: no such cluster with two workers is up")
        run(found[args.cluster], args)
        return
    cluster = Cluster(f"bench-net-{uuid.uuid4().hex[:4]}")
    try:
        cluster.up(workers=2, progress=log, tie_to_parent=True)
        run(cluster, args)
    finally:
        cluster.down()


if __name__ == "__main__":
    main()
