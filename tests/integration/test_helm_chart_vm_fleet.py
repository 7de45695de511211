"""The chart's vm mode installed for real: `helm install` into a dev cluster with worker nodes,
the agent image (built from this tree: the libvirt binding, ssh and qemu-img in it) running as
a pod on a real kubelet, driving a fleet of two libvirt "hosts" of the lab
(`vkubelet.testing.virtlab`) over `qemu+ssh`, one node per host. The SSH keys come from a
Secret, the hosts' keys from the chart's `vm.knownHosts` (verified: no `noVerify`). The lab's
network is routed into the cluster's (the worker's pods reach the hosts' sshd, the hosts answer
the pods' addresses), as a site's hypervisors are reachable from its cluster.

One VM boots for the module: on the first host, its disks and seed volumes of that host's storage
pool (the daemon never sees the agent's pod's files), whose base image an earlier agent left half
uploaded (the upload starts again; the pool's GC, run every few seconds, spares it all while the VM
runs and removes it all once the VM is gone); `kubectl logs` has its boot and `kubectl exec` runs
in it; `virsh list` shows it on that host only and the other host's node stays Ready with no
domain. The agent's pod is replaced (its state volume starts empty): the new agent takes the
running domain as it is (same domain id, the guest's uptime continues). The VM is on the cluster's
pod network with real packets: each host has a `podCIDR` of its own, cut from the cluster's virtual
range and routed to that host (as a site routes each hypervisor's range), and a busybox pod on a
real worker fetches the VM's httpd by pod IP while the VM fetches the worker pod's. Then the second
host becomes unreachable (its link down): only its node goes NotReady, with libvirt's message, and
the VM on the first host still answers.

Before that, a VirtualMachine boots on the first host and a VirtualMachineMigration moves it to
the other host of the same agent: libvirt peer to peer, each host's `migrationURI` naming a key and
known_hosts file of the lab's hosts (not the agent's Secret). The chart runs all of it: its hook
Job applies the CRDs, its VM controller Deployment (own ServiceAccount) powers the VM on, moves
it, powers it off and on again, and the agent's machine GC (listing VirtualMachines as the
agent's ServiceAccount) removes the machine's volumes from the pool of the host it last ran on
once the VirtualMachine is deleted. Two boots more for the module (~40 s with the move).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster, build_image, ensure_helm
from vkubelet.testing import Kubectl, node_ready, virtlab, wait_for
from vkubelet.testing.virtlab import LibvirtHost

from .helmchart import CHART

pytestmark = pytest.mark.integration

NAMESPACE = "vkubelet-vm-fleet"
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
BOOT_TIMEOUT = 300  # one TCG boot on a busy 2-core machine
GC_INTERVAL = 3  # seconds


@dataclass
class Fleet:
    hosts: list[LibvirtHost]
    nodes: list[str]  # node i is host i's
    cidrs: list[str]  # host i's podCIDR


#: A busybox pod on a worker that serves its name over HTTP: the VM's peer on the pod network.
SERVE_NAME = "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"
#: The same in the guest (its busybox httpd), started through kubectl exec.
GUEST_SERVE = "mkdir -p /tmp/www && hostname > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
#: The guest kernel's boot id: the same after a live migration, new after a boot.
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _lab_bridge(host: LibvirtHost) -> tuple[str, str]:
    """The machine's bridge of the lab and its address there (the lab's .1)."""
    route = subprocess.run(
        ["ip", "-j", "route", "get", host.address], capture_output=True, text=True, check=True
    )
    found = json.loads(route.stdout)[0]
    return str(found["dev"]), str(found["prefsrc"])


def _route_lab_into_cluster(cluster: Cluster, hosts: list[LibvirtHost]) -> list[list[str]]:
    """Workers route the lab's subnet to the machine, the hosts route the cluster's node and pod
    ranges back to it, and the machine forwards what arrives from the lab (the worker bridge
    forwards already). Returns the `ip` commands that undo the workers' routes."""
    bridge, machine = _lab_bridge(hosts[0])
    lab = str(ipaddress.IPv4Interface(f"{machine}/28").network)
    undo = []
    for worker in cluster.workers():
        gateway = str(ipaddress.IPv4Interface(f"{worker.addresses.node_ip}/24").network[1])
        netns = worker.addresses.netns
        _ip("-n", netns, "route", "replace", lab, "via", gateway)
        undo.append(["-n", netns, "route", "del", lab])
    for host in hosts:
        for cluster_range in ("10.160.0.0/11", "10.200.0.0/16"):
            _ip("-n", host.netns, "route", "replace", cluster_range, "via", machine)
    Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").write_text("1\n")
    return undo


def _leave_a_half_upload(host: LibvirtHost, image: Path) -> None:
    """What an agent killed in the middle of uploading the guest's base image leaves in the
    pool: a short base volume with its `.uploading` mark. The next upload must replace it
    (the VM then boots from a whole base)."""
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    path = "/var/lib/libvirt/images/vkubelet"
    host.virsh("pool-define-as", "vkubelet", "dir", "--target", path)
    host.virsh("pool-build", "vkubelet")
    host.virsh("pool-start", "vkubelet")
    for name in (f"vkubelet-base-{digest}", f"vkubelet-base-{digest}.uploading"):
        host.virsh("vol-create-as", "vkubelet", name, "1M")


def _fetch(kubectl: Kubectl, pod: str, url: str) -> str:
    """`url` fetched from inside `pod` (a worker's container, or the VM through its guest
    agent) with busybox wget, '' when it fails (`timeout 5`: busybox's `wget -T` crashes here)."""
    argv = ("-n", NAMESPACE, "exec", pod, "--", "timeout", "5", "wget", "-q", "-O", "-", url)
    done = kubectl(*argv, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def _agent_pods(kubectl: Kubectl, *, running: bool = False) -> list[str]:
    agents = "app.kubernetes.io/name=vkubelet,app.kubernetes.io/instance=vkvm"  # not the controller
    pods = kubectl.json("-n", NAMESPACE, "get", "pods", "-l", agents)
    return [
        p["metadata"]["name"]
        for p in pods["items"]
        if not running or p["status"].get("phase") == "Running"
    ]


def _ready_message(kubectl: Kubectl, node: str) -> tuple[str, str]:
    conditions = kubectl.json("get", "node", node)["status"].get("conditions") or []
    ready: dict[str, Any] = next((c for c in conditions if c["type"] == "Ready"), {})
    return str(ready.get("status", "")), str(ready.get("message", ""))


def _peer_pod(cluster: Cluster) -> dict[str, Any]:
    """A pod on a real worker (the vm nodes are tainted) serving its name: the VM's peer."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "peer", "namespace": NAMESPACE},
        "spec": {
            "terminationGracePeriodSeconds": 1,  # httpd as PID 1 ignores SIGTERM
            "containers": [
                {
                    "name": "httpd",
                    "image": cluster.image_reference("busybox"),
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", SERVE_NAME],
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def fleet(
    worker_cluster: Cluster, worker_kubectl: Kubectl, vm_guest_image: Path
) -> Iterator[Fleet]:
    if (why := virtlab.libvirt_lab_unavailable()) is not None:
        pytest.skip(why)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    helm = ensure_helm(log)
    worker_cluster.load_image(build_image("agent", log).path)
    k = worker_kubectl
    env = {**os.environ, "KUBECONFIG": str(worker_cluster.kubeconfig)}
    suffix = uuid.uuid4().hex[:5]
    nodes = [f"lvf-{suffix}-a", f"lvf-{suffix}-b"]
    # Each host's podCIDR: a /24 of the cluster's virtual range (the workers route that range
    # to the machine; the machine routes each /24 to its host, see LibvirtHost.route_pods).
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None
    prefix = virtual.rsplit(".", 2)[0]
    cidrs = [f"{prefix}.{third}.0/24" for third in random.sample(range(1, 250), 2)]
    workdir = Path(tempfile.mkdtemp(prefix="vklvf-", dir="/tmp"))
    undo: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)  # last: after the lab's end
        hosts = stack.enter_context(virtlab.libvirt_lab(2, workdir / "lab"))
        try:
            undo = _route_lab_into_cluster(worker_cluster, hosts)
            for host, cidr in zip(hosts, cidrs, strict=True):
                host.route_pods(cidr)  # (the route goes with the lab's bridge)
            _leave_a_half_upload(hosts[0], vm_guest_image)
            k("create", "namespace", NAMESPACE)
            keys = [f"--from-file={n}.key={h.key_path}" for n, h in zip(nodes, hosts, strict=True)]
            k("-n", NAMESPACE, "create", "secret", "generic", "vm-ssh", *keys)
            values: dict[str, Any] = {
                "provider": "vm",
                "identity": "serviceAccount",  # a fleet: one node identity would not do
                "nodeName": "",
                "replicas": 1,
                "servingCertificate": {"approveOwnCSRs": True},
                "logFormat": "text",
                "vm": {
                    "sshSecret": "vm-ssh",
                    "knownHosts": "".join(h.known_hosts.read_text() for h in hosts),
                    # the controller and the CRDs are the chart's defaults in vm mode
                    "machineGC": {"enabled": True, "intervalSeconds": GC_INTERVAL},
                },
                "providerConfig": {
                    "accel": "tcg",
                    "guestAgentTimeoutSeconds": BOOT_TIMEOUT,
                    # the GC of the hosts' pools runs often: it must spare what runs, and
                    # removes the VM's volumes and their base once the VM is gone
                    "imageGCIntervalSeconds": GC_INTERVAL,
                    "translations": [{"name": "tiny", "url": "file:///guest/tiny.qcow2"}],
                    "hosts": [
                        {
                            "name": node,
                            "uri": f"qemu+ssh://root@{host.address}/system",
                            "identityFile": f"/etc/vkubelet-ssh/{node}.key",
                            "podCIDR": cidr,
                            # how the other host's daemon reaches this one for a live
                            # migration: a key and known_hosts file on the hosts (the
                            # lab's), not the agent's
                            "migrationURI": host.libssh_uri,
                        }
                        for node, host, cidr in zip(nodes, hosts, cidrs, strict=True)
                    ],
                },
                # The test guest, as a site would serve its images (file:// from a volume).
                "extraVolumes": [
                    {
                        "name": "guest",
                        "hostPath": {"path": str(vm_guest_image), "type": "File"},
                    }
                ],
                "extraVolumeMounts": [
                    {"name": "guest", "mountPath": "/guest/tiny.qcow2", "readOnly": True}
                ],
            }
            values_file = workdir / "values.yaml"
            values_file.write_text(yaml.safe_dump(values))
            install = subprocess.run(
                [str(helm), "install", "vkvm", str(CHART), "--namespace", NAMESPACE,
                 "--values", str(values_file), "--wait", "--timeout", "180s"],
                capture_output=True, text=True, env=env, check=False, timeout=240,
            )  # fmt: skip
            assert install.returncode == 0, install.stdout + install.stderr
            wait_for(
                lambda: all(node_ready(k, n) for n in nodes), timeout=120, what=f"{nodes} Ready"
            )
            yield Fleet(hosts, nodes, cidrs)
        finally:
            print(k("-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/instance=vkvm",
                    "--tail=80", check=False).stdout, file=sys.stderr)  # fmt: skip
            subprocess.run(
                [str(helm), "uninstall", "vkvm", "--namespace", NAMESPACE, "--wait"],
                capture_output=True, env=env, check=False, timeout=120,
            )  # fmt: skip
            for node in nodes:
                k("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)
            k("delete", "namespace", NAMESPACE, "--wait=false", check=False)
            for command in undo:
                subprocess.run(["ip", *command], capture_output=True, check=False)


def test_the_charts_vm_controller_moves_and_powers_a_fleet_vm_and_its_gc_empties_the_pool(
    worker_cluster: Cluster, worker_kubectl: Kubectl, fleet: Fleet
) -> None:
    """The chart's own VM controller and machine GC. A VirtualMachine on the first host of the
    fleet moves to the other host of the same agent (libvirt peer to peer over the hosts' own
    `migrationURI`s): its status names the other node, `virsh list` on each host shows exactly
    the running domain, the guest did not boot again (same boot id, uptime going on, the boot
    once in the target pod's `kubectl logs`), and a worker pod reaches its httpd at its new pod
    IP (of the other host's podCIDR). Powered off (`kubectl scale --replicas=0`) its domain
    leaves the host; powered on it boots again there (a new boot id). Deleted, its volumes leave
    that host's pool (the machine GC, then the pool's). Runs before the chart's other test,
    which needs both hosts up and empty; it leaves them so."""
    k = worker_kubectl
    # The grants: the GC's account may list VirtualMachines and do nothing else with them; the
    # controller's may not touch CRDs (the hook's account did, and is gone).
    agent_sa = f"--as=system:serviceaccount:{NAMESPACE}:vkvm-vkubelet"
    controller_sa = f"--as=system:serviceaccount:{NAMESPACE}:vkvm-vkubelet-vm-controller"

    def can(*args: str) -> str:
        return k("auth", "can-i", *args, check=False).stdout.strip()

    assert can("list", "virtualmachines.vkubelet.io", "-A", agent_sa) == "yes"
    for verb in ("get", "watch", "delete", "patch"):
        assert can(verb, "virtualmachines.vkubelet.io", "-A", agent_sa) == "no", verb
    assert can("patch", "customresourcedefinitions", controller_sa) == "no"
    assert k("-n", NAMESPACE, "get", "serviceaccount", "vkvm-vkubelet-vm-crds",
             check=False).returncode != 0  # fmt: skip
    # either host, never a worker
    hostname_in = {"key": "kubernetes.io/hostname", "operator": "In", "values": fleet.nodes}
    terms = {"nodeSelectorTerms": [{"matchExpressions": [hostname_in]}]}
    on_the_fleet = {"requiredDuringSchedulingIgnoredDuringExecution": terms}
    try:
        vm = {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "mover", "namespace": NAMESPACE},
            "spec": {
                "replicas": 1,
                "template": {
                    "spec": {
                        "tolerations": [TOLERATION],
                        "affinity": {"nodeAffinity": on_the_fleet},
                        "containers": [{
                            "name": "vm", "image": "vm.vkubelet.io/tiny",
                            "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                        }],
                    }
                },
            },
        }  # fmt: skip
        # It boots on the first host (the second cordoned meanwhile) and moves to the second.
        k("cordon", fleet.nodes[1])
        k.apply(vm)
        k.apply(_peer_pod(worker_cluster))

        def status() -> dict[str, Any]:
            return dict(k.json("-n", NAMESPACE, "get", "vm", "mover").get("status") or {})

        first = wait_for(
            lambda: (s := status()).get("phase") == "Running" and s,
            timeout=BOOT_TIMEOUT,
            what="the VirtualMachine Running",
        )
        k("uncordon", fleet.nodes[1])
        source, target = fleet.nodes
        assert first["nodeName"] == source
        hosts = dict(zip(fleet.nodes, fleet.hosts, strict=True))
        pod = ("-n", NAMESPACE, first["podName"])
        k("-n", NAMESPACE, "wait", "--for=condition=Ready", f"pod/{pod[2]}",
          f"--timeout={BOOT_TIMEOUT}s", timeout=BOOT_TIMEOUT + 30)  # fmt: skip
        assert k("exec", *pod, "--", "sh", "-c", GUEST_SERVE).returncode == 0
        boot_id = k("exec", *pod, "--", "cat", BOOT_ID).stdout.strip()
        uptime = float(k("exec", *pod, "--", "cat", "/proc/uptime").stdout.split()[0])
        assert hosts[source].running() == [f"{NAMESPACE}_{pod[2]}"]

        k.apply(
            {
                "apiVersion": "vkubelet.io/v1alpha1",
                "kind": "VirtualMachineMigration",
                "metadata": {"name": "move", "namespace": NAMESPACE},
                "spec": {"vmName": "mover", "targetNode": target},
            }
        )

        def migration() -> dict[str, Any]:
            return dict(k.json("-n", NAMESPACE, "get", "vmmigration", "move").get("status") or {})

        done = wait_for(
            lambda: (m := migration()).get("phase") in ("Succeeded", "Failed") and m,
            timeout=180,
            what="the migration's outcome",
        )
        assert done["phase"] == "Succeeded", done
        print(f"fleet migration: {done}", file=sys.stderr)
        moved = wait_for(
            lambda: (s := status()).get("nodeName") == target and s.get("phase") == "Running" and s,
            timeout=60,
            what=f"the VirtualMachine's status naming {target}",
        )
        # exactly the running domain on each host: none left on the source
        assert hosts[target].running() == [f"{NAMESPACE}_{moved['podName']}"]
        assert hosts[source].virsh("list", "--all", "--name").stdout.split() == []
        # the same guest, no boot: its boot id, and its uptime went on
        after = ("-n", NAMESPACE, moved["podName"])
        assert k("exec", *after, "--", "cat", BOOT_ID).stdout.strip() == boot_id
        assert float(k("exec", *after, "--", "cat", "/proc/uptime").stdout.split()[0]) > uptime
        # one console history: the target pod's log begins with the boot at the source
        logs = k("logs", *after).stdout
        assert logs.count(f"vkubelet-guest: booted hostname={pod[2]}") == 1, logs[:400]
        # packets: a worker pod fetches the guest's httpd at its new pod IP, the other host's
        ip = k.json("-n", NAMESPACE, "get", "pod", moved["podName"])["status"]["podIP"]
        assert ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(fleet.cidrs[1]), ip
        k("-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/peer", "--timeout=90s",
          timeout=120)  # fmt: skip
        wait_for(
            lambda: _fetch(k, "peer", f"http://{ip}:8080/") == pod[2],
            timeout=60,
            what="the moved VM's httpd from a worker pod, by its new pod IP",
        )
        # Powered off and on by the chart's controller: the domain leaves the host, then the
        # machine boots again where its disks are (the target).
        k("-n", NAMESPACE, "scale", "vm/mover", "--replicas=0")
        wait_for(
            lambda: status().get("phase") == "Stopped" and hosts[target].running() == [],
            timeout=120,
            what="the VirtualMachine Stopped, its domain gone from the host",
        )
        k("-n", NAMESPACE, "scale", "vm/mover", "--replicas=1")
        on = wait_for(
            lambda: (s := status()).get("phase") == "Running" and s,
            timeout=BOOT_TIMEOUT,
            what="the VirtualMachine Running again",
        )
        assert on["nodeName"] == target, on
        again = ("-n", NAMESPACE, on["podName"])
        k("-n", NAMESPACE, "wait", "--for=condition=Ready", f"pod/{again[2]}",
          f"--timeout={BOOT_TIMEOUT}s", timeout=BOOT_TIMEOUT + 30)  # fmt: skip
        assert k("exec", *again, "--", "cat", BOOT_ID).stdout.strip() != boot_id
        assert hosts[target].running() == [f"{NAMESPACE}_{on['podName']}"]
        assert "root.qcow2" in hosts[target].virsh("vol-list", "vkubelet").stdout
        uid = k.json("-n", NAMESPACE, "get", "vm", "mover")["metadata"]["uid"]
        k("-n", NAMESPACE, "delete", "vm", "mover", "--wait=true", "--timeout=120s", timeout=150)
        wait_for(
            lambda: all(h.running() == [] for h in fleet.hosts),
            timeout=120,
            what="no domain left on either host",
        )
        # The machine GC (the VirtualMachine gone), then the pool's GC: no volume of the
        # machine, nor its base, stays on the host it last ran on (nor on the first).
        wait_for(
            lambda: all("vkubelet-" not in h.virsh("vol-list", "vkubelet").stdout
                        for h in fleet.hosts),
            timeout=90,
            what="the deleted VirtualMachine's volumes gone from the hosts' pools",
        )  # fmt: skip
        agent = k("-n", NAMESPACE, "logs", "deployment/vkvm-vkubelet").stdout
        assert f"machine gc: removed machine {uid}" in agent
    finally:
        k("uncordon", fleet.nodes[1], check=False)
        print(k("-n", NAMESPACE, "logs", "deployment/vkvm-vkubelet-vm-controller", "--tail=60",
                check=False).stdout, file=sys.stderr)  # fmt: skip


def test_the_chart_drives_two_libvirt_hosts_over_ssh_one_node_each_a_vm_on_the_pod_network(
    worker_cluster: Cluster, worker_kubectl: Kubectl, fleet: Fleet
) -> None:
    k = worker_kubectl
    (first, second), (node, other) = fleet.hosts, fleet.nodes
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vm-on-the-fleet", "namespace": NAMESPACE},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }
    for item in (pod, _peer_pod(worker_cluster)):
        k("apply", "-f", "-", input=json.dumps(item))
    name = ("-n", NAMESPACE, "vm-on-the-fleet")
    k("-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/vm-on-the-fleet",
      f"--timeout={BOOT_TIMEOUT}s", timeout=BOOT_TIMEOUT + 30)  # fmt: skip
    # The boot as the guest printed it on its serial console, through libvirt's console stream.
    logs = wait_for(
        lambda: "vkubelet-guest: booted" in (out := k("logs", *name).stdout) and out,
        timeout=60,
        what="the guest's boot in kubectl logs",
    )
    assert "hostname=vm-on-the-fleet" in logs
    # kubectl exec runs in the guest (its guest agent, through libvirt on the host).
    assert k("exec", *name, "--", "echo", "in-the-guest").stdout.strip() == "in-the-guest"
    hostname = k("exec", *name, "--", "cat", "/proc/sys/kernel/hostname").stdout.strip()
    assert hostname == "vm-on-the-fleet"

    # The pod network, with packets: the VM's address is of its host's podCIDR; a busybox pod
    # on a real worker fetches the VM's httpd by pod IP, and the VM fetches the worker pod's.
    ip = k.json(*name[:2], "get", "pod", name[2])["status"]["podIP"]
    assert ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(fleet.cidrs[0]), ip
    assert k("exec", *name, "--", "sh", "-c", GUEST_SERVE).returncode == 0
    k("-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/peer", "--timeout=90s", timeout=120)
    peer_ip = k.json("-n", NAMESPACE, "get", "pod", "peer")["status"]["podIP"]
    wait_for(
        lambda: _fetch(k, "peer", f"http://{ip}:8080/") == "vm-on-the-fleet",
        timeout=30,
        what="the fleet VM's httpd from a worker pod, by pod IP",
    )
    assert _fetch(k, "vm-on-the-fleet", f"http://{peer_ip}:8080/") == "peer"
    # The disks the guest sees are the host's pool volumes: root, and the seed read-only.
    volumes = first.virsh("vol-list", "vkubelet").stdout
    assert "vkubelet-base-" in volumes and "root.qcow2" in volumes and "seed.iso" in volumes
    assert ".uploading" not in volumes
    domain = f"{NAMESPACE}_vm-on-the-fleet"
    assert first.running() == [domain]
    assert second.running() == []
    assert node_ready(k, other)

    # The agent's pod replaced (a rollout, an eviction): its state volume starts empty, and
    # the new agent takes the running domain as it is (same domain id: no reboot) and serves it.
    before_id = first.virsh("domid", domain).stdout.strip()
    uptime = float(k("exec", *name, "--", "cat", "/proc/uptime").stdout.split()[0])
    (old,) = _agent_pods(k)
    k("-n", NAMESPACE, "delete", "pod", old, "--wait=false")
    wait_for(
        lambda: [p for p in _agent_pods(k, running=True) if p != old],
        timeout=120,
        what="a new agent pod",
    )
    wait_for(
        lambda: k("exec", *name, "--", "echo", "again", check=False).stdout.strip() == "again",
        timeout=120,
        what="kubectl exec through the new agent",
    )
    assert first.virsh("domid", domain).stdout.strip() == before_id
    volumes = first.virsh("vol-list", "vkubelet").stdout  # the GC spared what the VM uses
    assert "root.qcow2" in volumes and "vkubelet-base-" in volumes, volumes
    assert float(k("exec", *name, "--", "cat", "/proc/uptime").stdout.split()[0]) > uptime
    assert first.running() == [domain]

    # The second host unreachable: its node alone goes NotReady, with libvirt's message.
    peer = subprocess.run(
        ["ip", "-n", second.netns, "-o", "link", "show", "up"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    link = next(
        line.split(":")[1].strip().split("@")[0] for line in peer.splitlines() if "lo:" not in line
    )
    _ip("-n", second.netns, "link", "set", link, "down")
    _, message = wait_for(
        lambda: (r := _ready_message(k, other))[0] != "True" and r,
        timeout=120,
        what=f"{other} NotReady",
    )
    assert "libvirt qemu+ssh://" in message, message
    assert node_ready(k, node)
    assert k("exec", *name, "--", "echo", "still").stdout.strip() == "still"
    assert _fetch(k, "peer", f"http://{ip}:8080/") == "vm-on-the-fleet"
    print(f"{other} NotReady: {message}", file=sys.stderr)
    k("-n", NAMESPACE, "delete", "pod", "vm-on-the-fleet", "--wait=false")
    wait_for(lambda: first.running() == [], timeout=120, what="the domain gone with its pod")
    # The pool GC: the pod's volumes go, then the base image volume nothing is backed by now.
    wait_for(
        lambda: "vkubelet-" not in first.virsh("vol-list", "vkubelet").stdout,
        timeout=60,
        what="the pod's volumes and the base image removed from the host's pool",
    )
