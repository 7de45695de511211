"""Benchmark: the VM provider (each pod a QEMU VM, TCG), driven as a user would. Prints figures.

    .venv/bin/python bench/vm_provider.py [--vms 20] [--wave 5] [--cluster NAME] [--image-mb 200]
        [--distro]

With the agent (`vkubelet run --provider vm --provider-config ...`) as a child process on a dev
cluster and the small test guest (`vkubelet dev vm-image`) served by a local HTTP server
(`python -m http.server` on 127.0.0.1), it measures:
- pod created (the API's answer) -> pod Running seen by a watch (the provider reports Running once
  the guest agent answers), p50/p99. Pods are created in waves of `--wave` at once, each wave
  deleted (and gone) before the next, so that at most `--wave` guests boot on the 2 shared cores.
  Cold: the first wave, with an empty image store (the image is downloaded once for the wave);
  warm: all `--vms` pods afterwards, the image in the store;
- host memory per VM: QEMU's RSS, its RSS outside the guest RAM mapping (the real overhead: the
  guest's RAM is counted only as far as the guest touched it), RSS minus the configured guest RAM,
  and the agent's RSS growth per running VM;
- `kubectl exec POD -- true` vs the guest-agent call the provider makes for it (`guest-exec` +
  `guest-exec-status` on QEMU's qga socket, from Python): the small guest has no sshd. QEMU serves
  the qga socket to one client, the agent's, so the direct calls are made after the agent is
  stopped (the VMs outlive it). With `--distro`, also `kubectl exec` vs `ssh` (new connections,
  and over a ControlMaster) into one distribution guest (`vkubelet dev vm-image --distro`,
  Debian with sshd; it boots in about a minute here);
- image pull of an `--image-mb` file from the local HTTP server: the provider's ImageStore (which
  also hashes and fsyncs) vs `curl -o`, taking turns.

It is a benchmark, not a test: it asserts nothing and only prints. It needs root and QEMU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2 as httpx
from _common import (
    http_client,
    log,
    new_namespace,
    pct,
    print_table,
    run_vm_bench,
    watch_pods,
)

from vkubelet.devcluster import Cluster
from vkubelet.providers.vm._net import PodNetwork
from vkubelet.providers.vm._qga import GuestAgent
from vkubelet.providers.vm._store import ImageStore
from vkubelet.providers.vm._translate import ImageSource
from vkubelet.testing import AgentProcess, local_test_address, start_agent

GUEST_MEMORY_MIB = 256
BOOT_LIMIT = 600.0


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def qemu_memory(pid: int) -> tuple[int, int, int]:
    """(total RSS, RSS of the guest RAM, RSS of TCG's code buffer) in KiB. The guest RAM is the
    anonymous read-write mapping exactly the guest's memory in size; TCG's translation buffer is
    the anonymous rwx mapping (1 GiB by default, filled as guest code is translated)."""
    total = guest = code = 0
    size = 0
    perms = ""
    anonymous = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):
            perms, anonymous = head[1], len(head) < 6
            continue
        if head[0] == "Size:":
            size = int(head[1])
        elif head[0] == "Rss:":
            rss = int(head[1])
            total += rss
            if anonymous and perms == "rw-p" and size == GUEST_MEMORY_MIB * 1024:
                guest += rss
            elif anonymous and perms == "rwxp":
                code += rss
    return total, guest, code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def http_server(directory: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    proc = subprocess.Popen(
        [*argv, "--directory", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


def pod_body(
    name: str, node: str, image: str = "tiny", memory: int = GUEST_MEMORY_MIB, ssh_key: str = ""
) -> dict[str, Any]:
    annotations = {"vm.vkubelet.io/ssh-keys": ssh_key} if ssh_key else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "vm"}, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 30,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "vm",
                    "image": f"vm.vkubelet.io/{image}",
                    "resources": {"limits": {"cpu": "1", "memory": f"{memory}Mi"}},
                }
            ],
        },
    }


class Watcher:
    """Records when each pod of the namespace was first seen Running, and when it was deleted."""

    def __init__(self, client: httpx.AsyncClient, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.running_at: dict[str, float] = {}
        self.deleted: set[str] = set()
        self.failed: dict[str, str] = {}
        self.uids: dict[str, str] = {}

    async def run(self) -> None:
        await watch_pods(self.client, self.namespace, self._seen)

    def _seen(self, kind: str, pod: dict[str, Any], now: float) -> None:
        name = pod["metadata"]["name"]
        self.uids[name] = pod["metadata"]["uid"]
        if kind == "DELETED":
            self.deleted.add(name)
        elif pod.get("status", {}).get("phase") == "Running":
            self.running_at.setdefault(name, now)
        elif pod.get("status", {}).get("phase") == "Failed":
            self.failed[name] = json.dumps(pod["status"])[:300]


async def wait(check: Any, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


class Bench:
    def __init__(
        self, client: httpx.AsyncClient, ns: str, node: str, agent: AgentProcess, state: Path
    ) -> None:
        self.client = client
        self.ns = ns
        self.node = node
        self.agent = agent
        self.state = state
        self.watcher = Watcher(client, ns)
        self.memory: list[tuple[int, int, int]] = []  # per VM: qemu_memory()
        self.phases: list[tuple[float, float, float, float]] = []  # see phases()
        self.agent_growth: list[float] = []  # KiB per running VM, per wave
        self.loads: list[str] = []

    def qemu_pids(self) -> list[int]:
        return [int(p.read_text().split()[0]) for p in self.state.glob("vms/*/m/pid")]

    async def wave(self, names: list[str], keep: bool = False) -> list[float]:
        """Create the pods at once; return created -> Running for each; delete them after."""
        assert self.agent.proc is not None
        agent_before = rss_kib(self.agent.proc.pid)
        created: dict[str, float] = {}
        created_wall: dict[str, float] = {}

        async def create(name: str) -> None:
            response = await self.client.post(
                f"/api/v1/namespaces/{self.ns}/pods", json=pod_body(name, self.node)
            )
            response.raise_for_status()
            created[name] = time.monotonic()
            created_wall[name] = time.time()

        await asyncio.gather(*(create(n) for n in names))
        self.loads.append(load())

        def all_running() -> bool:
            bad = [n for n in names if n in self.watcher.failed]
            if bad:
                raise RuntimeError(f"pod {bad[0]} failed: {self.watcher.failed[bad[0]]}")
            return all(n in self.watcher.running_at for n in names)

        await wait(all_running, BOOT_LIMIT, f"{len(names)} VMs Running")
        await asyncio.sleep(1)  # the agent's own bookkeeping of the last start settles
        agent_after = rss_kib(self.agent.proc.pid)
        self.agent_growth.append((agent_after - agent_before) / len(names))
        for pid in self.qemu_pids():
            with contextlib.suppress(OSError):
                self.memory.append(qemu_memory(pid))
        for name in names:
            running = self.watcher.running_at[name] - created[name]
            found = self.phases_of(self.watcher.uids[name], created_wall[name], running)
            if found is not None:
                self.phases.append(found)
        if not keep:
            await self.delete(names)
        return [self.watcher.running_at[n] - created[n] for n in names]

    def phases_of(
        self, uid: str, created: float, running: float
    ) -> tuple[float, float, float, float] | None:
        """Seconds from the create to QEMU daemonized (its pid file written), to the guest's
        "booted" console line as the agent logged it, to Running seen; and the guest's own
        uptime in that line (kernel start -> /init done)."""
        try:
            qemu = (self.state / "vms" / uid / "m" / "pid").stat().st_mtime - created
        except OSError:
            return None
        for path in (self.state / "logs").glob(f"**/{uid}/**/*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if "vkubelet-guest: booted" in line and "uptime=" in line:
                    stamp = datetime.fromisoformat(line.split()[0]).timestamp()
                    uptime = float(line.rsplit("uptime=", 1)[1].split()[0])
                    return qemu, stamp - created, running, uptime
        return None

    async def delete(self, names: list[str]) -> None:
        await asyncio.gather(
            *(self.client.delete(f"/api/v1/namespaces/{self.ns}/pods/{n}") for n in names)
        )
        await wait(lambda: all(n in self.watcher.deleted for n in names), 120, "VMs gone")
        await wait(lambda: not self.qemu_pids(), 60, "QEMU processes gone")


def timed(argv: list[str]) -> float:
    start = time.monotonic()
    result = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {result.returncode}: {result.stderr!r}")
    return elapsed


async def direct_exec(socket_path: Path, count: int) -> list[float]:
    agent = GuestAgent(socket_path)
    times = []
    try:
        await agent.exec(["true"], timeout=30)  # connect and sync first, as the provider has
        for _ in range(count):
            start = time.monotonic()
            await agent.exec(["true"], timeout=30)
            times.append(time.monotonic() - start)
    finally:
        await agent.close()
    return times


async def pull_throughput(work: Path, url: str, size: int, rounds: int) -> dict[str, list[float]]:
    """MB/s per round for the ImageStore (a fresh store each round) and `curl -o`."""
    results: dict[str, list[float]] = {"store": [], "curl": []}
    for i in range(rounds):
        store_root = work / f"store-{i}"
        store = ImageStore(store_root)
        start = time.monotonic()
        await store.pull(ImageSource(name=f"big-{i}", url=url))
        results["store"].append(size / 1e6 / (time.monotonic() - start))
        await store.aclose()
        shutil.rmtree(store_root)
        out = work / "curl.out"
        elapsed = await asyncio.to_thread(timed, ["curl", "-sS", "-o", str(out), url])
        results["curl"].append(size / 1e6 / elapsed)
        out.unlink()
    return results


async def distro_exec_vs_ssh(
    bench: Bench, kubectl: list[str], work: Path, count: int
) -> dict[str, list[float]]:
    """One distribution guest (Debian, sshd, cloud-init puts our key in `debian`'s
    authorized_keys): `kubectl exec` vs a new `ssh` vs `ssh` over a ControlMaster, taking turns."""
    key = work / "id_ed25519"
    await asyncio.to_thread(
        subprocess.run,
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
        check=True,
    )
    body = pod_body(
        "distro", bench.node, "distro", 512, key.with_suffix(".pub").read_text().strip()
    )
    response = await bench.client.post(f"/api/v1/namespaces/{bench.ns}/pods", json=body)
    response.raise_for_status()
    start = time.monotonic()
    await wait(lambda: "distro" in bench.watcher.running_at, BOOT_LIMIT, "the distro guest")
    log(f"distro guest Running after {time.monotonic() - start:.0f} s")
    pod = (await bench.client.get(f"/api/v1/namespaces/{bench.ns}/pods/distro")).json()
    ssh = ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"]
    ssh += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    target = f"debian@{pod['status']['podIP']}"
    deadline = time.monotonic() + 300
    while True:  # cloud-init finishes (and sshd starts) after the guest agent
        probe = await asyncio.to_thread(
            subprocess.run, [*ssh, "-o", "ConnectTimeout=10", target, "true"], capture_output=True
        )
        if probe.returncode == 0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"ssh into the distro guest: {probe.stderr!r}")
        await asyncio.sleep(2)
    log(f"distro guest answers ssh after {time.monotonic() - start:.0f} s")
    control = work / "mux"
    master = await asyncio.create_subprocess_exec(
        *ssh,
        "-o",
        "ControlMaster=yes",
        "-o",
        f"ControlPath={control}",
        "-N",
        target,
        stdin=subprocess.DEVNULL,
    )
    mux = [*ssh, "-o", "ControlMaster=no", "-o", f"ControlPath={control}", target, "true"]
    try:
        await wait(control.exists, 30, "the ssh ControlMaster")
        results: dict[str, list[float]] = {"exec": [], "ssh": [], "mux": []}
        for _ in range(count):
            exec_argv = [*kubectl, "-n", bench.ns, "exec", "distro", "--", "true"]
            results["exec"].append(await asyncio.to_thread(timed, exec_argv))
            results["ssh"].append(await asyncio.to_thread(timed, [*ssh, target, "true"]))
            results["mux"].append(await asyncio.to_thread(timed, mux))
        return results
    finally:
        master.terminate()
        await master.wait()


def quantiles(values: list[float]) -> str:
    return f"{ms(pct(values, 0.5))} / {ms(pct(values, 0.99))} (n={len(values)})"


async def benchmark(args: argparse.Namespace, cluster: Cluster, work: Path) -> None:
    built = await asyncio.to_thread(
        subprocess.run,
        [str(Path(sys.executable).parent / "vkubelet"), "dev", "vm-image"],
        capture_output=True,
        text=True,
        check=True,
    )
    image = built.stdout.split()[-1]
    distro = Path(image)  # unused unless --distro
    if args.distro:
        built = await asyncio.to_thread(
            subprocess.run,
            [str(Path(sys.executable).parent / "vkubelet"), "dev", "vm-image", "--distro"],
            capture_output=True,
            text=True,
            check=True,
        )
        distro = Path(built.stdout.split()[-1])
    served = work / "served"
    served.mkdir()
    shutil.copy(image, served / "tiny.qcow2")
    big = served / "big.img"
    with big.open("wb") as f:
        for _ in range(args.image_mb):
            f.write(os.urandom(1 << 20))
    size = big.stat().st_size
    kubectl = str(Path(sys.executable).parent / "kubectl")
    env_kubeconfig = ["--kubeconfig", str(cluster.kubeconfig)]

    with http_server(served) as base, local_test_address() as address:
        cidr = f"10.213.{random.randrange(1, 250)}.0/24"  # noqa: S311
        config = work / "vm.yaml"
        config.write_text(
            json.dumps(
                {
                    "stateDir": "state",
                    "accel": "tcg",
                    "podCIDR": cidr,
                    "reserved": {"memory": "1Gi"},
                    "translations": [
                        {"name": "tiny", "url": f"{base}/tiny.qcow2"},
                        {"name": "distro", "url": distro.as_uri()},
                    ],
                }
            )
        )
        node = f"hv-bench-{uuid.uuid4().hex[:4]}"
        agent = start_agent(cluster, work, provider="vm", config=config, name=node, address=address)
        client = http_client(cluster.kubeconfig, 8)
        state = work / "state"
        try:
            await wait_ready(client, node)
            assert agent.proc is not None
            agent_idle = rss_kib(agent.proc.pid)
            ns = await new_namespace(client, "vmbench")
            bench = Bench(client, ns, node, agent, state)
            watch = asyncio.create_task(bench.watcher.run())
            await asyncio.sleep(0.5)
            log(f"cold wave of {args.wave}, load {load()}")
            cold = await bench.wave([f"cold-{i}" for i in range(args.wave)])
            warm: list[float] = []
            names = [f"warm-{i}" for i in range(args.vms)]
            waves = [names[i : i + args.wave] for i in range(0, len(names), args.wave)]
            for number, wave in enumerate(waves):
                log(f"warm wave {number + 1}/{len(waves)}, load {load()}")
                warm += await bench.wave(wave, keep=number == len(waves) - 1)
                log(f"  p50 so far {ms(pct(warm, 0.5))}")
            exec_pod = waves[-1][0]
            log(f"exec, load {load()}")
            kubectl_exec = [
                await asyncio.to_thread(
                    timed, [kubectl, *env_kubeconfig, "-n", ns, "exec", exec_pod, "--", "true"]
                )
                for _ in range(args.execs)
            ]
            kubectl_start = [
                await asyncio.to_thread(timed, [kubectl, "version", "--client"])
                for _ in range(args.execs)
            ]
            exec_load = load()
            ssh_results: dict[str, list[float]] = {}
            ssh_load = ""
            if args.distro:
                log(f"distribution guest, load {load()}")
                ssh_results = await distro_exec_vs_ssh(
                    bench, [kubectl, *env_kubeconfig], work, args.execs
                )
                ssh_load = load()
            uid = (await client.get(f"/api/v1/namespaces/{ns}/pods/{exec_pod}")).json()["metadata"][
                "uid"
            ]
            agent.stop()  # the VMs outlive it; QEMU's qga socket is free for us
            direct = await direct_exec(state / "vms" / uid / "m" / "qga.sock", args.execs)
            direct_load = load()
            watch.cancel()
        finally:
            agent.stop()
            await cleanup(state, cidr)
            await asyncio.to_thread(
                subprocess.run,
                [kubectl, *env_kubeconfig, "delete", "node", node, "--wait=false"],
                capture_output=True,
                check=False,
            )
            await client.aclose()

        log(f"image pull, load {load()}")
        pull_load_before = load()
        pulls = await pull_throughput(work, f"{base}/big.img", size, args.pull_rounds)
        pull_load = f"{pull_load_before} -> {load()}"

    print(f"# VM provider benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"# machine: {os.cpu_count()} CPUs, {machine_memory()}, QEMU TCG, small test guest")
    print(f"# load average (1/5/15 min) at each wave's start: {', '.join(bench.loads)}")
    print()
    print(f"pod created -> Running (guest agent answers), waves of {args.wave} at once:")
    print_table(
        [
            ("", "p50 / p99"),
            (f"cold store (first wave, {args.wave} VMs)", quantiles(cold)),
            (f"warm store ({args.vms} VMs)", quantiles(warm)),
        ]
    )
    if bench.phases:
        print("where the time goes, p50 over all waves (from the create):")
        columns = list(zip(*bench.phases, strict=True))
        print_table(
            [
                (
                    "QEMU daemonized (pull, disks, seed, network, QEMU start)",
                    ms(pct(list(columns[0]), 0.5)),
                ),
                ("guest's booted line logged by the agent", ms(pct(list(columns[1]), 0.5))),
                ("Running seen by the watch", ms(pct(list(columns[2]), 0.5))),
                ("guest's own uptime at its booted line", ms(pct(list(columns[3]), 0.5))),
            ]
        )
    print()
    qemu = [float(t) for t, _, _ in bench.memory]
    outside = [float(t - g) for t, g, _ in bench.memory]
    code = [float(c) for _, _, c in bench.memory]
    rest = [float(t - g - c) for t, g, c in bench.memory]
    minus_guest = [float(t - GUEST_MEMORY_MIB * 1024) for t, _, _ in bench.memory]
    print(f"memory per VM ({GUEST_MEMORY_MIB} MiB guest, {len(qemu)} samples, MiB, p50 / max):")
    print_table(
        [
            ("QEMU RSS", f"{pct(qemu, 0.5) / 1024:.1f} / {max(qemu) / 1024:.1f}"),
            (
                "QEMU RSS outside guest RAM",
                f"{pct(outside, 0.5) / 1024:.1f} / {max(outside) / 1024:.1f}",
            ),
            (
                "  of which TCG's code buffer",
                f"{pct(code, 0.5) / 1024:.1f} / {max(code) / 1024:.1f}",
            ),
            ("  of which the rest", f"{pct(rest, 0.5) / 1024:.1f} / {max(rest) / 1024:.1f}"),
            (
                "QEMU RSS - guest RAM size",
                f"{pct(minus_guest, 0.5) / 1024:.1f} / {max(minus_guest) / 1024:.1f}",
            ),
            (
                "agent RSS growth per running VM",
                f"{pct(bench.agent_growth, 0.5) / 1024:.2f} / {max(bench.agent_growth) / 1024:.2f}",
            ),
            ("agent RSS idle (node Ready, no VM)", f"{agent_idle / 1024:.1f}"),
        ]
    )
    print()
    print(f"exec `true`, {args.execs} sequential calls each (load {exec_load} / {direct_load}):")
    print_table(
        [
            ("", "p50 / p99"),
            ("kubectl exec POD -- true", quantiles(kubectl_exec)),
            ("kubectl version --client (start-up)", quantiles(kubectl_start)),
            ("guest-exec + status on qga.sock (Python)", quantiles(direct)),
        ]
    )
    if ssh_results:
        print()
        print(f"distribution guest (Debian 12, 512 MiB), taking turns, load {ssh_load}:")
        print_table(
            [
                ("", "p50 / p99"),
                ("kubectl exec POD -- true", quantiles(ssh_results["exec"])),
                ("ssh debian@POD-IP true (new connection)", quantiles(ssh_results["ssh"])),
                ("ssh over a ControlMaster", quantiles(ssh_results["mux"])),
            ]
        )
    print()
    print(
        f"image pull, {size / 1e6:.0f} MB from python http.server on 127.0.0.1 (load {pull_load}):"
    )
    print_table(
        [
            ("", "MB/s per round"),
            (
                "ImageStore.pull (download, sha256, fsync)",
                " ".join(f"{x:.0f}" for x in pulls["store"]),
            ),
            ("curl -o", " ".join(f"{x:.0f}" for x in pulls["curl"])),
        ]
    )


def machine_memory() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "?"


async def wait_ready(client: httpx.AsyncClient, node: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = await client.get(f"/api/v1/nodes/{node}")
        if response.is_success:
            conditions = response.json().get("status", {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"node {node} not Ready")


def kill_machines(state: Path) -> list[str]:
    """SIGKILL every QEMU of the state directory; return the run directories' names."""
    for pid_file in state.glob("vms/*/m/pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
    return [run_dir.name for run_dir in state.glob("vms/*")]


async def cleanup(state: Path, cidr: str) -> None:
    """QEMU processes and their networks outlive the agent: end them."""
    network = PodNetwork(cidr)
    for run_dir in kill_machines(state):
        with contextlib.suppress(Exception):
            await network.detach(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vms", type=int, default=20)
    parser.add_argument("--wave", type=int, default=5, help="VMs booted at once")
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--image-mb", type=int, default=200)
    parser.add_argument("--pull-rounds", type=int, default=3)
    parser.add_argument(
        "--distro", action="store_true", help="also exec vs ssh into the distribution guest"
    )
    parser.add_argument("--cluster", help="a running dev cluster (default: start one)")
    args = parser.parse_args()
    run_vm_bench(lambda cluster, work: benchmark(args, cluster, work), args.cluster, "vmbench")


if __name__ == "__main__":
    main()
