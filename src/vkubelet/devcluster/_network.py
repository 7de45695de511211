"""The pod network of a dev cluster with worker nodes, all of it on this machine.

A cluster with workers gets a *network index* n (one per cluster on the machine), and every name
and range follows from it, so that what a crashed run left behind can be found and removed
from the index alone, without its state files:

- a host bridge `vkwbr<n>` on 10.200.<n>.0/24; the host (apiserver, CoreDNS, metrics-server) is
  .1, worker i is .(10+i);
- worker i lives in the network namespace `vkw<n>n<i>`, joined to the bridge by a veth pair
  (`vkw<n>n<i>` on the host, `eth0` inside), with its own pod range 10.(160+n).<i>.0/24 on a CNI
  bridge inside the namespace;
- each worker routes the other workers' pod ranges to their node addresses, and the host routes
  each pod range to its worker (the apiserver reaches pods that serve a kubelet API, such as
  the agent of the Helm chart); workers route 10.200.0.0/16 to the host, so pods reach the
  apiservers of the other dev clusters too (a cluster provider's lower cluster);
- *virtual nodes* (a vm node's VMs, on this machine) take their pod addresses from
  10.(224+n).0.0/16, each node a /24 of it as its `podCIDR`; the provider routes each of its
  pods' addresses on the host (a /32 over the VM's own link).

Workers route every cluster's worker pods (10.160.0.0/11) and virtual pods (10.224.0.0/11) to the
host, which forwards them on: a worker pod reaches a VM, and a pod of one cluster a pod of
another. The host forwards only what arrives on links we own: forwarding is switched on for the
bridge here (and by the vm provider for each VM's link), per interface, so the machine's
`ip_forward` and every other interface stay as they are. There is no default route anywhere:
nothing leaves the machine.

Service ClusterIPs (10.96.0.0/16, per cluster) exist only in the workers' nftables, which
kube-proxy writes inside each worker's namespace. Every cluster has the same Service range, so
the host cannot route a VM's Service traffic by its destination: a rule sends what comes *from*
the cluster's virtual range through the cluster's own table, where the Service range goes to
worker 0. Its kube-proxy translates it, and masquerades it (the virtual range is outside the
`clusterCIDR` it is given), so the answers come back the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import ipaddress
import itertools
import json
import os
import shutil
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ._errors import DevClusterError

MAX_NETWORKS = 32  # 10.160.0.0/16 ... 10.191.0.0/16 for pods
MAX_WORKERS = 32
SERVICE_CIDR = "10.96.0.0/16"
HOSTS_CIDR = "10.200.0.0/16"  # every network's node subnet, the host at .1 of each
WORKER_PODS_CIDR = "10.160.0.0/11"  # every network's worker pods (10.160 ... 10.191)
VIRTUAL_PODS_CIDR = "10.224.0.0/11"  # every network's virtual nodes' pods (10.224 ... 10.255)
#: The routing table (and rule priority) of network n's virtual range is this plus n.
VIRTUAL_TABLE_BASE = 7600
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
#: Where the network registry and the workers' mount namespaces live (a tmpfs: gone on reboot,
#: like everything it describes).
RUN_DIR = Path("/run/vkubelet")
NETNS_DIR = Path("/run/netns")  # where `ip netns` binds network namespaces


class NetworkUnavailable(DevClusterError):
    """This machine lacks something a worker needs; the message names it and how to get it."""


@dataclass(frozen=True)
class WorkerAddresses:
    index: int
    netns: str  # also the name of the veth's host end and of the cgroup directory
    node_ip: str
    pod_cidr: str


@dataclass(frozen=True)
class NetworkPlan:
    """Every name and address of network `index`: a pure function of it (see the module doc)."""

    index: int

    @property
    def bridge(self) -> str:
        return f"vkwbr{self.index}"

    @property
    def bridge_mac(self) -> str:
        return f"02:76:6b:77:00:{self.index:02x}"  # locally administered, "vkw", the index

    @property
    def node_subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.200.{self.index}.0/24")

    @property
    def host_ip(self) -> str:
        return str(self.node_subnet[1])

    @property
    def cluster_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.{160 + self.index}.0.0/16")

    @property
    def virtual_cidr(self) -> ipaddress.IPv4Network:
        """Where virtual nodes of this cluster (vm nodes) take their pods' addresses."""
        return ipaddress.IPv4Network(f"10.{224 + self.index}.0.0/16")

    @property
    def virtual_table(self) -> int:
        return VIRTUAL_TABLE_BASE + self.index

    @property
    def prefix(self) -> str:
        """What every per-worker name of this network starts with."""
        return f"vkw{self.index}n"

    def worker(self, i: int) -> WorkerAddresses:
        if not 0 <= i < MAX_WORKERS:
            raise DevClusterError(f"at most {MAX_WORKERS} workers per cluster")
        return WorkerAddresses(
            index=i,
            netns=f"{self.prefix}{i}",
            node_ip=str(self.node_subnet[10 + i]),
            pod_cidr=f"10.{160 + self.index}.{i}.0/24",
        )

    def ranges(self) -> tuple[ipaddress.IPv4Network, ...]:
        return self.node_subnet, self.cluster_cidr, self.virtual_cidr

    def workers_in(self, directory: Path) -> dict[str, int]:
        """The entries of `directory` named after a worker of this network (a namespace, link or
        cgroup), name -> worker index: how what a crash left is found without state."""
        names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        digits = {name: name.removeprefix(self.prefix) for name in names}
        return {n: int(i) for n, i in digits.items() if n.startswith(self.prefix) and i.isdigit()}


# -- what the machine must have -----------------------------------------------------------------
def preflight() -> None:
    """Fail before anything starts, naming every missing piece at once."""
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("worker nodes need root (network namespaces, cgroups, mounts): run as root")
    packages = {
        "ip": "iproute2",
        "nft": "nftables",
        "iptables": "iptables",
        "nsenter": "util-linux",
        "unshare": "util-linux",
        "runc": "runc",
    }
    missing = sorted({pkg for tool, pkg in packages.items() if shutil.which(tool) is None})
    absent = [p for p in CNI_PLUGINS if not (CNI_BIN_DIR / p).is_file()]
    if absent:
        missing.append("containernetworking-plugins")
    if missing:
        problems.append(
            "missing programs ("
            + ", ".join(sorted(t for t, p in packages.items() if p in missing))
            + (f"; CNI plugins {', '.join(absent)} in {CNI_BIN_DIR}" if absent else "")
            + "): apt-get install -y --no-install-recommends "
            + " ".join(sorted(set(missing)))
        )
    if not Path("/proc/self/ns/net").exists():
        problems.append("this kernel has no network namespaces")
    cgroups = Path("/sys/fs/cgroup")
    if not (cgroups / "cgroup.controllers").exists() and not (cgroups / "memory").is_dir():
        problems.append("no cgroup hierarchy is mounted under /sys/fs/cgroup")
    if problems:
        raise NetworkUnavailable("cannot start worker nodes: " + "; ".join(problems))


# -- the registry of networks in use on this machine ---------------------------------------------
@contextlib.contextmanager
def _registry_lock() -> Iterator[Path]:
    """The registry, locked. The last cluster to leave removes it, lock file included: a process
    that waited on the removed file's lock sees that its file is gone and locks the new one."""
    directory = RUN_DIR / "networks"
    lock_path = directory / ".lock"
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = lock_path.stat().st_ino
            except FileNotFoundError:
                continue
            if current != os.fstat(lock.fileno()).st_ino:
                continue
            yield directory
            if not any(directory.glob("*.json")):
                lock_path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    directory.rmdir()
                    RUN_DIR.rmdir()  # unless the workers' mount namespaces still live there
            return


def registered_owner(index: int) -> str | None:
    """The state directory of the cluster that holds network `index`, if any."""
    try:
        data = json.loads((RUN_DIR / "networks" / f"{index}.json").read_text())
    except (OSError, ValueError):
        return None
    owner = data.get("cluster") if isinstance(data, dict) else None
    return owner if isinstance(owner, str) else None


def host_networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 range this machine has an address in or a route to."""
    used: list[ipaddress.IPv4Network] = []
    for argv in (
        ["ip", "-j", "-4", "addr", "show"],
        ["ip", "-j", "-4", "route", "show", "table", "all"],
    ):
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        try:
            entries = json.loads(out or "[]")
        except ValueError:
            continue
        for entry in entries:
            for info in entry.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    used.append(
                        ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}").network
                    )
            dst = entry.get("dst")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.IPv4Network(dst, strict=False))
    return [n for n in used if not n.is_loopback and n.prefixlen > 0]


def allocate(
    cluster_dir: Path,
    is_stale: Callable[[str], bool],
    reclaim: Callable[[NetworkPlan], None],
) -> NetworkPlan:
    """Claim the lowest free network index for the cluster in `cluster_dir`.

    An index is free when no live cluster holds it (`is_stale(owner_dir)` says whether the
    registered owner is gone; `reclaim` then removes what it left) and none of its ranges
    overlaps an address or route of this machine.
    """
    with _registry_lock() as registry:
        in_use = host_networks_in_use()
        conflicts: list[str] = []
        for index in range(MAX_NETWORKS):
            plan = NetworkPlan(index)
            owner = registered_owner(index)
            if owner == str(cluster_dir):
                return plan
            if owner is not None:
                if not is_stale(owner):
                    continue
                reclaim(plan)
                (registry / f"{index}.json").unlink(missing_ok=True)
                in_use = host_networks_in_use()
            clash = [str(u) for u in in_use for r in plan.ranges() if r.overlaps(u)]
            if clash:
                conflicts.append(
                    f"{', '.join(map(str, plan.ranges()))} (taken: {', '.join(clash)})"
                )
                continue
            (registry / f"{index}.json").write_text(json.dumps({"cluster": str(cluster_dir)}))
            return plan
    detail = "; ".join(conflicts[:3]) or "all held by running clusters"
    raise NetworkUnavailable(
        f"no free address range for a cluster network among {MAX_NETWORKS}: {detail}. "
        "Stop a cluster with workers (`vkubelet dev cluster down --name ...`) or free the range."
    )


def release(plan: NetworkPlan, cluster_dir: Path) -> None:
    with _registry_lock() as registry:
        if registered_owner(plan.index) == str(cluster_dir):
            (registry / f"{plan.index}.json").unlink(missing_ok=True)
    # `ip netns add` made /run/netns a mount point; once empty, it goes (it fails, harmlessly,
    # while any namespace is still mounted there, ours or anybody's).
    with contextlib.suppress(OSError):
        if NETNS_DIR.is_dir() and not any(NETNS_DIR.iterdir()):
            subprocess.run(["umount", str(NETNS_DIR)], capture_output=True, check=False)
            NETNS_DIR.rmdir()


# -- host side ----------------------------------------------------------------------------------
def run(argv: list[str], what: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DevClusterError(f"{what}: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def request(
    host: str,
    port: int,
    method: str,
    path: str,
    *,
    ctx: ssl.SSLContext | None = None,
    body: str | None = None,
    timeout: float,
) -> tuple[int, bytes]:
    """One request to a component on this machine (HTTPS when `ctx` is given): status, body."""
    conn = (
        http.client.HTTPConnection(host, port, timeout=timeout)
        if ctx is None
        else http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    )
    try:
        headers = {"Content-Type": "application/json"} if body else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def ensure_bridge(plan: NetworkPlan) -> None:
    if not _link_exists(plan.bridge):
        # A bridge without an address of its own takes the lowest MAC of its ports: adding or
        # removing a worker would change the host's MAC under the other workers' ARP caches,
        # and their packets to the apiserver would vanish for half a minute.
        run(
            ["ip", "link", "add", plan.bridge, "address", plan.bridge_mac, "type", "bridge"],
            "create the host bridge",
        )
    addresses = run(["ip", "-4", "-o", "addr", "show", "dev", plan.bridge], "read the bridge")
    if f" {plan.host_ip}/" not in addresses:
        run(
            ["ip", "addr", "add", f"{plan.host_ip}/24", "dev", plan.bridge],
            "address the host bridge",
        )
    run(["ip", "link", "set", plan.bridge, "up"], "bring the host bridge up")
    forward_from(plan.bridge)


def forward_from(link: str) -> None:
    """Let the host forward what arrives on `link` (and nothing else: see the module doc)."""
    run(["sysctl", "-q", "-w", f"net.ipv4.conf.{link}.forwarding=1"], f"forward from {link}")


def ensure_worker_link(plan: NetworkPlan, worker: WorkerAddresses) -> None:
    """The worker's namespace, its veth into the bridge, its address and the host's route."""
    netns_file = NETNS_DIR / worker.netns
    if not netns_file.exists():
        run(["ip", "netns", "add", worker.netns], f"create the network namespace of {worker.netns}")
    if not _link_exists(worker.netns):
        veth = ["ip", "link", "add", worker.netns, "type", "veth", "peer", "name", "eth0"]
        run([*veth, "netns", worker.netns], f"create the veth pair of {worker.netns}")
    run(["ip", "link", "set", worker.netns, "master", plan.bridge, "up"], "attach the veth")
    inside = ["ip", "-n", worker.netns]
    addresses = run([*inside, "-4", "-o", "addr", "show", "dev", "eth0"], "read eth0")
    if f" {worker.node_ip}/" not in addresses:
        run([*inside, "addr", "add", f"{worker.node_ip}/24", "dev", "eth0"], "address eth0")
    run([*inside, "link", "set", "eth0", "up"], "bring eth0 up")
    run([*inside, "link", "set", "lo", "up"], "bring lo up")
    # Locally made packets to a ClusterIP need a route before kube-proxy's DNAT rewrites them.
    run([*inside, "route", "replace", SERVICE_CIDR, "via", plan.host_ip], "route Services")
    # The host's addresses on the other clusters' bridges (their apiservers): a pod here may
    # use another dev cluster, as the cluster provider's agent uses its lower cluster. The host
    # answers for its own addresses on any interface, so nothing is forwarded.
    run([*inside, "route", "replace", HOSTS_CIDR, "via", plan.host_ip], "route other clusters")
    for pods in (WORKER_PODS_CIDR, VIRTUAL_PODS_CIDR):
        run([*inside, "route", "replace", pods, "via", plan.host_ip], f"route {pods}")
    for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0")):
        run(
            ["nsenter", f"--net={netns_file}", "sysctl", "-q", "-w", f"{key}={value}"],
            f"set {key} in {worker.netns}",
        )
    run(
        ["ip", "route", "replace", worker.pod_cidr, "via", worker.node_ip, "dev", plan.bridge],
        f"route {worker.pod_cidr} to {worker.netns}",
    )


def route_virtual_services(plan: NetworkPlan, gateway: WorkerAddresses | None) -> None:
    """What the cluster's virtual pods send to a Service goes to `gateway` (None: nowhere)."""
    table = str(plan.virtual_table)
    source = str(plan.virtual_cidr)
    rule = ["ip", "rule", "add", "from", source, "lookup", table, "priority", table]
    if gateway is None:
        unroute_virtual_services(plan)
        return
    if f"from {source} lookup {table}" not in run(["ip", "rule", "show"], "read the rules"):
        run(rule, f"route {source} by table {table}")
    run(
        ["ip", "route", "replace", SERVICE_CIDR, "via", gateway.node_ip, "table", table],
        f"route the Services of {source} to {gateway.netns}",
    )


def unroute_virtual_services(plan: NetworkPlan) -> None:
    table = str(plan.virtual_table)
    subprocess.run(["ip", "route", "flush", "table", table], capture_output=True, check=False)
    while (
        subprocess.run(
            ["ip", "rule", "del", "priority", table], capture_output=True, check=False
        ).returncode
        == 0
    ):
        pass


def route_between(workers: list[WorkerAddresses]) -> None:
    """Each worker reaches every other worker's pods through that worker's node address."""
    for worker, other in itertools.permutations(workers, 2):
        run(
            ["ip", "-n", worker.netns, "route", "replace", other.pod_cidr, "via", other.node_ip],
            f"route {other.pod_cidr} in {worker.netns}",
        )


def remove_worker_link(worker: WorkerAddresses) -> None:
    subprocess.run(["ip", "route", "del", worker.pod_cidr], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", worker.netns], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", worker.netns], capture_output=True, check=False)


def remove_leftovers(plan: NetworkPlan) -> None:
    """Everything of network `plan.index` on the host side (processes are the caller's)."""
    for index in plan.workers_in(NETNS_DIR).values():
        remove_worker_link(plan.worker(index))
    for link in plan.workers_in(Path("/sys/class/net")):
        subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
    if _link_exists(plan.bridge):
        subprocess.run(["ip", "link", "del", plan.bridge], capture_output=True, check=False)
    unroute_virtual_services(plan)
