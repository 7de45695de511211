"""Benchmark: pods on SSH devices (`vkubelet run --provider ssh`) against a real control plane.

    sudo .venv/bin/python bench/ssh_devices.py [--pods 100] [--devices 10] [--rate 0 10]
                                               [--execs 50] [--log-lines 50] [--cluster NAME]
                                               [--image-pods 50] [--image-rate 10]
                                               [--logs DIR]

The devices are real sshd's from `vkubelet.testing.ssh_lab` (each in its own network namespace,
running as its own user, logged in to with a key and verified with known_hosts); they share this
machine's clock, so a time a command prints on a device compares with ours. One agent serves them
all from an inventory file, one multiplexed SSH connection per device. It measures:

- bind -> command running: `--pods` pods created bound to the devices (`spec.nodeName`, round
  robin), all at once (`--rate 0`) or paced at N pods/s. Each pod's command writes `date +%s.%N`
  to `$VKUBELET_POD_DIR/started` and then sleeps. Latency = that time - our wall clock just
  before the create request; also to Running as a watch sees it. The pod files' mtimes on the
  device (volume directory, pod.json, supervisor.pid, the container's pid file; to the kernel's
  clock tick) split the time into the agent's SSH round trips and the device-side start-up. The
  CPU time of the agent, of the devices (everything in their network namespaces) and of the
  control plane, and how busy the whole machine was, tell whether a run was CPU-bound.
- exec: `--execs` sequential `kubectl exec POD -- true`, the same through the apiserver over
  WebSocket from this process (no kubectl start-up), against plain OpenSSH `ssh ... true` to the
  same device (a new connection each time, and multiplexed with ControlMaster, the fair
  comparison with the agent's pooled connection) and an SSH channel on an open asyncssh
  connection (the floor of the provider's path). The methods take turns, so drift hits all.
- log follow: a pod prints `date +%s.%N` every `--log-interval` s; `kubectl logs -f` and, as the
  floor, `ssh ... tail -F` of the same log file on the device read along; latency = receipt time
  - the printed time, over `--log-lines` lines.
- images on a device: one more device, logged in to as root, runs Debian's podman (the lab's
  `PODMAN_SETTINGS`; the busybox image of the dev cluster loaded into it). On it, `--image-pods`
  pods at `--image-rate` pods/s, three ways one after the other: command pods (`image: host`),
  image pods (busybox through podman, an emptyDir mounted), and the floor, the same image run
  with `podman run -d` over an open SSH connection, no agent or API in the way. Each command
  creates a file first thing; latency = the file's mtime - our clock before the create (or the
  `ssh` request). Also: when the API saw Running (the floor: when `run -d` returned) and when
  the pod's container script started (for an image pod: `podman run` invoked).

Needs root (network namespaces, users, sshd). Starts a dev cluster unless `--cluster` names a
running one, and removes everything it created, also on failure. It is a benchmark, not a test:
it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import shlex
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import httpx2 as httpx
import msgspec
import websocket
import yaml
from _common import (
    TICKS,
    Pod,
    PodList,
    WatchEvent,
    cluster_for,
    control_plane_cpu,
    cpu_seconds,
    http_client,
    log,
    new_namespace,
    pct,
    print_table,
    tree_cpu,
    wait_until,
)

from vkubelet.devcluster import Cluster, build_image
from vkubelet.testing import (
    AgentProcess,
    find_kubectl,
    local_test_address,
)
from vkubelet.testing import start_agent as start_agent_process
from vkubelet.testing.sshlab import (
    PODMAN_SETTINGS,
    TestDevice,
    podman_load,
    podman_unavailable,
    ssh_inventory,
    ssh_lab,
    ssh_lab_unavailable,
)

CONCURRENCY = 32  # creates in flight in the all-at-once run
TOLERATE = [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}]
STARTED = 'date +%s.%N >"$VKUBELET_POD_DIR/started"; exec sleep 3600'
WARMUP = 3


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.0f}"  # NaN: no values


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all CPUs."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / TICKS, sum(values) / TICKS


def busy_since(before: tuple[float, float]) -> float:
    """The share of the machine's CPU time (all CPUs) that was busy since `before`."""
    busy, total = machine_cpu()
    return (busy - before[0]) / max(total - before[1], 1e-9)


def devices_cpu(devices: list[TestDevice]) -> float:
    """Everything of the devices: sshd's, session shells, supervisors, containers. A session's
    shell is reaped by its sshd and a supervisor lives on, so little escapes the count."""
    inodes = {f"net:[{Path('/run/netns', d.netns).stat().st_ino}]" for d in devices}
    return tree_cpu(lambda proc: str((proc / "ns" / "net").readlink()) in inodes)


# -- the lab and the agent ------------------------------------------------------------------------


def start_agent(
    cluster: Cluster,
    work: Path,
    devices: list[TestDevice],
    podman_devices: list[TestDevice],
    address: str,
    level: str,
) -> AgentProcess:
    inventory = ssh_inventory(devices)  # maxSessions: the default
    inventory["devices"] += ssh_inventory(podman_devices, **PODMAN_SETTINGS)["devices"]
    path = work / "inventory.yaml"
    path.write_text(yaml.safe_dump(inventory))
    return start_agent_process(
        cluster,
        work,
        provider="ssh",
        config=path,
        name="ssh-bench",
        address=address,
        extra_args=("--log-level", level),
    )


def pod_dir(device: TestDevice, uid: str) -> Path:
    """The pod's directory on the device (under the inventory's default podDir, relative to the
    device user's home), which is a directory of this machine too."""
    return device.home / ".vkubelet" / "pods" / uid


def ssh_argv(device: TestDevice, *options: str) -> list[str]:
    """Plain OpenSSH to the device, reading no user configuration, host key verified."""
    return [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(device.key_path),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"UserKnownHostsFile={device.known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "LogLevel=ERROR",
        *options,
        "-p",
        str(device.port),
        f"{device.user}@{device.address}",
    ]


@contextlib.contextmanager
def ssh_master(device: TestDevice, work: Path) -> Iterator[list[str]]:
    """An OpenSSH ControlMaster to the device; yields the options for its clients."""
    sock = work / f"cm-{device.name}"
    options = ["-o", "ControlMaster=no", "-o", f"ControlPath={sock}"]
    master = subprocess.Popen(
        [*ssh_argv(device, "-o", "ControlMaster=yes", "-o", f"ControlPath={sock}", "-N")],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            if master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ssh ControlMaster to {device.name} did not start")
            time.sleep(0.05)
        yield options
    finally:
        master.terminate()
        master.wait(10)


# -- the API --------------------------------------------------------------------------------------


class Watcher:
    """Watches the namespace's pods; records (wall clock) when each was first seen Running, and
    when it was deleted."""

    def __init__(self, client: httpx.AsyncClient, namespace: str) -> None:
        self.client = client
        self.path = f"/api/v1/namespaces/{namespace}/pods"
        self.running_at: dict[str, float] = {}
        self.deleted_at: dict[str, float] = {}
        self.ready = asyncio.Event()

    def _saw(self, kind: str, pod: Pod, now: float) -> None:
        if kind == "DELETED":
            self.deleted_at.setdefault(pod.metadata.name, now)
        elif pod.status is not None and pod.status.phase == "Running":
            self.running_at.setdefault(pod.metadata.name, now)

    async def run(self) -> None:
        while True:  # list, then watch from there; again whenever the watch ends
            response = await self.client.get(self.path)
            response.raise_for_status()
            listed = msgspec.json.decode(response.content, type=PodList)
            for pod in listed.items:
                self._saw("ADDED", pod, time.time())
            params = {"watch": "true", "resourceVersion": listed.metadata.resourceVersion}
            with contextlib.suppress(httpx.TransportError):
                async with self.client.stream("GET", self.path, params=params, timeout=None) as r:
                    self.ready.set()
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        now = time.time()
                        event = msgspec.json.decode(line, type=WatchEvent)
                        if event.type == "ERROR":  # 410 Gone: list again
                            break
                        self._saw(event.type, event.object, now)


async def nodes_ready(client: httpx.AsyncClient, names: list[str], limit: float) -> None:
    deadline = time.monotonic() + limit
    waiting = set(names)
    while waiting:
        for name in sorted(waiting):
            response = await client.get(f"/api/v1/nodes/{name}")
            if response.is_success:
                conditions = response.json()["status"].get("conditions") or []
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    waiting.discard(name)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"nodes not Ready after {limit:.0f} s: {sorted(waiting)}")
        await asyncio.sleep(0.2)


def pod_body(name: str, node: str, script: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "ssh"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": TOLERATE,
            "containers": [{"name": "main", "image": "host", "command": ["sh", "-c", script]}],
        },
    }


async def delete_pods(client: httpx.AsyncClient, ns: str, names: list[str], grace: int) -> None:
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(name: str) -> None:
        async with semaphore:
            response = await client.request(
                "DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", json={"gracePeriodSeconds": grace}
            )
            if response.status_code != 404:
                response.raise_for_status()

    await asyncio.gather(*(one(n) for n in names))


# -- bind -> command running ----------------------------------------------------------------------

# The marks of a pod's start, in order: where each comes from.
MARKS = [
    ("sent", "our create request sent"),
    ("answered", "the API answered the create"),
    ("volumes", "agent: 2nd SSH round trip (volume script) made the pod's volumes/ dir"),
    ("pod.json", "agent: 3rd round trip (start script) wrote pod.json"),
    ("supervisor", "start script: supervisor started (supervisor.pid written)"),
    ("container", "supervisor: container script started (its pid file)"),
    ("started", "the command ran (`date` in the pod)"),
    ("running", "a watch saw phase Running"),
]


@dataclass
class BindRun:
    label: str
    pods: int
    marks: dict[str, dict[str, float]] = field(default_factory=dict)  # pod -> mark -> time
    missing: int = 0  # pods whose device files were not all found
    elapsed: float = 0.0  # first create sent -> last pod Running
    agent_cpu_s: float = 0.0
    devices_cpu_s: float = 0.0
    control_plane_cpu_s: float = 0.0
    machine_busy: float = 0.0  # share of all CPUs busy during the run, whoever used them
    delete_s: float = 0.0

    def span(self, start: str, end: str) -> list[float]:
        return [m[end] - m[start] for m in self.marks.values() if start in m and end in m]


def device_marks(device: TestDevice, uid: str) -> dict[str, float] | None:
    """When the pod's files appeared on the device (mtimes, to the kernel's clock tick)."""
    directory = pod_dir(device, uid)
    try:
        return {
            "volumes": (directory / "volumes").stat().st_mtime_ns / 1e9,
            "pod.json": (directory / "pod.json").stat().st_mtime_ns / 1e9,
            "supervisor": (directory / "supervisor.pid").stat().st_mtime_ns / 1e9,
            "container": (directory / "c" / "main" / "pid").stat().st_mtime_ns / 1e9,
            "started": float((directory / "started").read_text().strip()),
        }
    except (OSError, ValueError):
        return None


async def bind_run(
    cluster: Cluster,
    client: httpx.AsyncClient,
    ns: str,
    watcher: Watcher,
    devices: list[TestDevice],
    pods: int,
    rate: float,
    agent_pid: int,
) -> BindRun:
    label = "all at once" if rate <= 0 else f"{rate:g} pods/s"
    prefix = f"b{uuid.uuid4().hex[:4]}"
    names = [f"{prefix}-{i}" for i in range(pods)]
    device_of = {name: devices[i % len(devices)] for i, name in enumerate(names)}
    run = BindRun(label, pods)
    uids: dict[str, str] = {}
    # Warm the connection pool, so that the creates do not pay for TLS handshakes.
    await asyncio.gather(*(client.get(f"/api/v1/namespaces/{ns}") for _ in range(CONCURRENCY)))
    cpu_before = cpu_seconds(agent_pid), devices_cpu(devices), control_plane_cpu(cluster)
    machine_before = machine_cpu()

    async def create(name: str) -> None:
        body = pod_body(name, device_of[name].name, STARTED)
        for _ in range(10):
            sent = time.time()
            response = await client.post(f"/api/v1/namespaces/{ns}/pods", json=body)
            if response.status_code in (429, 500, 503, 504):
                await asyncio.sleep(0.2)
                continue
            response.raise_for_status()
            run.marks[name] = {"sent": sent, "answered": time.time()}
            uids[name] = response.json()["metadata"]["uid"]
            return
        raise RuntimeError(f"could not create {name}: {response.status_code} {response.text}")

    started = time.time()
    if rate <= 0:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for name in names:
            queue.put_nowait(name)

        async def worker() -> None:
            while not queue.empty():
                await create(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    else:
        tasks = []
        for i, name in enumerate(names):
            delay = started + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(create(name)))
        await asyncio.gather(*tasks)
    await wait_until(lambda: all(n in watcher.running_at for n in names), 300, "pods Running")
    run.elapsed = max(watcher.running_at[n] for n in names) - started
    run.agent_cpu_s = cpu_seconds(agent_pid) - cpu_before[0]
    run.devices_cpu_s = devices_cpu(devices) - cpu_before[1]
    run.control_plane_cpu_s = control_plane_cpu(cluster) - cpu_before[2]
    run.machine_busy = busy_since(machine_before)

    # `started` may come a moment after the status says Running (the state is written first).
    def collected() -> bool:
        return all(device_marks(device_of[n], uids[n]) is not None for n in names)

    with contextlib.suppress(TimeoutError):
        await wait_until(collected, 20, "the pods' started files")
    for name in names:
        marks = device_marks(device_of[name], uids[name])
        if marks is None:
            run.missing += 1
        else:
            run.marks[name].update(marks)
        run.marks[name]["running"] = watcher.running_at[name]

    deleting = time.monotonic()
    await delete_pods(client, ns, names, 1)
    await wait_until(lambda: all(n in watcher.deleted_at for n in names), 300, "pods deleted")
    run.delete_s = time.monotonic() - deleting
    return run


def quantiles(values: list[float]) -> str:
    """p50 / p90 / p99 / max, in ms, for a report's row."""
    parts = (pct(values, 0.5), pct(values, 0.9), pct(values, 0.99), max(values, default=0))
    return " / ".join(ms(v) for v in parts)


def report_bind(runs: list[BindRun], devices: int) -> None:
    print(f"\n## bind -> command running: {runs[0].pods} pods over {devices} devices (ms)")
    rows: list[tuple[str, ...]] = [("", *(r.label for r in runs))]

    rows.append(("(p50 / p90 / p99 / max)", *("" for _ in runs)))
    rows.append(("bind -> command started", *(quantiles(r.span("sent", "started")) for r in runs)))
    rows.append(("bind -> API sees Running", *(quantiles(r.span("sent", "running")) for r in runs)))
    rows.append(
        (
            "first create -> last Running",
            *(f"{r.elapsed:.1f} s ({r.pods / r.elapsed:.0f} pods/s)" for r in runs),
        )
    )
    rows.append(
        (
            "CPU s for the run: agent / devices / ctl plane",
            *(
                f"{r.agent_cpu_s:.1f} / {r.devices_cpu_s:.1f} / {r.control_plane_cpu_s:.1f}"
                for r in runs
            ),
        )
    )
    rows.append(
        (
            f"machine CPU busy ({os.cpu_count()} CPUs, anyone's)",
            *(f"{100 * r.machine_busy:.0f} %" for r in runs),
        )
    )
    rows.append(("delete all (API objects gone)", *(f"{r.delete_s:.1f} s" for r in runs)))
    print_table(rows)

    print("\nWhere the time goes, per pod (ms, p50 / p99 of each step):")
    rows = [("step: from -> to", *(r.label for r in runs))]
    for (start, _), (end, what) in itertools.pairwise(MARKS):
        spans = [r.span(start, end) for r in runs]
        rows.append(
            (
                f"{start} -> {end}: {what}",
                *(f"{ms(pct(s, 0.5))} / {ms(pct(s, 0.99))}" for s in spans),
            )
        )
    print_table(rows)
    for run in runs:
        if run.missing:
            print(f"({run.label}: the device files of {run.missing} pods were incomplete)")


# -- exec -----------------------------------------------------------------------------------------


def timed_run(argv: list[str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... exited {result.returncode}: {result.stderr}")
    return elapsed


def websocket_exec(cluster: Cluster, ns: str, pod: str) -> float:
    """`exec -- true` through the apiserver as client-go speaks it (WebSocket, v5 or v4)."""
    server = cluster.server.replace("https://", "wss://")
    url = f"{server}/api/v1/namespaces/{ns}/pods/{pod}/exec?command=true&stdout=true&stderr=true"
    started = time.perf_counter()
    ws = websocket.create_connection(
        url,
        subprotocols=["v5.channel.k8s.io", "v4.channel.k8s.io"],
        sslopt={
            "ca_certs": str(cluster.pki / "ca.crt"),
            "certfile": str(cluster.pki / "admin.crt"),
            "keyfile": str(cluster.pki / "admin.key"),
            "cert_reqs": ssl.CERT_REQUIRED,
        },
        timeout=30,
    )
    status = b""
    try:
        while True:
            try:
                frame = ws.recv()
            except websocket.WebSocketConnectionClosedException:
                break
            if not frame:
                break
            data = frame if isinstance(frame, bytes) else frame.encode()
            if data[:1] == b"\x03":
                status += data[1:]
    finally:
        ws.close()
    elapsed = time.perf_counter() - started
    if json.loads(status or b"{}").get("status") != "Success":
        raise RuntimeError(f"websocket exec: {status!r}")
    return elapsed


@dataclass
class Method:
    label: str
    call: Callable[[], Awaitable[float]]
    seconds: list[float] = field(default_factory=list)


async def exec_overhead(
    cluster: Cluster, ns: str, pod: str, device: TestDevice, count: int, work: Path
) -> list[Method]:
    kubectl = find_kubectl()
    kube = [kubectl, "--kubeconfig", str(cluster.kubeconfig)]
    with ssh_master(device, work) as mux:
        conn = await asyncssh.connect(
            device.address,
            device.port,
            username=device.user,
            client_keys=[str(device.key_path)],
            known_hosts=str(device.known_hosts),
            config=[],
        )

        async def channel() -> float:
            started = time.perf_counter()
            await conn.run("true", check=True)
            return time.perf_counter() - started

        def in_thread(function: Callable[..., float], *args: Any) -> Callable[[], Awaitable[float]]:
            return lambda: asyncio.to_thread(function, *args)

        methods = [
            Method(
                "kubectl exec POD -- true",
                in_thread(timed_run, [*kube, "exec", "-n", ns, pod, "--", "true"]),
            ),
            Method(
                "WebSocket exec via apiserver (no kubectl)",
                in_thread(websocket_exec, cluster, ns, pod),
            ),
            Method(
                "ssh user@device true (new connection)",
                in_thread(timed_run, [*ssh_argv(device, "-o", "ControlMaster=no"), "true"]),
            ),
            Method(
                "ssh with ControlMaster (multiplexed)",
                in_thread(timed_run, [*ssh_argv(device, *mux), "true"]),
            ),
            Method("asyncssh channel on an open connection", channel),
            Method(
                "kubectl version --client (start-up only)",
                in_thread(timed_run, [kubectl, "version", "--client"]),
            ),
        ]
        try:
            for method in methods:
                for _ in range(WARMUP):
                    await method.call()
            for i in range(count):
                turn = methods[i % len(methods) :] + methods[: i % len(methods)]
                for method in turn:
                    method.seconds.append(await method.call())
        finally:
            conn.close()
    return methods


def report_exec(methods: list[Method], count: int, busy: float) -> None:
    print(f"\n## exec: {count} sequential calls of each, taking turns (ms)")
    reference = statistics.median(methods[3].seconds)
    rows: list[tuple[str, ...]] = [("", "p50", "p99", "mean", "p50 - ssh -M p50")]
    for method in methods:
        s = method.seconds
        rows.append(
            (
                method.label,
                ms(pct(s, 0.5)),
                ms(pct(s, 0.99)),
                ms(statistics.fmean(s)),
                f"{(statistics.median(s) - reference) * 1000:+.0f}",
            )
        )
    print_table(rows)
    print(f"(machine CPU busy meanwhile: {100 * busy:.0f} % of {os.cpu_count()} CPUs, anyone's)")


# -- log follow -----------------------------------------------------------------------------------


def follow(
    argv: list[str], count: int, parse: Callable[[bytes], float], limit: float
) -> list[float]:
    """Read `argv`'s output line by line: receipt time - the time the line says it was printed.
    The first two lines are left out (they may predate the stream)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0)
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    latencies: list[float] = []
    try:
        assert proc.stdout is not None
        seen = 0
        while len(latencies) < count:
            line = proc.stdout.readline()
            now = time.time()
            if not line:
                break
            seen += 1
            if seen > 2:
                latencies.append(now - parse(line))
    finally:
        timer.cancel()
        proc.terminate()
        proc.wait(10)
    return latencies


async def log_follow(
    cluster: Cluster,
    ns: str,
    pod: str,
    uid: str,
    device: TestDevice,
    count: int,
    interval: float,
    work: Path,
) -> dict[str, list[float]]:
    kube = [find_kubectl(), "--kubeconfig", str(cluster.kubeconfig)]
    path = pod_dir(device, uid) / "c" / "main" / "0.log"
    limit = 30 + count * interval * 3
    with ssh_master(device, work) as mux:
        kubectl_logs, ssh_tail = await asyncio.gather(
            asyncio.to_thread(
                follow,
                [*kube, "logs", "-f", "-n", ns, pod, "--tail=0"],
                count,
                lambda line: float(line),
                limit,
            ),
            asyncio.to_thread(
                follow,
                [*ssh_argv(device, *mux), f"exec tail -n 0 -F {path}"],
                count,
                lambda line: float(line.rsplit(b" ", 1)[-1]),  # CRI: <time> stdout F <line>
                limit,
            ),
        )
    return {"kubectl logs -f": kubectl_logs, "ssh: tail -F of the log file (floor)": ssh_tail}


def report_logs(results: dict[str, list[float]], interval: float, busy: float) -> None:
    print(f"\n## log follow: a line every {interval:g} s, receipt - printed time (ms)")
    rows: list[tuple[str, ...]] = [("", "lines", "p50", "p90", "p99", "max")]
    for label, values in results.items():
        rows.append(
            (
                label,
                str(len(values)),
                ms(pct(values, 0.5)),
                ms(pct(values, 0.9)),
                ms(pct(values, 0.99)),
                ms(max(values, default=float("nan"))),
            )
        )
    print_table(rows)
    print(f"(machine CPU busy meanwhile: {100 * busy:.0f} % of {os.cpu_count()} CPUs, anyone's)")


# -- images on a device ---------------------------------------------------------------------------

# Each way of starting creates a file first thing, then sleeps: the file's mtime (to the kernel's
# clock tick) is when the command started. Busybox's `date` has no %N.
IMAGE_SCRIPT = ": >/out/started; exec sleep 3600"
FLOOR_LABEL = "io.vkubelet.bench"


@dataclass
class StartRun:
    """Pods (or floor containers) started on one device at a steady rate: wall-clock times."""

    label: str
    sent: dict[str, float] = field(default_factory=dict)  # create request / `ssh` request
    written: dict[str, float] = field(default_factory=dict)  # the start script wrote pod.json
    supervised: dict[str, float] = field(default_factory=dict)  # supervisor.pid written
    invoked: dict[str, float] = field(default_factory=dict)  # the pod's container script ran
    started: dict[str, float] = field(default_factory=dict)  # the command's file appeared
    running: dict[str, float] = field(default_factory=dict)  # API Running / `run -d` returned
    elapsed: float = 0.0  # first request -> last command started
    agent_cpu_s: float = 0.0
    device_cpu_s: float = 0.0
    control_plane_cpu_s: float = 0.0
    machine_busy: float = 0.0

    def since_sent(self, marks: dict[str, float]) -> list[float]:
        return [marks[n] - self.sent[n] for n in self.sent if n in marks]

    def span(self, start: str, end: str) -> list[float]:
        """Per pod, the time from mark `start` to mark `end` (the names of the fields above;
        "pod.json" and "supervisor" for `written` and `supervised`)."""
        alias = {"pod.json": "written", "supervisor": "supervised"}
        first: dict[str, float] = getattr(self, alias.get(start, start))
        second: dict[str, float] = getattr(self, alias.get(end, end))
        return [second[n] - first[n] for n in first if n in second]


async def paced(
    names: list[str], rate: float, start: Callable[[str], Coroutine[Any, Any, None]]
) -> None:
    """`start` each name at `rate` per second, not waiting for one to finish before the next."""
    began = time.time()
    tasks: list[asyncio.Task[None]] = []
    for i, name in enumerate(names):
        delay = began + i / rate - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(name)))
    await asyncio.gather(*tasks)


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime_ns / 1e9
    except OSError:
        return None


def image_pod_body(name: str, node: str, image: str) -> dict[str, Any]:
    body = pod_body(name, node, "")
    body["spec"]["volumes"] = [{"name": "out", "emptyDir": {}}]
    body["spec"]["containers"] = [
        {
            "name": "main",
            "image": image,
            "imagePullPolicy": "IfNotPresent",  # a kubelet's default for a tagged image
            "command": ["sh", "-c", IMAGE_SCRIPT],
            "volumeMounts": [{"name": "out", "mountPath": "/out"}],
        }
    ]
    return body


async def pods_run(
    cluster: Cluster,
    client: httpx.AsyncClient,
    ns: str,
    watcher: Watcher,
    device: TestDevice,
    image: str | None,
    count: int,
    rate: float,
    agent_pid: int,
) -> StartRun:
    """`count` pods on `device` at `rate`: command pods (image None) or pods of `image`."""
    run = StartRun("command pods" if image is None else "image pods (podman)")
    prefix = f"{'c' if image is None else 'i'}{uuid.uuid4().hex[:4]}"
    names = [f"{prefix}-{i}" for i in range(count)]
    files: dict[str, Path] = {}  # the pod's directory on the device
    await asyncio.gather(*(client.get(f"/api/v1/namespaces/{ns}") for _ in range(8)))
    cpu_before = cpu_seconds(agent_pid), devices_cpu([device]), control_plane_cpu(cluster)
    machine_before = machine_cpu()

    async def create(name: str) -> None:
        if image is None:
            body = pod_body(name, device.name, ': >"$VKUBELET_POD_DIR/started"; exec sleep 3600')
        else:
            body = image_pod_body(name, device.name, image)
        run.sent[name] = time.time()
        response = await client.post(f"/api/v1/namespaces/{ns}/pods", json=body)
        response.raise_for_status()
        files[name] = pod_dir(device, response.json()["metadata"]["uid"])

    started = "started" if image is None else "volumes/out/started"
    marks = [
        (run.written, "pod.json"),
        (run.supervised, "supervisor.pid"),
        (run.invoked, "c/main/pid"),
        (run.started, started),
    ]

    def look() -> bool:
        for name, directory in files.items():
            for times, path in marks:
                if name not in times and (at := mtime(directory / path)) is not None:
                    times[name] = at
        return len(run.started) == count and all(n in watcher.running_at for n in names)

    await paced(names, rate, create)
    await wait_until(look, 300, f"{run.label} started")
    run.running = {n: watcher.running_at[n] for n in names}
    run.elapsed = max(run.started.values()) - min(run.sent.values())
    run.agent_cpu_s = cpu_seconds(agent_pid) - cpu_before[0]
    run.device_cpu_s = devices_cpu([device]) - cpu_before[1]
    run.control_plane_cpu_s = control_plane_cpu(cluster) - cpu_before[2]
    run.machine_busy = busy_since(machine_before)
    await delete_pods(client, ns, names, 1)
    await wait_until(lambda: all(n in watcher.deleted_at for n in names), 300, "pods deleted")
    return run


async def floor_run(
    cluster: Cluster, device: TestDevice, image: str, count: int, rate: float, work: Path
) -> StartRun:
    """The same image started with `podman run -d` over one open SSH connection (as the agent
    keeps one per device), each in its own channel, at `rate`: what the device's runtime costs
    without the agent, the API and the supervisor."""
    run = StartRun("podman run -d over SSH (floor)")
    tag = uuid.uuid4().hex[:6]
    out = work / f"floor-{tag}"
    runtime = " ".join(shlex.quote(str(word)) for word in PODMAN_SETTINGS["runtimeCommand"])
    run_args = " ".join(shlex.quote(str(word)) for word in PODMAN_SETTINGS["runtimeRunArgs"])
    names = [f"vkbench-{tag}-{i}" for i in range(count)]
    conn = await asyncssh.connect(
        device.address,
        device.port,
        username=device.user,
        client_keys=[str(device.key_path)],
        known_hosts=str(device.known_hosts),
        config=[],
    )
    cpu_before = devices_cpu([device]), control_plane_cpu(cluster)
    machine_before = machine_cpu()

    async def start(name: str) -> None:
        (out / name).mkdir(parents=True)
        command = (
            f"{runtime} run -d --rm --name {name} --label {FLOOR_LABEL}={tag} --network host "
            f"{run_args} --volume {shlex.quote(str(out / name))}:/out -- {shlex.quote(image)} "
            f"sh -c {shlex.quote(IMAGE_SCRIPT)}"
        )
        run.sent[name] = time.time()
        await conn.run(command, check=True)
        run.running[name] = time.time()

    try:
        await paced(names, rate, start)

        def look() -> bool:
            for name in names:
                if name not in run.started and (at := mtime(out / name / "started")) is not None:
                    run.started[name] = at
            return len(run.started) == count

        await wait_until(look, 300, "floor containers started")
        run.elapsed = max(run.started.values()) - min(run.sent.values())
        run.device_cpu_s = devices_cpu([device]) - cpu_before[0]
        run.control_plane_cpu_s = control_plane_cpu(cluster) - cpu_before[1]
        run.machine_busy = busy_since(machine_before)
    finally:
        await conn.run(
            f"{runtime} rm -f -t 0 $({runtime} ps -aq --filter label={FLOOR_LABEL}={tag})",
            check=False,
        )
        conn.close()
    return run


def report_images(runs: list[StartRun], rate: float) -> None:
    count = len(runs[0].sent)
    print(f"\n## images on one device: {count} pods at {rate:g} pods/s, each way in turn (ms)")
    rows: list[tuple[str, ...]] = [("", *(r.label for r in runs))]

    rows.append(("(p50 / p90 / p99 / max)", *("" for _ in runs)))
    rows.append(("bind -> command started", *(quantiles(r.since_sent(r.started)) for r in runs)))
    rows.append(
        (
            "bind -> API sees Running (floor: run -d returned)",
            *(quantiles(r.since_sent(r.running)) for r in runs),
        )
    )
    rows.append(
        (
            "bind -> container script (image: podman run invoked)",
            *(quantiles(r.since_sent(r.invoked)) if r.invoked else "-" for r in runs),
        )
    )
    rows.append(("first request -> last started", *(f"{r.elapsed:.1f} s" for r in runs)))
    rows.append(("where the pods' time goes (p50 / p99 of each step):", *("" for _ in runs)))
    steps = [
        ("sent", "pod.json", "bind -> start script wrote pod.json"),
        ("pod.json", "supervisor", "-> supervisor started"),
        ("supervisor", "invoked", "-> container script (image: after the pull check)"),
        ("invoked", "started", "-> command started (image: podman run)"),
    ]
    for start, end, what in steps:
        spans = [r.span(start, end) for r in runs]
        rows.append(
            (f"  {what}", *(f"{ms(pct(v, 0.5))} / {ms(pct(v, 0.99))}" if v else "-" for v in spans))
        )
    rows.append(
        (
            "CPU s for the run: agent / device / ctl plane",
            *(
                f"{r.agent_cpu_s:.1f} / {r.device_cpu_s:.1f} / {r.control_plane_cpu_s:.1f}"
                for r in runs
            ),
        )
    )
    rows.append(
        (
            f"machine CPU busy ({os.cpu_count()} CPUs, anyone's)",
            *(f"{100 * r.machine_busy:.0f} %" for r in runs),
        )
    )
    print_table(rows)


# -- main -----------------------------------------------------------------------------------------


def versions(cluster: Cluster) -> list[str]:
    kubectl = subprocess.run(
        [find_kubectl(), "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    client = json.loads(kubectl.stdout or "{}").get("clientVersion", {})
    ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False)
    return [
        f"devices: sshd ({ssh.stderr.split(',')[0].strip()}) in network namespaces on this "
        "machine, each its own user; inventory defaults (maxSessions 10); the agent keeps one "
        "SSH connection per device",
        f"kube-apiserver {cluster.kubernetes_version}, kubectl {client.get('gitVersion', '?')}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs shared by everything here",
    ]


async def start_pod(
    client: httpx.AsyncClient, ns: str, watcher: Watcher, name: str, node: str, script: str
) -> str:
    response = await client.post(f"/api/v1/namespaces/{ns}/pods", json=pod_body(name, node, script))
    response.raise_for_status()
    await wait_until(lambda: name in watcher.running_at, 120, f"{name} Running")
    return str(response.json()["metadata"]["uid"])


async def benchmark(
    cluster: Cluster,
    devices: list[TestDevice],
    podman_devices: list[TestDevice],
    address: str,
    work: Path,
    args: argparse.Namespace,
) -> None:
    client = http_client(cluster.kubeconfig, CONCURRENCY)
    agent = start_agent(cluster, work, devices, podman_devices, address, args.agent_log_level)
    assert agent.proc is not None
    ns = ""
    watch_task: asyncio.Task[None] | None = None
    everyone = devices + podman_devices
    try:
        log(f"Waiting for {len(everyone)} device nodes to be Ready ...")
        await nodes_ready(client, [d.name for d in everyone], 180)
        ns = await new_namespace(client, "bench-ssh")
        watcher = Watcher(client, ns)
        watch_task = asyncio.create_task(watcher.run())
        await watcher.ready.wait()
        await asyncio.sleep(2)  # the agent's first sweeps and node updates
        load = os.getloadavg()[0]
        runs = []
        for rate in args.rate:
            offered = "all at once" if rate <= 0 else f"{rate:g}/s"
            log(f"bind -> running: {args.pods} pods, {offered} ...")
            runs.append(
                await bind_run(
                    cluster, client, ns, watcher, devices, args.pods, rate, agent.proc.pid
                )
            )
        images: list[StartRun] = []
        if podman_devices:
            device, rate, count = podman_devices[0], args.image_rate, args.image_pods
            log(f"images: {count} pods at {rate:g}/s on one device, 3 ways ...")
            image = await asyncio.to_thread(podman_load, build_image("busybox", log).path)
            for way in (None, image):
                images.append(
                    await pods_run(
                        cluster, client, ns, watcher, device, way, count, rate, agent.proc.pid
                    )
                )
            images.append(await floor_run(cluster, device, image, count, rate, work))
        exec_device, log_device = devices[0], devices[-1]
        await start_pod(client, ns, watcher, "exec-target", exec_device.name, "exec sleep 3600")
        ticker = f"while :; do date +%s.%N; sleep {args.log_interval}; done"
        uid = await start_pod(client, ns, watcher, "ticker", log_device.name, ticker)
        methods: list[Method] = []
        exec_busy = logs_busy = 0.0
        if args.execs:
            log(f"exec: {args.execs} x 6 methods ...")
            before = machine_cpu()
            methods = await exec_overhead(cluster, ns, "exec-target", exec_device, args.execs, work)
            exec_busy = busy_since(before)
        logs: dict[str, list[float]] = {}
        if args.log_lines:
            log(f"log follow: {args.log_lines} lines ...")
            before = machine_cpu()
            logs = await log_follow(
                cluster, ns, "ticker", uid, log_device, args.log_lines, args.log_interval, work
            )
            logs_busy = busy_since(before)

        more = f" (+{len(podman_devices)} as root with podman)" if podman_devices else ""
        agent_is = "one agent (`vkubelet run --provider ssh`)"
        print(f"# SSH devices: {len(devices)} devices{more}, {agent_is}")
        for line in await asyncio.to_thread(versions, cluster):
            print(f"- {line}")
        print(f"- 1-minute load average before measuring: {load:.2f}")
        if runs:
            report_bind(runs, len(devices))
        if images:
            report_images(images, args.image_rate)
        if methods:
            report_exec(methods, args.execs, exec_busy)
        if logs:
            report_logs(logs, args.log_interval, logs_busy)
    except BaseException:
        log("--- agent log (last 30 lines):\n" + "\n".join(agent.log().splitlines()[-30:]))
        raise
    finally:
        await cleanup(client, ns, agent, everyone, watch_task)


async def cleanup(
    client: httpx.AsyncClient,
    ns: str,
    agent: AgentProcess,
    devices: list[TestDevice],
    watch_task: asyncio.Task[None] | None,
) -> None:
    """Pods (stopped on their devices while the agent runs), the agent, its nodes, the namespace."""
    log("Cleaning up ...")
    if watch_task is not None:
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch_task
    if ns:
        with contextlib.suppress(Exception):
            path = f"/api/v1/namespaces/{ns}/pods"
            names = [p["metadata"]["name"] for p in (await client.get(path)).json()["items"]]
            if agent.running:
                await delete_pods(client, ns, names, 1)
                for _ in range(60):  # stopped on their devices, then gone from the API
                    if not (await client.get(path)).json()["items"]:
                        break
                    await asyncio.sleep(0.5)
            left = [p["metadata"]["name"] for p in (await client.get(path)).json()["items"]]
            await delete_pods(client, ns, left, 0)
    await asyncio.to_thread(agent.stop)
    for device in devices:
        with contextlib.suppress(Exception):
            await client.delete(f"/api/v1/nodes/{device.name}")
    if ns:
        with contextlib.suppress(Exception):
            await client.delete(f"/api/v1/namespaces/{ns}")
    await client.aclose()


@contextlib.contextmanager
def work_directory(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="vkubelet-bench-ssh-") as tmp:
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--pods", type=int, default=100, help="pods per bind run")
    parser.add_argument("--devices", type=int, default=10, help="SSH devices (nodes)")
    parser.add_argument(
        "--rate",
        type=float,
        nargs="*",
        default=[0.0, 10.0],
        help="bind runs: pods/s offered, 0 = all at once (default: both 0 and 10)",
    )
    parser.add_argument("--execs", type=int, default=50, help="exec calls per method (0: skip)")
    parser.add_argument("--log-lines", type=int, default=50, help="log lines to time (0: skip)")
    parser.add_argument("--log-interval", type=float, default=0.15, help="seconds between lines")
    parser.add_argument(
        "--image-pods", type=int, default=50, help="pods per way on the podman device (0: skip)"
    )
    parser.add_argument("--image-rate", type=float, default=10.0, help="their pods/s")
    parser.add_argument("--cluster", help="reuse a running `vkubelet dev cluster`")
    parser.add_argument("--logs", type=Path, help="keep the agent's and sshd's logs here")
    parser.add_argument("--agent-log-level", default="info")
    args = parser.parse_args()
    reason = ssh_lab_unavailable() or (podman_unavailable() if args.image_pods else None)
    if reason:
        raise SystemExit(reason)
    if args.image_pods and args.image_rate <= 0:
        raise SystemExit("--image-rate must be above 0 pods/s")
    # A plain `kill` must still clean up: the lab's users, namespaces and sshd's, the cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster, owned = cluster_for(args.cluster, "bench-ssh")
    try:
        with (
            work_directory(args.logs) as work,
            local_test_address() as address,
            ssh_lab(args.devices, work / "lab") as devices,
            contextlib.ExitStack() as stack,
        ):
            podman_devices = []
            if args.image_pods:
                lab = work / "podman-lab"
                podman_devices = stack.enter_context(ssh_lab(1, lab, root=True, containers=True))
            asyncio.run(benchmark(cluster, devices, podman_devices, address, work, args))
    finally:
        if owned:
            cluster.down()


if __name__ == "__main__":
    main()
