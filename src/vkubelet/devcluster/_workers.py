"""Real worker nodes of a dev cluster: containerd, kubelet and kube-proxy per worker.

Each worker runs in its own network namespace (see `_network`) and its own mount namespace.
The mount namespace is what makes several kubelets live side by side on one host and leave
nothing behind: inside it, /var/lib and /var/log are the worker's own directories and /run is a
fresh tmpfs, so the paths a kubelet and containerd write without asking (/var/lib/kubelet and
its device-plugins socket, /var/log/pods and /var/log/containers, /var/lib/cni,
/run/containerd) are private to the worker, and every mount they make (volumes, overlay root
file systems, netns files) disappears with the namespace. The namespace outlives a restart of
its processes because it is bound to a file under /run/vkubelet/mnt (as `ip netns` does for
network namespaces).

Three settings this machine needs (measured, see docs): the kubelet runs on cgroup v1 only when
its config says `failCgroupV1: false`; CAP_SYS_RESOURCE is dropped here, so containerd must not
give sandboxes a negative oom_score_adj (`restrict_oom_score_adj`); and each kubelet gets a
cgroup root of its own, or two kubelets delete each other's pod cgroups as orphans.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .._files import write_kubeconfig
from . import _network, _pki, _proc
from ._errors import DevClusterError
from ._network import NetworkPlan, WorkerAddresses

COMPONENTS = ("containerd", "kubelet", "kube-proxy")
PAUSE_IMAGE = "vkubelet.local/pause:3.10"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "vkubelet"
MOUNT_NS_DIR = _network.RUN_DIR / "mnt"
#: Paths the workers mount over inside their namespaces; state kept there would be hidden.
MOUNTED_OVER = (Path("/var/lib"), Path("/var/log"), Path("/run"))
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
KUBELET_HEALTHZ_PORT = 10248
PROXY_HEALTHZ_PORT = 10256


class WorkerFailed(DevClusterError):
    pass


@dataclass(frozen=True)
class Worker:
    """One worker node: its name, addresses and directory (`<cluster>/workers/<name>`)."""

    name: str
    addresses: WorkerAddresses
    directory: Path

    @property
    def netns_file(self) -> Path:
        return _network.NETNS_DIR / self.addresses.netns

    @property
    def mount_ns_file(self) -> Path:
        return MOUNT_NS_DIR / self.addresses.netns

    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot: its pods' cgroups go below it in every hierarchy."""
        return f"/{CGROUP_PARENT}/{self.addresses.netns}"

    def log_path(self, component: str) -> Path:
        return self.directory / "logs" / f"{component}.log"

    def enter(self) -> list[str]:
        """The argv prefix that runs a program inside this worker's namespaces."""
        return [
            "nsenter",
            f"--net={self.netns_file}",
            f"--mount={self.mount_ns_file}",
            "--",
        ]


def check_paths(*paths: Path) -> None:
    """State or binaries below a path the workers mount over would vanish inside them."""
    for path in paths:
        resolved = path.resolve()
        for hidden in MOUNTED_OVER:
            if resolved == hidden or hidden in resolved.parents:
                raise WorkerFailed(
                    f"{path} is below {hidden}, which worker nodes mount over in their own "
                    "mount namespaces: set VKUBELET_STATE_DIR / VKUBELET_CACHE_DIR elsewhere"
                )


# -- files ----------------------------------------------------------------------------------------
def write_files(
    worker: Worker,
    *,
    plan: NetworkPlan,
    ca: _pki.KeyPair,
    server: str,
    binaries: dict[str, Path],
) -> None:
    """Certificates, kubeconfigs and the configs of containerd, CNI, the kubelet, kube-proxy."""
    d = worker.directory
    for sub in ("pki", "logs", "var-lib", "var-log", "cni"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    pki = d / "pki"
    (pki / "ca.crt").write_bytes(ca.cert_pem())
    node_ip = worker.addresses.node_ip
    # What a kubelet gets from TLS bootstrapping, issued directly: the Node authorizer and
    # NodeRestriction see the same identity either way.
    client = _pki.issue(
        ca, f"system:node:{worker.name}", organizations=("system:nodes",), client=True
    )
    serving = _pki.issue(
        ca,
        f"system:node:{worker.name}",
        server=True,
        dns_names=(worker.name,),
        ip_addresses=(node_ip,),
    )
    proxy = _pki.issue(ca, "system:kube-proxy", client=True)
    serving.write(pki, "kubelet-serving")
    for stem, pair in (("kubelet", client), ("kube-proxy", proxy)):
        write_kubeconfig(
            d / f"{stem}.kubeconfig",
            cluster="dev",
            server=server,
            ca_pem=ca.cert_pem(),
            user=stem,
            cert_pem=pair.cert_pem(),
            key_pem=pair.key_pem(),
        )
    _write_yaml(d / "kubelet.yaml", _kubelet_config(worker))
    _write_yaml(d / "kube-proxy.yaml", _proxy_config(worker, plan))
    (d / "containerd.toml").write_text(_containerd_config(worker, binaries))
    (d / "cni" / "10-vkubelet.conflist").write_text(_cni_config(worker))


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _kubelet_config(worker: Worker) -> dict[str, Any]:
    d = worker.directory
    node_ip = worker.addresses.node_ip
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine is cgroup v1 (hybrid); Kubernetes >= 1.35 asks
        "cgroupDriver": "cgroupfs",  # no systemd here
        "cgroupRoot": worker.cgroup_root,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": node_ip,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "tlsCertFile": str(d / "pki" / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(d / "pki" / "kubelet-serving.key"),
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(d / "pki" / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [_network.DNS_SERVICE_IP],
        "clusterDomain": _network.CLUSTER_DOMAIN,
        # No upstream resolvers in pods: names outside the cluster do not resolve (nothing
        # leaves the machine), instead of leaking the host's resolv.conf into every pod.
        "resolvConf": "",
        "failSwapOn": False,
        "serializeImagePulls": False,
        # A dev machine's disk is shared with everything else: evict only when it is truly full.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "2%",
            "imagefs.available": "2%",
            "nodefs.inodesFree": "2%",
        },
        "imageGCHighThresholdPercent": 98,
        "imageGCLowThresholdPercent": 95,
        "containerLogMaxSize": "10Mi",
        "containerLogMaxFiles": 2,
        "nodeStatusReportFrequency": "20s",
        "shutdownGracePeriod": "0s",
    }


def _proxy_config(worker: Worker, plan: NetworkPlan) -> dict[str, Any]:
    node_ip = worker.addresses.node_ip
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(worker.directory / "kube-proxy.kubeconfig")},
        "hostnameOverride": worker.name,
        "bindAddress": node_ip,
        "healthzBindAddress": f"{node_ip}:{PROXY_HEALTHZ_PORT}",
        "metricsBindAddress": "127.0.0.1:10249",
        "clusterCIDR": str(plan.cluster_cidr),
        "nodePortAddresses": [f"{node_ip}/32"],
        # 0 = leave alone: the conntrack table size is the host's, shared by every namespace.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


def _containerd_config(worker: Worker, binaries: dict[str, Path]) -> str:
    cni = worker.directory / "cni"
    runc = shutil.which("runc") or "/usr/sbin/runc"
    # Version 4 is containerd 2.4's schema (`containerd config default`). Paths not named here
    # are containerd's defaults, which the worker's mount namespace makes private
    # (/var/lib/containerd, /run/containerd); `imports` is emptied so that the host's
    # /etc/containerd is never read.
    return f"""version = 4
imports = []
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.differ.v1.erofs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
  "io.containerd.nri.v1.nri",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins.'io.containerd.internal.v1.opt']
  path = "/var/lib/containerd/opt"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # CAP_SYS_RESOURCE is dropped on these machines: a negative oom_score_adj fails every sandbox.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  # The pause image is loaded locally; there is no registry to pull it from.
  disable_pause_image_pull = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{_network.CNI_BIN_DIR}"]
  conf_dir = "{cni}"
  max_conf_num = 1
  use_internal_loopback = true

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def _cni_config(worker: Worker) -> str:
    import json

    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "vkubelet",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    # Pod traffic keeps its source address between workers: routes, not NAT.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": worker.addresses.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=2,
    )


# -- namespaces and cgroups ------------------------------------------------------------------------
def ensure_mount_namespace(worker: Worker) -> None:
    """The worker's own /var/lib, /var/log and /run, bound to a file: it outlives processes."""
    if _is_mountpoint(worker.mount_ns_file):
        return
    MOUNT_NS_DIR.mkdir(parents=True, exist_ok=True)
    if not _is_mountpoint(MOUNT_NS_DIR):
        # A namespace file can only be bound below a private mount (what `ip netns` does).
        _network.run(["mount", "--bind", str(MOUNT_NS_DIR), str(MOUNT_NS_DIR)], "bind the mnt dir")
    _network.run(["mount", "--make-private", str(MOUNT_NS_DIR)], "make the mnt dir private")
    worker.mount_ns_file.touch()
    d = worker.directory
    script = (
        "set -e; mount -t tmpfs -o mode=0755,size=256m vkubelet-run /run; "
        f'mount --bind "{d / "var-lib"}" /var/lib; mount --bind "{d / "var-log"}" /var/log'
    )
    _network.run(
        [
            "unshare",
            f"--mount={worker.mount_ns_file}",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
        ],
        f"create the mount namespace of {worker.name}",
    )


def _is_mountpoint(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as mounts:  # noqa: PTH123 - a plain read of procfs
        return any(line.split()[4] == target for line in mounts)


def _hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, name=systemd and the v2 `unified` one)."""
    found = []
    with open("/proc/self/mountinfo") as mounts:  # noqa: PTH123
        for line in mounts:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                path = Path(fields[4])
                if path.is_relative_to(CGROUP_ROOT):
                    found.append(path)
    return found


def ensure_cgroups(worker: Worker) -> None:
    """Create the kubelet's cgroup root in every hierarchy (it must exist before it starts)."""
    for hierarchy in _hierarchies():
        if (hierarchy / "cgroup.controllers").exists():
            continue  # cgroup v2: runc creates what it needs
        parent = hierarchy / CGROUP_PARENT
        for directory in (parent, parent / worker.addresses.netns):
            directory.mkdir(exist_ok=True)
            if (hierarchy / "cpuset.cpus").exists():
                # A new cpuset starts empty, and a cgroup with no CPUs takes no task.
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    target = directory / knob
                    if not target.read_text().strip():
                        target.write_text((directory.parent / knob).read_text())


def _cgroup_dirs(worker: Worker) -> list[Path]:
    return [h / CGROUP_PARENT / worker.addresses.netns for h in _hierarchies()]


def _pids_in_cgroups(worker: Worker) -> set[int]:
    pids: set[int] = set()
    for top in _cgroup_dirs(worker):
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in procs.read_text().split())
    return pids


def _pids_in_namespaces(files: Iterable[Path]) -> set[int]:
    """Processes that live in one of the namespaces bound to `files` (what `ip netns pids` does)."""
    inodes = set()
    for file in files:
        with contextlib.suppress(OSError):
            inodes.add(file.stat().st_ino)
    if not inodes:
        return set()
    pids = set()
    for pid in _proc.pids():
        for kind in ("net", "mnt"):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/ns/{kind}").stat().st_ino in inodes:
                    pids.add(pid)
    pids.discard(os.getpid())
    return pids


def _kill_everything(worker: Worker, timeout: float = 20.0) -> None:
    """SIGKILL the worker's processes, containers and shims included, until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids_in_cgroups(worker) | _pids_in_namespaces(
            [worker.netns_file, worker.mount_ns_file]
        )
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    raise WorkerFailed(f"processes of {worker.name} did not die: {sorted(pids)}")


def _remove_cgroups(worker: Worker, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for top in _cgroup_dirs(worker):
        if not top.is_dir():
            continue
        # Deepest first: a cgroup with children cannot be removed.
        for directory in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            _rmdir_retrying(directory, deadline)
        _rmdir_retrying(top, deadline)
        parent = top.parent
        with contextlib.suppress(OSError):
            if not any(p.is_dir() for p in parent.iterdir()):
                parent.rmdir()  # the shared `vkubelet` parent, when no other worker uses it


def _rmdir_retrying(directory: Path, deadline: float) -> None:
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise WorkerFailed(f"cannot remove cgroup {directory}") from None
            time.sleep(0.1)


def teardown(worker: Worker, processes: dict[str, _proc.ProcessRef] | None = None) -> None:
    """Remove everything of one worker: processes, mounts, cgroups, links, its directory.

    The components are stopped with SIGTERM first: a kubelet killed outright, its veth deleted
    a moment later, never gets its FIN to the apiserver, which then waits for that connection
    for the whole of its own shutdown.
    """
    for component in reversed(COMPONENTS):
        if processes and component in processes:
            _proc.stop(processes[component], grace=5)
    _kill_everything(worker)
    if _is_mountpoint(worker.mount_ns_file):
        subprocess.run(["umount", str(worker.mount_ns_file)], capture_output=True, check=False)
    worker.mount_ns_file.unlink(missing_ok=True)
    _release_mount_ns_dir()
    _remove_cgroups(worker)
    _network.remove_worker_link(worker.addresses)
    shutil.rmtree(worker.directory, ignore_errors=True)


def _release_mount_ns_dir() -> None:
    with contextlib.suppress(OSError):
        if MOUNT_NS_DIR.is_dir() and not any(MOUNT_NS_DIR.iterdir()):
            subprocess.run(["umount", str(MOUNT_NS_DIR)], capture_output=True, check=False)
            MOUNT_NS_DIR.rmdir()


def reclaim(plan: NetworkPlan) -> None:
    """Remove whatever a dead cluster left of the workers of network `plan` (found by name, not
    by state). The host bridge stays: the control plane may still be talking on it."""
    places = [_network.NETNS_DIR, MOUNT_NS_DIR, *(h / CGROUP_PARENT for h in _hierarchies())]
    for i in sorted({i for place in places for i in plan.workers_in(place).values()}):
        teardown(Worker(f"w{i}", plan.worker(i), Path("/nonexistent")))


# -- processes -------------------------------------------------------------------------------------
def argv(worker: Worker, component: str, binaries: dict[str, Path]) -> list[str]:
    d = worker.directory
    flags = {
        "containerd": [f"--config={d / 'containerd.toml'}", "--log-level=warn"],
        "kubelet": [
            f"--config={d / 'kubelet.yaml'}",
            f"--kubeconfig={d / 'kubelet.kubeconfig'}",
            f"--hostname-override={worker.name}",
            f"--node-ip={worker.addresses.node_ip}",
            "--v=1",
        ],
        "kube-proxy": [f"--config={d / 'kube-proxy.yaml'}", "--v=1"],
    }[component]
    # containerd finds its shim on PATH.
    path = f"{binaries['containerd'].parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = ["env", f"PATH={path}"] if component == "containerd" else []
    return [*worker.enter(), *env, str(binaries[component]), *flags]


def ctr(worker: Worker, binaries: dict[str, Path], *args: str, timeout: float = 300) -> str:
    """Run `ctr` against the worker's containerd, in the k8s.io namespace the CRI uses."""
    command = [
        *worker.enter(),
        str(binaries["ctr"]),
        "--address",
        CONTAINERD_SOCKET,
        "--namespace",
        "k8s.io",
        *args,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(f"ctr {' '.join(args)} on {worker.name} timed out") from None
    if done.returncode != 0:
        raise WorkerFailed(f"ctr {' '.join(args)} on {worker.name}: {done.stderr.strip()}")
    return done.stdout


def containerd_answers(worker: Worker, binaries: dict[str, Path]) -> bool:
    try:
        ctr(worker, binaries, "version", timeout=10)
    except WorkerFailed:
        return False
    return True


def import_image(worker: Worker, binaries: dict[str, Path], archive: Path) -> None:
    ctr(worker, binaries, "images", "import", "--no-unpack=false", str(archive))


def healthz(worker: Worker, component: str) -> bool:
    """The component's own health endpoint, reachable from the host at the node's address."""
    port = {"kubelet": KUBELET_HEALTHZ_PORT, "kube-proxy": PROXY_HEALTHZ_PORT}[component]
    try:
        answer = _network.request(worker.addresses.node_ip, port, "GET", "/healthz", timeout=2)
    except (OSError, http.client.HTTPException):
        return False
    return answer[0] == 200
