"""Live migration between two vm nodes on the libvirt runtime (issue 29): each node's agent
drives its own libvirt "host" of a two-host lab (`vkubelet.testing.virtlab`) over qemu+ssh,
and the source host's daemon sends the domain to the target's itself (peer to peer, the disk's
overlay copied, no shared storage), driven by the seam's pod annotations as the
VirtualMachineMigration controller drives them.

One VM for the module, counting on its serial console; in order: a target host that refuses
(its disk removed after the endpoint was published) leaves the VM running at the source, the
source pod's Migration condition saying why; then the VM moves to the other node and keeps
counting, the same guest (no boot), the target pod's `kubectl logs` beginning with the source's
console history (the boot, the ticks printed before the move) and going on with the ticks
printed there, each once, `virsh list` on each host showing exactly the running domain, named
after and labelled with the pod that now runs it, its interface the target pod's network
(packets between the target host and the guest, both ways). Then a domain defined with `virsh
define` and imported moves whole to the other host, where its VirtualMachine's deletion policy
is applied when it is deleted (the module's agents run the machine GC). Last, a second VM's
moves outlive their agents (SIGKILLed mid-copy): one libvirt abandons (the VM runs on at the
source, both pods say why), one libvirt's daemons finish (Completed, the source's run ending
Migrated, the target Running in its first run).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import secrets
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    delete_namespace,
    local_test_address,
    node_ready,
    virtlab,
    wait_for,
)
from vkubelet.testing.virtlab import LibvirtHost

from .vmlab import (
    TOLERATION,
    PodsOf,
    clean_up,
    install_crds,
    require_vm_host,
    start_vm_agent,
)

pytestmark = pytest.mark.integration

SOURCE = "vm.vkubelet.io/migration-source"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_READY = "vm.vkubelet.io/MigrationTarget"
MIGRATION = "vm.vkubelet.io/Migration"
TOKEN = "vm.vkubelet.io/migration-token"
METADATA = "https://vkubelet.io/xmlns/vm-domain/1"
IMPORT_URI = "https://vkubelet.io/xmlns/vm-import/1"
DOMAIN = "vm.vkubelet.io/domain"
MACHINE = "vm.vkubelet.io/machine"
POLICY = "vm.vkubelet.io/domain-deletion-policy"
SHARED = "10.212.0.0/16"
POOL = "vklm-"  # the target node's storage pool's name, and a suffix
COUNTER = (
    "(i=0; while :; do i=$((i+1)); echo \"tick $i $(cut -d' ' -f1 /proc/uptime)\" > /dev/ttyS0;"
    " usleep 100000; done) </dev/null >/dev/null 2>&1 &"
)
TICK = re.compile(r"^tick (\d+) ([\d.]+)\r?$", re.M)


@dataclass
class Node:
    name: str
    agent: AgentProcess
    host: LibvirtHost
    address: str
    state: Path  # the agent's stateDir
    start: Callable[[], AgentProcess]  # this node's agent, on its config and stateDir

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """The agent stopped (SIGTERM: its domains run on; SIGKILL: a crash) and started
        again."""
        self.agent.stop(sig)
        self.agent = self.start()


@dataclass
class Lab(PodsOf):
    source: Node
    target: Node

    def logs(self, name: str) -> str:
        return str(self.kubectl("-n", self.namespace, "logs", name).stdout)

    def running(self, name: str) -> bool:
        status = self.pod(name)["status"]
        states = status.get("containerStatuses") or [{}]
        return status.get("phase") == "Running" and "running" in states[0].get("state", {})

    def target_pod(
        self,
        name: str,
        source: str = "vm",
        annotations: dict[str, str] | None = None,
        node: str | None = None,
    ) -> dict[str, Any]:
        """A target pod on the target node (or `node`), as the controller makes it; its
        endpoint."""
        given = {**(annotations or {}), SOURCE: source, TOKEN: secrets.token_hex(32)}
        self.apply(vm_pod(name, node or self.target.name, given))
        wait_for(
            lambda: self.condition(name, TARGET_READY).get("status") == "True",
            timeout=120,
            what=f"{name}'s endpoint",
        )
        return dict(json.loads(self.condition(name, TARGET_READY)["message"]))

    def migrate(self, target: str, endpoint: dict[str, Any], source: str = "vm") -> None:
        token = self.pod(target)["metadata"]["annotations"][TOKEN]
        self.kubectl(
            "-n", self.namespace, "annotate", "--overwrite", "pod", source,
            f"{MIGRATE_TO}={json.dumps(endpoint)}", f"{TOKEN}={token}",
        )  # fmt: skip


def vm_pod(name: str, node: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    imported = DOMAIN in (annotations or {})  # the domain's own disks: no image pulled
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/imported" if imported else "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def lab(kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Lab]:
    """Two libvirt hosts, a vm node on each (libvirt runtime over qemu+ssh), and one VM on
    the first, counting on its console."""
    require_vm_host()
    if (why := virtlab.libvirt_lab_unavailable()) is not None:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="vklm-", dir="/tmp"))
    suffix = uuid.uuid4().hex[:5]
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)  # last: after the lab's end
        hosts = stack.enter_context(virtlab.libvirt_lab(2, workdir / "lab"))
        thirds = random.sample(range(1, 250), 2)
        for index, host in enumerate(hosts):
            name, cidr = f"lvm-{index + 1}-{suffix}", f"10.212.{thirds[index]}.0/24"
            node_dir = workdir / name
            node_dir.mkdir()
            address = stack.enter_context(local_test_address())
            settings = {
                "runtime": "libvirt",
                "sharedPodCIDRs": [SHARED],
                "libvirt": {
                    "uri": f"{host.ssh_uri}&no_tty=1",
                    "migrationURI": host.libssh_uri,
                    # the target's disks are volumes of a pool (as in a fleet): the VM moves
                    # from a host of files to one of volumes
                    **(
                        {"pool": {"name": f"vklm-{suffix}", "path": str(node_dir / "pool")}}
                        if index == 1
                        else {}
                    ),
                },
                "guestAgentTimeoutSeconds": 300,
                # the imported domain's deletion policy, applied once its VirtualMachine is
                # gone (the module's other pods have no machine: nothing of theirs is touched)
                "machineGC": {"kubeconfig": str(kube_cluster.kubeconfig), "intervalSeconds": 1},
            }

            def start(
                node_dir: Path = node_dir,
                name: str = name,
                address: str = address,
                cidr: str = cidr,
                settings: dict[str, Any] = settings,
            ) -> AgentProcess:
                return start_vm_agent(
                    kube_cluster, node_dir, name=name, address=address, cidr=cidr,
                    image=vm_guest_image, **settings,
                )  # fmt: skip

            stack.callback(kubectl, "delete", "node", name, "--ignore-not-found", "--wait=false")
            stack.callback(clean_up, node_dir / "state", cidr)
            node = Node(name, start(), host, address, node_dir / "state", start)
            stack.callback(lambda node=node: node.agent.stop())  # type: ignore[misc]
            nodes.append(node)
        for node in nodes:
            wait_for(
                lambda node=node: node_ready(kubectl, node.name),  # type: ignore[misc]
                timeout=90,
                what=f"node {node.name} Ready",
            )
        namespace = create_namespace(kubectl, f"lvm-{suffix}")
        stack.callback(delete_namespace, kubectl, namespace)
        handle = Lab(namespace, kubectl, nodes[0], nodes[1])
        handle.apply(vm_pod("vm", nodes[0].name))
        wait_for(lambda: handle.running("vm"), timeout=300, interval=2, what="the VM Running")
        kubectl("-n", namespace, "exec", "vm", "--", "sh", "-c", COUNTER)
        wait_for(lambda: len(TICK.findall(handle.logs("vm"))) >= 5, timeout=60, what="ticks")
        yield handle


def virtual_machine(name: str, domain: str, policy: str) -> dict[str, Any]:
    """A VirtualMachine importing `domain`, powered off: no controller runs in the module, it
    is what the machine GC lists (its uid names the machine)."""
    return {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "replicas": 0,
            "importDomain": {"name": domain, "deletionPolicy": policy},
            "template": {
                "spec": {"containers": [{"name": "vm", "image": "vm.vkubelet.io/imported"}]}
            },
        },
    }


def transient_pools(host: LibvirtHost) -> list[str]:
    """The host's storage pools but the target node's own (`libvirt.pool`)."""
    pools = host.virsh("pool-list", "--all", "--name").stdout.split()
    return [p for p in pools if not p.startswith(POOL)]


def target_qemu(lab: Lab, domain: str) -> int:
    """The target host's QEMU of `domain`, from libvirt's own pid file on that host."""
    return int((lab.target.host.dir / "run" / "qemu" / f"{domain}.pid").read_text().strip())


def _ticks(text: str) -> list[tuple[int, float]]:
    return [(int(n), float(t)) for n, t in TICK.findall(text)]


def test_a_target_host_that_refuses_leaves_the_vm_running_at_the_source_saying_why(
    lab: Lab,
) -> None:
    domain = f"{lab.namespace}_vm"
    endpoint = lab.target_pod("refusing")
    assert endpoint["libvirt"]["domain"] == f"{lab.namespace}_refusing"
    # The target host loses the disk it would receive the VM's into.
    Path(endpoint["libvirt"]["files"]["vda"]).unlink()
    lab.migrate("refusing", endpoint)
    wait_for(
        lambda: lab.condition("vm", MIGRATION).get("reason") == "Failed",
        timeout=120,
        what="the migration failed",
    )
    error = json.loads(lab.condition("vm", MIGRATION)["message"])["error"]
    print(f"refused: {error}")
    # the target's own reason (over qemu+libssh: qemu+ssh loses it, see _lvmigrate.failure)
    # (or, now and then over libssh too, the lost channel, saying where the reason is)
    assert "pre-creation of storage targets" in error or "libvirtd log has it" in error, error
    # The VM runs on at the source, defined there alone; nothing at the target.
    assert lab.source.host.running() == [domain]
    assert lab.target.host.virsh("list", "--all", "--name").stdout.split() == []
    assert lab.running("vm")
    ticks = len(TICK.findall(lab.logs("vm")))
    wait_for(lambda: len(TICK.findall(lab.logs("vm"))) > ticks + 5, timeout=30, what="ticking")
    lab.kubectl("-n", lab.namespace, "delete", "pod", "refusing", "--wait=true", "--timeout=60s")


def test_a_vm_moves_to_the_other_libvirt_host_and_counts_on_in_one_console_history(
    lab: Lab,
) -> None:
    moved = f"{lab.namespace}_vm-2"
    endpoint = lab.target_pod("vm-2")
    assert endpoint["host"] == lab.target.address
    before = _ticks(lab.logs("vm"))
    earlier = lab.condition("vm", MIGRATION).get("message")  # the refused one's, if it ran

    def outcome() -> bool:
        condition = lab.condition("vm", MIGRATION)
        ended = condition.get("reason") in ("Completed", "Failed")
        return ended and condition.get("message") != earlier

    lab.migrate("vm-2", endpoint)
    wait_for(outcome, timeout=180, what="the migration's outcome")
    result = lab.condition("vm", MIGRATION)
    assert result["reason"] == "Completed", result
    print(f"migration: {result['message']}")
    wait_for(lambda: lab.running("vm-2"), timeout=120, what="the target Running")

    # exactly the running VM on each host: gone from the source, at the target under the
    # target pod's name and UID
    left = lab.source.host.virsh("list", "--all", "--name").stdout.split()
    states = [lab.source.host.virsh("domstate", "--reason", d).stdout.strip() for d in left]
    assert left == [], states
    assert lab.target.host.running() == [moved]
    uid = lab.pod("vm-2")["metadata"]["uid"]
    metadata = lab.target.host.virsh("metadata", moved, METADATA).stdout
    assert f'uid="{uid}"' in metadata and f'node="{lab.target.name}"' in metadata

    def source_ended() -> bool:
        state = lab.pod("vm")["status"]["containerStatuses"][0]["state"]
        return bool(state.get("terminated", {}).get("reason") == "Migrated")

    wait_for(source_ended, timeout=60, what="the source pod terminated: Migrated")
    source_log = lab.logs("vm")  # final: the source's run ended
    source_last = _ticks(source_log)[-1]  # the last tick the guest printed before the move

    # kubectl logs of the target: the source's console history first (the guest's boot, the
    # ticks printed before the move), then the ticks printed here, each once and none lost;
    # the same guest counts on (its counter and its clock go on), no second boot
    def printed_here(text: str) -> list[tuple[int, float]]:
        return [tick for tick in _ticks(text) if tick[0] > source_last[0]]

    wait_for(
        lambda: len(printed_here(lab.logs("vm-2"))) >= 10, timeout=60, what="ticks at the target"
    )
    text = lab.logs("vm-2")
    after, here = _ticks(text), printed_here(text)
    assert text.startswith(source_log[:200]), text[:400]
    assert text.count("vkubelet-guest: booted hostname=vm") == 1, text[:400]
    assert after[: len(before)] == before  # printed before the move, as the source logged them
    numbers = [n for n, _ in after]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a tick lost or twice"
    assert numbers.count(source_last[0]) == 1 and numbers.count(here[0][0]) == 1
    assert here[0][1] > source_last[1]
    hostname = lab.kubectl("-n", lab.namespace, "exec", "vm-2", "--", "cat", "/etc/hostname")
    assert hostname.stdout.strip() == "vm"

    # its interface is the target pod's network there: the tap has the target node's gateway
    # with the guest's new address as its peer, the guest was given that address, and packets
    # go both ways between the target host and the guest
    address = lab.pod("vm-2")["status"]["podIP"]
    gateway = endpoint["libvirt"]["network"]["gateway"]
    tap = endpoint["libvirt"]["network"]["link"]
    shown = lab.target.host.run("ip", "-4", "-o", "addr", "show", "dev", tap).stdout
    assert f"inet {gateway} peer {address}/32" in shown, shown

    def guest_has(wanted: str) -> bool:
        shown = lab.kubectl("-n", lab.namespace, "exec", "vm-2", "--", "ip", "-4", "addr")
        return f"inet {wanted}/" in shown.stdout

    wait_for(lambda: guest_has(address), timeout=60, what=f"the guest given {address}")
    ping = ["busybox", "ping", "-c", "1", "-W", "5"]
    assert lab.target.host.run(*ping, address).returncode == 0
    lab.kubectl("-n", lab.namespace, "exec", "vm-2", "--", "ping", "-c", "1", "-W", "5", gateway)

    # deleting the target pod ends the domain there
    lab.kubectl("-n", lab.namespace, "delete", "pod", "vm-2", "--wait=true", "--timeout=90s")
    assert lab.target.host.virsh("list", "--all", "--name").stdout.split() == []


def test_an_imported_domain_moves_whole_to_the_other_host_keeping_its_identity(
    lab: Lab, vm_guest_image: Path, kube_cluster: Cluster
) -> None:
    """A domain defined with `virsh define` on the first host (a bridge NIC of its own),
    imported there by a VirtualMachine (deletionPolicy Delete), moves to the other host:
    refused first while that host lacks its bridge (the VM runs on at the source, the status
    saying which bridge; the target pod's pool and the copy libvirt made in it gone with its
    pod), then moved once the bridge is there: the same name, UUID and NIC, its disk copied
    whole, what the guest wrote and its uptime kept, no boot; the import claim names the target
    node, which records the domain for its deletion policy; the source's disk file is left in
    place. The target's agent restarted
    adopts it (same UUID, same QEMU). It moves back: the second host keeps nothing of it (its
    copy of the disk deleted). Deleting the VirtualMachine applies the policy on the host it
    lives on (undefined there) and leaves nothing of it on the other; both nodes' machine
    directories go, the disk files stay. Runs after the module's VM has left both
    hosts.

    No controller runs here: the test makes the pods as the controller does (its annotations);
    the VirtualMachine is what the machine GC asks about (its uid is the machine)."""
    source, target = lab.source.host, lab.target.host
    domain = f"site-{uuid.uuid4().hex[:6]}"
    disk = source.overlay(vm_guest_image, domain)
    bridge = f"brs{uuid.uuid4().hex[:5]}"
    source.run("ip", "link", "add", bridge, "type", "bridge")
    source.run("ip", "link", "set", bridge, "up")
    nic = f"<interface type='bridge'><source bridge='{bridge}'/><model type='virtio'/></interface>"
    xml = virtlab.guest_domain_xml(domain, disk).replace("<memballoon", f"{nic}<memballoon")
    xml_file = source.dir / f"{domain}.xml"
    xml_file.write_text(xml)
    source.virsh("define", str(xml_file))
    domain_uuid = source.virsh("domuuid", domain).stdout.strip()
    install_crds(kube_cluster)
    lab.apply(virtual_machine("imp", domain, "Delete"))
    machine = lab.kubectl.json("-n", lab.namespace, "get", "vm", "imp")["metadata"]["uid"]
    imported = {DOMAIN: domain, MACHINE: machine, POLICY: "Delete"}
    lab.apply(vm_pod("imp", lab.source.name, imported))
    wait_for(lambda: lab.running("imp"), timeout=300, interval=2, what="the imported VM Running")
    marker = uuid.uuid4().hex

    def guest(name: str, command: str) -> str:
        done = lab.kubectl("-n", lab.namespace, "exec", name, "--", "sh", "-c", command)
        return str(done.stdout)

    def uptime(name: str) -> float:
        return float(guest(name, "cut -d' ' -f1 /proc/uptime"))

    wait_for(
        lambda: lab.kubectl(
            "-n", lab.namespace, "exec", "imp", "--", "true", check=False
        ).returncode == 0,
        timeout=120,
        what="the guest agent",
    )  # fmt: skip
    guest("imp", f"echo {marker} > /root/imported && sync")

    # refused: the target host has no bridge of that name; the VM runs on at the source
    endpoint = lab.target_pod("imp-refused", "imp", imported)
    assert endpoint["libvirt"]["domain"] == domain and endpoint["libvirt"]["directory"]
    lab.migrate("imp-refused", endpoint, source="imp")
    wait_for(
        lambda: lab.condition("imp", MIGRATION).get("reason") == "Failed",
        timeout=120,
        what="the migration refused",
    )
    error = json.loads(lab.condition("imp", MIGRATION)["message"])["error"]
    print(f"refused: {error}")
    assert bridge in error, error
    assert source.running() == [domain] and lab.running("imp")
    assert target.virsh("list", "--all", "--name").stdout.split() == []
    lab.kubectl(
        "-n", lab.namespace, "delete", "pod", "imp-refused", "--wait=true", "--timeout=60s"
    )  # fmt: skip
    assert transient_pools(target) == []
    # ...with the copy libvirt had made in it (the size of the domain's disk)
    assert not Path(endpoint["libvirt"]["directory"]).exists()

    # moved, once the target host has the bridge
    target.run("ip", "link", "add", bridge, "type", "bridge")
    target.run("ip", "link", "set", bridge, "up")
    before = uptime("imp")
    earlier = lab.condition("imp", MIGRATION).get("message")
    endpoint = lab.target_pod("imp-2", "imp", imported)

    def outcome() -> bool:
        condition = lab.condition("imp", MIGRATION)
        ended = condition.get("reason") in ("Completed", "Failed")
        return ended and condition.get("message") != earlier

    lab.migrate("imp-2", endpoint, source="imp")
    wait_for(outcome, timeout=180, what="the imported domain's migration")
    result = lab.condition("imp", MIGRATION)
    assert result["reason"] == "Completed", result
    print(f"imported migration: {result['message']}")
    wait_for(lambda: lab.running("imp-2"), timeout=120, what="the target Running")

    assert source.virsh("list", "--all", "--name").stdout.split() == []
    assert target.running() == [domain]
    assert target.virsh("domuuid", domain).stdout.strip() == domain_uuid
    defined = target.virsh("dumpxml", domain).stdout
    assert f"<source bridge='{bridge}'/>" in defined
    copy = Path(endpoint["libvirt"]["directory"]) / "vda.qcow2"
    assert copy.parent == (lab.target.state / "imported" / lab.pod("imp-2")["metadata"]["uid"])
    assert f"<source file='{copy}'" in defined
    claim = target.virsh("metadata", domain, IMPORT_URI).stdout
    assert f'node="{lab.target.name}"' in claim and f'machine="{machine}"' in claim
    assert disk.exists()  # the source's file stays where it was
    assert transient_pools(target) == []
    assert guest("imp-2", "cat /root/imported").strip() == marker
    assert uptime("imp-2") > before  # the same guest, not booted again
    # its console history came along: the one boot, at the source, is in the target's log
    assert lab.logs("imp-2").count("vkubelet-guest: booted") == 1
    record = json.loads((lab.target.state / "machines" / machine / "import.json").read_text())
    assert record["uuid"] == domain_uuid and record["name"] == domain
    assert record["policy"] == "Delete"

    # the target's agent restarted adopts the moved domain: the same UUID and QEMU, the pod
    # Running in the same run, exec through the new agent
    domain_id, qemu = target.virsh("domid", domain).stdout.strip(), target_qemu(lab, domain)
    lab.target.restart()
    wait_for(lambda: node_ready(lab.kubectl, lab.target.name), timeout=90, what="target Ready")
    wait_for(
        lambda: lab.target.agent.log().count("listening on port") >= 2,
        timeout=60,
        what="the restarted agent's kubelet API",
    )
    wait_for(
        lambda: lab.kubectl(
            "-n", lab.namespace, "exec", "imp-2", "--", "cat", "/root/imported", check=False
        ).stdout.strip() == marker,
        timeout=60,
        what="exec after the target's agent restart",
    )  # fmt: skip
    assert target.running() == [domain]
    assert target.virsh("domuuid", domain).stdout.strip() == domain_uuid
    assert target.virsh("domid", domain).stdout.strip() == domain_id
    assert target_qemu(lab, domain) == qemu
    status = lab.pod("imp-2")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"]

    # it moves on, back to the first host (the migrated source pod deleted first, as the
    # controller does: the machine is free there again): the second host keeps nothing of it,
    # its copy of the disk deleted with the definition
    lab.kubectl("-n", lab.namespace, "delete", "pod", "imp", "--wait=true", "--timeout=60s")
    endpoint = lab.target_pod("imp-3", "imp-2", imported, node=lab.source.name)
    lab.migrate("imp-3", endpoint, source="imp-2")
    wait_for(
        lambda: lab.condition("imp-2", MIGRATION).get("reason") in ("Completed", "Failed"),
        timeout=180,
        what="the move back",
    )
    result = lab.condition("imp-2", MIGRATION)
    assert result["reason"] == "Completed", result
    wait_for(lambda: lab.running("imp-3"), timeout=120, what="imp-3 Running")
    assert target.virsh("list", "--all", "--name").stdout.split() == []
    assert transient_pools(target) == []
    assert not copy.parent.exists()
    assert source.running() == [domain]
    assert source.virsh("domuuid", domain).stdout.strip() == domain_uuid
    back = Path(endpoint["libvirt"]["directory"]) / "vda.qcow2"
    assert back.parent == lab.source.state / "imported" / lab.pod("imp-3")["metadata"]["uid"]
    assert guest("imp-3", "cat /root/imported").strip() == marker

    # deleting its pod shuts the domain off there, still defined (it is the site's)
    lab.kubectl("-n", lab.namespace, "delete", "pod", "imp-3", "--wait=true", "--timeout=90s")
    assert source.running() == []
    assert source.virsh("list", "--all", "--name").stdout.split() == [domain]
    assert back.exists()  # its disk, which outlives the pod

    # deleting the VirtualMachine (the migrated pod first, as the controller deletes it): the
    # machine GC applies Delete on the host the domain lives on; the other host has nothing of
    # it; no transient pool anywhere; the disk files stay
    lab.kubectl("-n", lab.namespace, "delete", "pod", "imp-2", "--wait=true", "--timeout=60s")
    lab.kubectl("-n", lab.namespace, "delete", "vm", "imp", "--wait=true", "--timeout=60s")
    machines = [node.state / "machines" / machine for node in (lab.source, lab.target)]

    def collected() -> bool:
        return not any(directory.exists() for directory in machines)

    wait_for(collected, timeout=60, what="both nodes' machine GC")
    for host in (source, target):
        assert host.virsh("list", "--all", "--name").stdout.split() == [], host.dir
        assert transient_pools(host) == [], host.dir
    assert back.exists() and disk.exists()


def test_agents_killed_mid_migration_come_back_to_the_move_libvirt_finished(lab: Lab) -> None:
    """Both nodes' agents SIGKILLed while libvirt copies the VM (its bandwidth held at
    4 MiB/s, so the copy takes ~20 s): the source host's daemon goes on with the peer to peer
    migration its dead client started, and the target host's daemon takes the domain in
    without any agent. The restarted source agent follows libvirt's job, the restarted target
    agent waits for the domain again under the endpoint it had published: the source pod's
    Migration condition Completed and its run ended Migrated (never booted again there), the
    target pod Running with the domain in its first run, its log beginning with the source's
    console history, the same guest (its boot id), `virsh list` on each host exactly the
    running domain. Before that, a move of the same VM that libvirt abandons while the source's
    agent is away (its job aborted with `virsh domjobabort`): the restarted agent says Failed,
    the VM running on at the source (the same boot), and the target pod, which saw the domain
    come in and go, fails saying why. Runs last: its VM is the module's second boot."""
    moved = f"{lab.namespace}_lvk-2"
    lab.apply(vm_pod("lvk", lab.source.name))
    wait_for(lambda: lab.running("lvk"), timeout=300, interval=2, what="the VM Running")

    def guest(name: str, command: str) -> str:
        done = lab.kubectl("-n", lab.namespace, "exec", name, "--", "sh", "-c", command)
        return str(done.stdout).strip()

    boot_id = guest("lvk", "cat /proc/sys/kernel/random/boot_id")

    def copying() -> bool:
        condition = lab.condition("lvk", MIGRATION)
        return condition.get("reason") == "Running" and bool(
            json.loads(condition["message"]).get("progress")
        )

    def ended(earlier: str | None) -> bool:
        condition = lab.condition("lvk", MIGRATION)
        done = condition.get("reason") in ("Completed", "Failed")
        return done and condition.get("message") != earlier

    # abandoned by libvirt while the source's agent is away
    endpoint = lab.target_pod("lvk-x", "lvk")
    lab.migrate("lvk-x", {**endpoint, "maxBandwidth": 4 * 2**20}, source="lvk")
    wait_for(copying, timeout=120, interval=0.5, what="libvirt copying the VM")
    lab.source.agent.stop(signal.SIGKILL)
    lab.source.host.virsh("domjobabort", f"{lab.namespace}_lvk")
    lab.source.agent = lab.source.start()
    wait_for(lambda: ended(None), timeout=120, what="the restarted source's word")
    failed = lab.condition("lvk", MIGRATION)
    print(f"abandoned: {failed['reason']} {failed['message']}")
    assert failed["reason"] == "Failed" and "without moving the VM" in failed["message"], failed

    def target_failed() -> str:  # (its run then starts again as a new target, as on QEMU)
        events = lab.kubectl(
            "-n", lab.namespace, "get", "events", "-o", "jsonpath={.items[*].message}",
            "--field-selector", "involvedObject.name=lvk-x,reason=MigrationFailed",
        )  # fmt: skip
        return str(events.stdout)

    said = wait_for(target_failed, timeout=60, what="the target that never got the domain failed")
    print(f"the target: {said}")
    assert "went away before it ran here" in said, said
    assert f"{lab.namespace}_lvk" in lab.source.host.running() and lab.running("lvk")
    assert f"{lab.namespace}_lvk-x" not in lab.target.host.virsh("list", "--all", "--name").stdout
    wait_for(
        lambda: lab.kubectl(
            "-n", lab.namespace, "exec", "lvk", "--", "cat", "/proc/sys/kernel/random/boot_id",
            check=False,
        ).stdout.strip() == boot_id,
        timeout=60,
        what="the same guest at the source, through the restarted agent",
    )  # fmt: skip
    lab.kubectl("-n", lab.namespace, "delete", "pod", "lvk-x", "--wait=true", "--timeout=60s")
    earlier = str(failed["message"])

    # finished by libvirt while both agents are away
    endpoint = lab.target_pod("lvk-2", "lvk")
    lab.migrate("lvk-2", {**endpoint, "maxBandwidth": 4 * 2**20}, source="lvk")
    wait_for(copying, timeout=120, interval=0.5, what="libvirt copying the VM")
    lab.source.agent.stop(signal.SIGKILL)
    lab.target.agent.stop(signal.SIGKILL)
    lab.source.agent, lab.target.agent = lab.source.start(), lab.target.start()
    # killed mid-copy: the domain was still at the source, the target's still coming in
    assert f"{lab.namespace}_lvk" in lab.source.host.running()
    incoming = lab.target.host.virsh("domstate", "--reason", moved).stdout.strip()
    print(f"after the SIGKILL: the target's domain is {incoming}")
    assert incoming.startswith("paused"), incoming

    wait_for(lambda: ended(earlier), timeout=180, what="the restarted agents' word")
    result = lab.condition("lvk", MIGRATION)
    print(f"after the restart: {result['reason']} {result['message']}")
    assert result["reason"] == "Completed", result
    wait_for(lambda: lab.running("lvk-2"), timeout=120, what="the target Running")
    status = lab.pod("lvk")["status"]["containerStatuses"][0]
    assert status["state"]["terminated"]["reason"] == "Migrated", status
    assert status["restartCount"] == 0, status
    assert lab.condition("lvk-2", TARGET_READY)["reason"] == "Completed"
    assert lab.pod("lvk-2")["status"]["containerStatuses"][0]["restartCount"] == 0
    assert lab.logs("lvk-2").count("vkubelet-guest: booted hostname=lvk") == 1
    assert f"{lab.namespace}_lvk" not in lab.source.host.virsh("list", "--all", "--name").stdout
    assert lab.target.host.running() == [moved]
    assert guest("lvk-2", "cat /proc/sys/kernel/random/boot_id") == boot_id
