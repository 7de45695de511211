"""Benchmark: request latency and throughput on the pod network, from a real worker pod.

    .venv/bin/python bench/pod_network.py [--cluster NAME] [--requests 400] [--seconds 5]
        [--concurrency 8] [--no-vm]

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

Requests are made from the client pod's own network namespace (entered with nsenter from the
host, found by the pod's cgroup), by a small Python client: one new TCP connection and one
HTTP/1.0 GET per request, as busybox `wget` does. Latency: `--requests` sequential requests,
p50/p99. Throughput: `--concurrency` connections in a loop for `--seconds`. Each target's
figures are also given as a ratio to the pod -> pod Service figures. Targets take turns, twice.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import log, pct, print_table

from vkubelet.devcluster import Cluster, list_clusters
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
    image = subprocess.run(
        [str(BIN / "vkubelet"), "dev", "vm-image"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
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
                "translations": [{"name": "tiny", "url": Path(image).as_uri()}],
                "network": {"clusterDNS": ["10.96.0.10"]},
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
            serve = (
                "mkdir -p /tmp/www && echo ok > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
            )
            wait_for(
                lambda: (
                    kubectl("-n", ns, "exec", "vm", "--", "sh", "-c", serve, check=False).returncode
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
            kubectl(*k, "apply", "-f", "-", input=json.dumps(endpoint_slice(address)))
            web_ip = kubectl.json(*k, "get", "pod", "web")["status"]["podIP"]
            ip_of = {
                s: kubectl.json(*k, "get", "service", s)["spec"]["clusterIP"]
                for s in ("web", "virt", *(["vm"] if args.vm else []))
            }
            targets = {
                "pod -> pod (address)": f"http://{web_ip}:8080/",
                "pod -> pod (Service)": f"http://{ip_of['web']}/",
                "pod -> virtual pod (Service)": f"http://{ip_of['virt']}/",
            }
            if args.vm:
                targets["pod -> VM (Service; TCG)"] = f"http://{ip_of['vm']}/"
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
        report(figures, args)
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


def report(figures: dict[str, Figures], args: argparse.Namespace) -> None:
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
        f"for {args.seconds:g} s x2 (throughput); one TCP connection per request"
    )
    print_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="a running dev cluster with two workers")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-vm", dest="vm", action="store_false", help="leave the VM out")
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
