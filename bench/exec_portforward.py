"""Benchmark: kubectl exec latency and port-forward throughput, vkubelet against the Go reference.

    .venv/bin/python bench/exec_portforward.py [--execs 200] [--connections 4] [--mib 64]
                                               [--rounds 3] [--cluster NAME] [--logs DIR]

Two virtual nodes on one local control plane (`vkubelet dev cluster`), each with one pod:
- vkubelet's agent (`vkubelet run`, mock provider), and
- virtual-kubelet (the Go reference, github.com/virtual-kubelet/virtual-kubelet) built from its Go
  module with `node/nodeutil` and a minimal provider of our own (bench/govk/main.go). VK's own
  mock provider makes exec and port-forward no-ops, which would measure nothing: ours runs the
  command with os/exec and dials 127.0.0.1:<port> for port-forward, like vkubelet's mock does.

For each node it measures, through the real kubectl and kube-apiserver:
- exec round trip: wall time of `kubectl exec POD -- true`, N times one after the other
  (alternating between the nodes so that drift hits both alike): p50, p99, mean;
- port-forward throughput: a `kubectl port-forward` to a TCP server in this process,
  C concurrent connections each moving M MiB up (client -> pod) and then down: MB/s, the
  median of R rounds (the nodes take turns);
- the node process's CPU time for that work.

The Go binary is built once (needs `go` on PATH or in /usr/local/go/bin; GOTOOLCHAIN=local,
modules from the Go module proxy) into the vkubelet cache, keyed by bench/govk's files. Both
nodes share the machine's cores with the control plane and kubectl, so run it on a quiet
machine: the load average before measuring is printed with the figures. The script
starts a dev cluster unless `--cluster` names a running one, and removes everything it created.
It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import socketserver
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from _common import cluster_for, cpu_seconds, log, pct, print_table

from vkubelet.devcluster import Cluster, _pki
from vkubelet.devcluster._build import cache_root
from vkubelet.testing import AgentProcess, Kubectl, node_ready, port_forward

GOVK_DIR = Path(__file__).resolve().parent / "govk"
CHUNK = os.urandom(1 << 20)
WARMUP_EXECS = 3


# -- the Go reference binary ----------------------------------------------------------------------


def find_go() -> str:
    for candidate in (shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("the Go toolchain ('go') is needed to build the reference node")


def build_govk() -> Path:
    """Build bench/govk once; the cache key covers everything that goes into the binary."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((GOVK_DIR / name).read_bytes())
    directory = cache_root() / "bench" / f"govk-{digest.hexdigest()[:12]}"
    binary = directory / "govk"
    if binary.is_file():
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    with (directory.parent / "build.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.is_file():  # another run built it while we waited
            return binary
        log(f"Building the Go reference node (bench/govk) into {directory} (first time only)")
        env = os.environ | {"GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly"}
        partial = directory / "govk.partial"
        result = subprocess.run(
            [find_go(), "build", "-trimpath", "-o", str(partial), "."],
            cwd=GOVK_DIR,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"building bench/govk failed:\n{result.stderr[-4000:]}")
        partial.replace(binary)
    return binary


# -- processes and nodes --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], Any], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def kubelet_port(kubectl: Kubectl, node: str) -> int:
    result = kubectl("get", "node", node, "-o", "json", check=False)
    if result.returncode != 0:
        return 0
    status = json.loads(result.stdout)["status"]
    return int(status.get("daemonEndpoints", {}).get("kubeletEndpoint", {}).get("Port", 0))


@dataclass
class NodeUnderTest:
    label: str
    node: str
    pid: int
    log_path: Path
    stop: Callable[[], None]
    pod: str = ""

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_vkubelet(cluster: Cluster, work: Path) -> NodeUnderTest:
    name = f"bench-vk-{uuid.uuid4().hex[:6]}"
    config = work / "mock.json"
    config.write_text(json.dumps({name: {"pods": "110"}}))
    agent = AgentProcess(
        cluster.kubeconfig,
        [
            "--provider",
            "mock",
            "--provider-config",
            str(config),
            "--nodename",
            name,
            "--internal-ip",
            "127.0.0.1",
            "--kubelet-port",
            "0",
            "--approve-own-csrs",
            "--cert-dir",
            str(work / "vk-pki"),
            "--log-level",
            "warning",
        ],
        work / "vkubelet.log",
    ).start()
    assert agent.proc is not None
    return NodeUnderTest("vkubelet", name, agent.proc.pid, agent.log_path, agent.stop)


def start_govk(
    cluster: Cluster,
    binary: Path,
    work: Path,
    extra: Sequence[str] = (),
    label: str = "virtual-kubelet (Go)",
) -> NodeUnderTest:
    """The Go node; `extra` flags set its throttles (bench/agent_vs_govk.py)."""
    name = f"bench-go-{uuid.uuid4().hex[:6]}"
    ca = _pki.load(cluster.pki / "ca.crt", cluster.pki / "ca.key")
    serving = _pki.issue(
        ca,
        f"system:node:{name}",
        organizations=("system:nodes",),
        server=True,
        ip_addresses=("127.0.0.1",),
    )
    cert, key = serving.write(work, "govk-serving")
    log_path = work / "govk.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                "-kubeconfig",
                str(cluster.kubeconfig),
                "-nodename",
                name,
                "-address",
                "127.0.0.1",
                "-port",
                str(free_port()),
                "-tls-cert-file",
                str(cert),
                "-tls-private-key-file",
                str(key),
                "-client-ca-file",
                str(cluster.pki / "ca.crt"),
                "-log-level",
                "warn",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    return NodeUnderTest(label, name, proc.pid, log_path, stop)


def start_pod(kubectl: Kubectl, target: NodeUnderTest) -> None:
    target.pod = f"{target.node}-pod"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": target.pod, "namespace": "default"},
            "spec": {
                "nodeName": target.node,
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "main", "image": "bench/app:1"}],
            },
        }
    )


def pod_running(kubectl: Kubectl, pod: str) -> bool:
    return bool(kubectl.json("get", "pod", pod)["status"].get("phase") == "Running")


# -- exec -----------------------------------------------------------------------------------------


@dataclass
class ExecFigures:
    seconds: list[float] = field(default_factory=list)
    failures: int = 0
    first_error: str = ""
    cpu_s: float = 0.0


def exec_once(kubectl: Kubectl, pod: str, figures: ExecFigures | None) -> None:
    argv = [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "exec", pod, "--", "true"]
    started = time.perf_counter()
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        error = result.stderr.strip() if result.returncode != 0 else ""
    except subprocess.TimeoutExpired:
        error = "timed out after 60 s"
    elapsed = time.perf_counter() - started
    if figures is None:
        return
    if error:
        figures.failures += 1
        figures.first_error = figures.first_error or error
    else:
        figures.seconds.append(elapsed)


def exec_round_trips(
    kubectl: Kubectl, targets: list[NodeUnderTest], count: int
) -> dict[str, ExecFigures]:
    figures = {t.label: ExecFigures() for t in targets}
    for target in targets:
        for _ in range(WARMUP_EXECS):
            exec_once(kubectl, target.pod, None)
    cpu_before = {t.label: cpu_seconds(t.pid) for t in targets}
    for i in range(count):
        for target in targets if i % 2 == 0 else reversed(targets):
            exec_once(kubectl, target.pod, figures[target.label])
    for target in targets:
        figures[target.label].cpu_s = cpu_seconds(target.pid) - cpu_before[target.label]
    return figures


# -- port-forward ---------------------------------------------------------------------------------


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def drain(conn: socket.socket, size: int) -> None:
    buffer = bytearray(1 << 20)
    left = size
    while left:
        got = conn.recv_into(buffer, min(left, len(buffer)))
        if not got:
            raise ConnectionError(f"connection closed with {left} of {size} bytes to go")
        left -= got


def send_bytes(conn: socket.socket, size: int) -> None:
    view = memoryview(CHUNK)
    left = size
    while left:
        part = view[: min(left, len(view))]
        conn.sendall(part)
        left -= len(part)


class TransferServer(socketserver.ThreadingTCPServer):
    """What the pods' forwarded port reaches: a 9-byte request `U<size>` (receive `size` bytes,
    then answer b"k") or `D<size>` (send `size` bytes). No reliance on half-close semantics."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), TransferHandler)


class TransferHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.settimeout(300)
        with contextlib.suppress(OSError):
            header = recv_exact(conn, 9)
            size = int.from_bytes(header[1:], "big")
            if header[:1] == b"U":
                drain(conn, size)
                conn.sendall(b"k")
            elif header[:1] == b"D":
                send_bytes(conn, size)


def transfer(port: int, direction: bytes, size: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=300) as conn:
        conn.sendall(direction + size.to_bytes(8, "big"))
        if direction == b"U":
            send_bytes(conn, size)
            if recv_exact(conn, 1) != b"k":
                raise ConnectionError("bad acknowledgement")
        else:
            drain(conn, size)


def concurrently(port: int, direction: bytes, connections: int, size: int) -> float:
    """Seconds for `connections` parallel transfers of `size` bytes each; raises the first error."""
    errors: list[BaseException] = []

    def one() -> None:
        try:
            transfer(port, direction, size)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(connections)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(360)
    elapsed = time.perf_counter() - started
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a forwarded connection did not finish in 6 minutes")
    if errors:
        raise errors[0]
    return elapsed


@dataclass
class ForwardFigures:
    up_mb_s: list[float] = field(default_factory=list)
    down_mb_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    moved: int = 0
    error: str = ""


def forward_round(
    kubectl: Kubectl,
    target: NodeUnderTest,
    server_port: int,
    connections: int,
    size: int,
    figures: ForwardFigures,
) -> None:
    """One `kubectl port-forward`: a small warm-up, then `connections` x `size` up, then down."""
    if figures.error:
        return
    try:
        with port_forward(kubectl, target.pod, server_port) as local:
            concurrently(local, b"U", connections, 1 << 20)
            concurrently(local, b"D", connections, 1 << 20)
            cpu_before = cpu_seconds(target.pid)
            total = connections * size
            figures.up_mb_s.append(total / concurrently(local, b"U", connections, size) / 1e6)
            figures.down_mb_s.append(total / concurrently(local, b"D", connections, size) / 1e6)
            figures.cpu_s += cpu_seconds(target.pid) - cpu_before
            figures.moved += 2 * total
    except Exception as exc:
        figures.error = f"{type(exc).__name__}: {exc}"


# -- report ---------------------------------------------------------------------------------------


def versions(kubectl: Kubectl, cluster: Cluster, govk: Path) -> list[str]:
    client = json.loads(kubectl("version", "--client", "-o", "json").stdout)["clientVersion"]
    go_line = subprocess.run(
        [str(govk), "-version"], capture_output=True, text=True, check=False
    ).stdout.split()
    vk_version, go_version = [*go_line, "?", "?"][:2]
    return [
        f"vkubelet {importlib.metadata.version('vkubelet')} (Python {platform.python_version()}), "
        "mock provider: `true` is a built-in (no process), port-forward dials 127.0.0.1",
        f"{vk_version} via node/nodeutil, built with {go_version}; provider bench/govk/main.go: "
        "exec runs the command with os/exec (a real fork+exec of `true`), port-forward dials "
        "127.0.0.1. (VK's own mock provider makes exec and port-forward no-ops: nothing to time.)",
        f"kube-apiserver {cluster.kubernetes_version}, kubectl {client['gitVersion']}, "
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
    ]


def report(
    targets: list[NodeUnderTest],
    execs: dict[str, ExecFigures],
    forwards: dict[str, ForwardFigures],
    count: int,
    connections: int,
    mib: int,
    rounds: int,
) -> None:
    rows: list[tuple[str, ...]] = [("", *(t.label for t in targets))]

    def row(name: str, value: Callable[[NodeUnderTest], str]) -> None:
        rows.append((name, *(value(t) for t in targets)))

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f} ms"

    row("exec -- true p50", lambda t: ms(pct(execs[t.label].seconds, 0.50)))
    row("exec -- true p99", lambda t: ms(pct(execs[t.label].seconds, 0.99)))
    row(
        "exec -- true mean",
        lambda t: ms(statistics.fmean(execs[t.label].seconds)) if execs[t.label].seconds else "-",
    )
    row("exec failures", lambda t: f"{execs[t.label].failures}/{count}")
    row("node CPU per exec", lambda t: ms(execs[t.label].cpu_s / count))

    def mb_s(values: Callable[[ForwardFigures], list[float]]) -> Callable[[NodeUnderTest], str]:
        def cell(t: NodeUnderTest) -> str:
            got = values(forwards[t.label])
            if forwards[t.label].error or not got:
                return "failed"
            return f"{statistics.median(got):.0f} ({min(got):.0f}-{max(got):.0f})"

        return cell

    row("port-forward up MB/s", mb_s(lambda f: f.up_mb_s))
    row("port-forward down MB/s", mb_s(lambda f: f.down_mb_s))
    row(
        "node CPU per GiB forwarded",
        lambda t: (
            f"{forwards[t.label].cpu_s / (forwards[t.label].moved / 2**30):.2f} s"
            if forwards[t.label].moved
            else "-"
        ),
    )
    print()
    print_table(rows)
    print(
        f"\nexec: {count} sequential calls per node (p99 = nearest rank). port-forward: "
        f"{connections} concurrent connections x {mib} MiB each way, MB/s = 10^6 B/s, "
        f"median (min-max) of {rounds} rounds."
    )
    for target in targets:
        if execs[target.label].first_error:
            print(f"\n{target.label} exec error: {execs[target.label].first_error}")
        if forwards[target.label].error:
            print(f"\n{target.label} port-forward error: {forwards[target.label].error}")


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--execs", type=int, default=200, help="kubectl exec calls per node")
    parser.add_argument("--connections", type=int, default=4, help="concurrent connections")
    parser.add_argument("--mib", type=int, default=64, help="MiB per connection and direction")
    parser.add_argument("--rounds", type=int, default=3, help="port-forward rounds per node")
    parser.add_argument("--cluster", help="reuse a running `vkubelet dev cluster`")
    parser.add_argument("--logs", type=Path, help="keep the nodes' logs and certificates here")
    args = parser.parse_args()

    govk = build_govk()
    cluster, owned = cluster_for(args.cluster, "bench-ef")
    try:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            run(cluster, govk, args.logs, args)
        else:
            with tempfile.TemporaryDirectory(prefix="vkubelet-bench-") as tmp:
                run(cluster, govk, Path(tmp), args)
    finally:
        if owned:
            cluster.down()


def run(cluster: Cluster, govk: Path, work: Path, args: argparse.Namespace) -> None:
    kubectl = Kubectl(cluster.kubeconfig)
    targets: list[NodeUnderTest] = []
    server = TransferServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        try:
            targets.append(start_vkubelet(cluster, work))
            targets.append(start_govk(cluster, govk, work))
            for target in targets:
                wait_until(partial(node_ready, kubectl, target.node), f"{target.node} Ready")
                wait_until(partial(kubelet_port, kubectl, target.node), "its kubelet port")
                start_pod(kubectl, target)
            for target in targets:
                wait_until(partial(pod_running, kubectl, target.pod), f"{target.pod} Running")
        except TimeoutError:
            for target in targets:
                log(f"--- {target.label} log:\n{target.log_tail()}")
            raise
        load = os.getloadavg()[0]
        log(f"Timing {args.execs} x `kubectl exec -- true` on each node ...")
        execs = exec_round_trips(kubectl, targets, args.execs)
        forwards = {t.label: ForwardFigures() for t in targets}
        for round_ in range(1, args.rounds + 1):
            for target in targets:
                log(
                    f"Port-forward round {round_}/{args.rounds} to {target.label}: "
                    f"{args.connections} x {args.mib} MiB up, then down ..."
                )
                forward_round(
                    kubectl,
                    target,
                    server.server_address[1],
                    args.connections,
                    args.mib << 20,
                    forwards[target.label],
                )
        print("# kubectl exec and port-forward: vkubelet vs the Go reference virtual-kubelet")
        for line in versions(kubectl, cluster, govk):
            print(f"- {line}")
        print(f"- 1-minute load average before measuring: {load:.2f}")
        report(targets, execs, forwards, args.execs, args.connections, args.mib, args.rounds)
        for target in targets:
            if execs[target.label].failures or forwards[target.label].error:
                log(f"--- {target.label} log:\n{target.log_tail()}")
    finally:
        server.shutdown()
        server.server_close()
        cleanup(kubectl, targets)


def cleanup(kubectl: Kubectl, targets: list[NodeUnderTest]) -> None:
    for target in targets:
        if target.pod:
            kubectl("delete", "pod", target.pod, "--force", "--grace-period=0", check=False)
        target.stop()
        kubectl("delete", "node", target.node, "--ignore-not-found", "--wait=false", check=False)


if __name__ == "__main__":
    main()
