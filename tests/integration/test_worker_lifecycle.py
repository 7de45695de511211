"""Worker nodes through their whole life, driven with the CLI: refused before anything starts on a
machine that lacks what they need, reused by a second `up`, healed by `up` after a component
died, and gone without a trace after `down`, even after a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vkubelet.devcluster import Cluster, processes_mentioning
from vkubelet.testing import Kubectl, node_ready, wait_for

from .cli import vkubelet

#: Paths a kubelet, containerd or CNI would write outside their root directories.
KUBELET_PATHS = (
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/cni",
    "/run/containerd",
    "/var/lib/containerd",
    "/opt/containerd",
    "/etc/cni/net.d",
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="worker nodes need root")


def host_paths() -> list[str]:
    """The kubelet paths that exist on the host, with what each directory holds: a machine may
    have them before the test (a containerd of its own), so tests compare with a baseline."""
    found = []
    for path in map(Path, KUBELET_PATHS):
        if path.is_dir():
            found += [str(path), *sorted(str(p) for p in path.iterdir())]
        elif path.exists():
            found.append(str(path))
    return found


def traces(index: int) -> dict[str, list[str]]:
    """What this machine shows of network `index`'s cluster: namespaces, links, routes, cgroups,
    mounts, registry files; and of any worker: host nftables tables and the kubelet's paths
    (other clusters' workers may run beside this test, hence the index)."""

    def run(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    prefix = f"vkw{index}n"
    mine = (prefix, f"vkwbr{index}")
    return {
        "netns": [n for n in run("ip", "netns", "list").split() if n.startswith(prefix)],
        "links": [
            word.rstrip(":@").split("@")[0]
            for word in run("ip", "-o", "link").split()
            if word.startswith(mine)
        ],
        "routes": [r for r in run("ip", "route").splitlines() if f"vkwbr{index} " in r],
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/vkubelet/{prefix}*")),
        "mounts": [
            line for line in Path("/proc/self/mountinfo").read_text().splitlines() if prefix in line
        ],
        "nft": run("nft", "list", "tables").split(),
        "paths": host_paths(),
        "run": [
            str(p)
            for p in Path("/run/vkubelet").rglob("*")
            if p.name in (f"{index}.json",) or p.name.startswith(prefix)
        ]
        if Path("/run/vkubelet").exists()
        else [],
    }


def container_pids(cluster: Cluster) -> set[int]:
    """The processes in the cluster's pod cgroups (containers, the pause processes)."""
    pids: set[int] = set()
    for worker in cluster.workers():
        top = Path("/sys/fs/cgroup/pids") / worker.cgroup_root.lstrip("/")
        for procs in top.rglob("cgroup.procs"):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def test_without_nftables_workers_are_refused_before_anything_starts(
    state: Path, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "iptables", "nsenter", "unshare", "runc", "sysctl", "mount", "umount"):
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    result = vkubelet(
        state,
        "dev",
        "cluster",
        "up",
        "--name",
        "nonft",
        "--workers",
        "1",
        env={"PATH": f"{bin_dir}:{Path(sys.prefix) / 'bin'}"},
    )
    assert result.returncode == 1
    assert "nft" in result.stderr and "apt-get install" in result.stderr, result.stderr
    assert "nftables" in result.stderr
    assert not Cluster("nonft", root=state).exists()
    assert processes_mentioning(str(state)) == []


def test_a_second_up_reuses_a_dead_kubelet_is_reported_and_healed_and_down_leaves_no_trace(
    state: Path, request: pytest.FixtureRequest
) -> None:
    before = host_paths()
    # NotReady 20 s after the kubelet's last lease renewal, not Kubernetes' 50 s.
    up = vkubelet(
        state, "dev", "cluster", "up", "--name", "life", "--workers", "1",
        "--node-monitor-grace-period", "20",
    )  # fmt: skip
    cluster = Cluster("life", root=state)
    # A failed assertion must not leave namespaces, links and cgroups for the next tests.
    request.addfinalizer(
        lambda: cluster.exists() and vkubelet(state, "dev", "cluster", "down", "--name", "life")
    )
    assert up.returncode == 0, up.stderr
    kubectl = Kubectl(cluster.kubeconfig)
    (worker,) = cluster.workers()
    index = cluster.state()["network"]["index"]  # type: ignore[index]
    assert node_ready(kubectl, worker.name)
    assert "kubectl run web --image=vkubelet.local/busybox" in up.stdout

    # A pod with a volume and a log, so that mounts, cgroups and log files exist.
    kubectl(
        "run",
        "sleeper",
        f"--image={cluster.image_reference('busybox')}",
        "--image-pull-policy=Never",
        "--restart=Never",
        "--",
        "sh",
        "-c",
        "echo started; sleep 3600",
    )
    kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=60s", timeout=90)
    during = traces(index)
    assert during["netns"] and during["cgroups"] and during["mounts"], during
    assert during["paths"] == before, "a kubelet path was written on the host, not in its namespace"

    again = vkubelet(state, "dev", "cluster", "up", "--name", "life", "--workers", "1")
    assert again.returncode == 0, again.stderr
    assert "reusing it" in again.stderr
    assert cluster.workers() == [worker]

    kubelet = cluster.state()["workers"][worker.name]["components"]["kubelet"]  # type: ignore[index]
    os.kill(kubelet["pid"], signal.SIGKILL)
    status = vkubelet(state, "dev", "cluster", "status", "--name", "life")
    assert status.returncode == 1
    line = next(x for x in status.stdout.splitlines() if f"{worker.name}/kubelet" in x)
    assert "stopped" in line
    wait_for(
        lambda: not node_ready(kubectl, worker.name),
        timeout=90,
        interval=2,
        what="the node to go NotReady after its kubelet died",
    )

    healed = vkubelet(state, "dev", "cluster", "up", "--name", "life", "--workers", "1")
    assert healed.returncode == 0, healed.stderr
    assert f"Starting worker {worker.name} (kubelet)" in healed.stderr
    assert node_ready(kubectl, worker.name)
    pod = kubectl.json("get", "pod", "sleeper")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0  # the container lived on

    # A crash: every process of the cluster killed at once, nothing cleaned up; the pod's
    # container and its shim live on, as they would...
    containers = container_pids(cluster)
    assert containers
    for pid in processes_mentioning(str(state)):
        os.kill(pid, signal.SIGKILL)
    # ...and `down` still removes everything.
    down = vkubelet(state, "dev", "cluster", "down", "--name", "life")
    assert down.returncode == 0, down.stderr
    left = traces(index)
    assert {k: v for k, v in left.items() if k != "nft"} == {
        "netns": [],
        "links": [],
        "routes": [],
        "cgroups": [],
        "mounts": [],
        "paths": before,
        "run": [],
    }
    assert left["nft"] == [], "kube-proxy's tables belong in the workers' namespaces"
    assert not cluster.directory.exists()
    # Killed: at most zombies for a moment, until whoever inherited them reaps them.
    wait_for(lambda: not [p for p in containers if alive(p)], timeout=10, what="containers gone")
