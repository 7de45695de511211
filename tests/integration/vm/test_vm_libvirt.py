"""The vm provider's libvirt runtime (issue 29) against a libvirt "host" of the lab
(`vkubelet.testing.virtlab`: a libvirtd and an sshd in a network namespace of their own),
reached over `qemu+ssh` as a remote hypervisor is.

One VM is booted for the module (TCG boots are the expensive part) and the test checks what it can
on it, in order: Running, the boot in `kubectl logs`, `kubectl exec`, `kubectl attach` on the
serial console, the domain in `virsh list` on that host named after the pod and labelled with its
UID, live resize through libvirt (1 -> 2 vCPUs and +512 MiB: the guest's `nproc` and MemTotal in
the same boot, the status, `virsh vcpucount` and `dominfo`; less memory deferred; a DIMM libvirt
refuses is ResizeFailed with its words; the root disk grown), an agent killed with SIGKILL and
restarted adopts the same domain (same id, same QEMU, the resized size), the host's libvirtd
restarted under it (the agent reconnects: exec, and the console's new lines in the log), a PVC disk
(found by its serial, written and synced), backups through libvirt's backup API (a full and an
incremental one, restored to a second VM that reads what the guest wrote before each), hibernation
(libvirt's managed save: the domain shut off with its image, its name and metadata kept, through an
agent restart) and the resume by the machine's next pod (what the guest kept in RAM is there, its
uptime continued, the plugged vCPU and DIMM too, the claim's data read back from its disk with the
page cache dropped, its interface carrying the new pod's address: the hypervisor pings it), an
agent stopped with SIGTERM while the domain runs exits cleanly and leaves it running for the next
one, and deleting that pod removes the domain. The refusals cost no boot: a domain of a pod's name
that vkubelet does not own fails that pod and is left alone; a URI whose credentials are refused
makes a node NotReady with libvirt's message.

A domain defined with `virsh define` (the test guest, no seed) is imported with `vkubelet vm
import` and boots twice (import, then replicas 0 -> 1); the refused imports run beside it. It
has a NIC of its own: its pod's IP is the guest's address (none until the guest has one).
"""

from __future__ import annotations

import contextlib
import json
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.sdk.quantity import parse_quantity
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    delete_namespace,
    local_test_address,
    node_ready,
    terminal_session,
    virtlab,
    wait_for,
)
from vkubelet.testing.virtlab import LibvirtHost

from .vmlab import TOLERATION, clean_up, install_crds, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300  # one TCG boot on a busy 2-core machine
METADATA = "https://vkubelet.io/xmlns/vm-domain/1"
NETWORK = "https://vkubelet.io/xmlns/vm-network/1"  # the pod's network (`_lvnet`)


@dataclass
class LibvirtNode:
    name: str
    agent: AgentProcess
    workdir: Path
    host: LibvirtHost
    restart: Callable[..., AgentProcess]  # (machine_gc=True: with the machine GC on)
    refused_node: str  # a node whose URI has a key the host does not know

    def domain_pid(self, domain: str) -> int:
        """The host's QEMU of `domain`, from libvirt's own pid file on that host."""
        return int((self.host.dir / "run" / "qemu" / f"{domain}.pid").read_text().strip())


@pytest.fixture(scope="module")
def libvirt_node(
    kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path
) -> Iterator[LibvirtNode]:
    require_vm_host()
    if (why := virtlab.libvirt_lab_unavailable()) is not None:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="vklv-", dir="/tmp"))
    name = f"lv-{uuid.uuid4().hex[:6]}"
    cidr = f"10.213.{random.randrange(1, 250)}.0/24"  # noqa: S311
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)  # last: after the lab's end
        (host,) = stack.enter_context(virtlab.libvirt_lab(1, workdir / "lab"))
        address = stack.enter_context(local_test_address())
        # The refused node's agent starts first and alongside: its test then costs no wait.
        refused_dir = workdir / "refused"
        refused_dir.mkdir()
        wrong = refused_dir / "wrong.key"  # a key the host does not know
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)]
        subprocess.run(keygen, check=True, capture_output=True, timeout=30)
        refused_uri = host.ssh_uri.replace(str(host.key_path), str(wrong))
        refused_agent = start_vm_agent(
            kube_cluster, refused_dir, name=f"{name}-refused", address=address,
            cidr="10.213.250.0/24", image=vm_guest_image, runtime="libvirt",
            libvirt={"uri": f"{refused_uri}&no_tty=1"},
        )  # fmt: skip
        stack.callback(kubectl, "delete", "node", f"{name}-refused", "--wait=false", check=False)
        stack.callback(refused_agent.stop)
        settings: dict[str, Any] = {
            "runtime": "libvirt",
            "libvirt": {"uri": f"{host.ssh_uri}&no_tty=1"},
            "guestAgentTimeoutSeconds": 300,
            "storage": {"kubeconfig": str(kube_cluster.kubeconfig), "intervalSeconds": 1},
        }

        def start(machine_gc: bool = False) -> AgentProcess:
            # Off by default: it would collect the first test's machine (no VirtualMachine)
            # between its pods; the import test, the module's last, turns it on.
            gc = {"kubeconfig": str(kube_cluster.kubeconfig), "intervalSeconds": 1}
            return start_vm_agent(
                kube_cluster, workdir, name=name, address=address, cidr=cidr,
                image=vm_guest_image, **settings, **({"machineGC": gc} if machine_gc else {}),
            )  # fmt: skip

        node = LibvirtNode(name, start(), workdir, host, start, f"{name}-refused")
        try:
            wait_for(lambda: node_ready(kubectl, name), timeout=90, what=f"node {name} Ready")
            yield node
        finally:
            node.agent.stop()
            clean_up(workdir / "state", cidr)
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


def _pod(
    name: str, node: str, annotations: dict[str, str] | None = None, *, claim: str | None = None
) -> dict[str, Any]:
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}] if claim else []
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 30,
            "volumes": volumes,
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }


CLAIM = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "data"},
    "spec": {
        "storageClassName": "vkubelet-vm-disk",
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "16Mi"}},
    },
}
FIND_CLAIM = (  # the PVC's disk, by its serial (the claim's name)
    'for d in /sys/block/*; do [ "$(cat $d/serial 2>/dev/null)" = data ] && echo ${d##*/}; done'
)


def _get(kubectl: Kubectl, namespace: str, pod: str) -> dict[str, Any]:
    result: dict[str, Any] = kubectl.json("-n", namespace, "get", "pod", pod)
    return result


def _managed_save(host: LibvirtHost, domain: str) -> str:
    """`virsh dominfo`'s "Managed save:" (yes or no)."""
    for line in host.virsh("dominfo", domain).stdout.splitlines():
        if line.startswith("Managed save:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no managed save line for {domain}")


def _running(kubectl: Kubectl, namespace: str, pod: str) -> bool:
    statuses = _get(kubectl, namespace, pod).get("status", {}).get("containerStatuses") or []
    return bool(statuses and statuses[0].get("state", {}).get("running"))


def test_a_vm_pod_is_a_domain_on_the_remote_host_adopted_after_a_crash_and_gone_with_the_pod(
    libvirt_node: LibvirtNode, kubectl: Kubectl
) -> None:
    namespace = create_namespace(kubectl, f"lv-{uuid.uuid4().hex[:6]}")
    host, pod = libvirt_node.host, "guest"
    domain = f"{namespace}_{pod}"
    # a persistent machine's pod (as the VirtualMachine controller makes them), to hibernate
    machine = {"vm.vkubelet.io/machine": f"m-{uuid.uuid4().hex[:8]}"}
    hibernating = _pod(
        pod, libvirt_node.name, {**machine, "vm.vkubelet.io/power-off": "Hibernate"}, claim="data"
    )
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(CLAIM))
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(hibernating))
    wait_for(lambda: _running(kubectl, namespace, pod), timeout=BOOT_TIMEOUT, what="the VM Running")
    uid = _get(kubectl, namespace, pod)["metadata"]["uid"]

    # the node's capacity is the hypervisor's (virNodeGetInfo), less the 1 GiB reserved
    nodeinfo = dict(
        line.split(":", 1) for line in host.virsh("nodeinfo").stdout.splitlines() if ":" in line
    )
    memory = int(nodeinfo["Memory size"].split()[0]) // 1024 * 2**20 - 2**30  # MiB, less 1Gi
    capacity = kubectl.json("get", "node", libvirt_node.name)["status"]["capacity"]
    assert capacity["cpu"] == nodeinfo["CPU(s)"].strip()
    assert parse_quantity(capacity["memory"]).to_fraction() == memory

    # kubectl logs is the serial console through libvirt's stream, from the first boot line
    logs = kubectl("-n", namespace, "logs", pod).stdout
    assert f"vkubelet-guest: booted hostname={pod}" in logs
    # kubectl exec goes through libvirt's guest agent command
    assert kubectl("-n", namespace, "exec", pod, "--", "cat", "/etc/hostname").stdout.strip() == pod

    # kubectl attach is the serial console both ways, through libvirt's console stream
    argv = [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "-n", namespace]
    attach = shlex.join([*argv, "attach", "-it", pod])
    with terminal_session(f"{attach}; sleep 60", cols=400) as terminal:

        def echoed() -> bool:
            # kubectl attach prints nothing until the console does: type until it is connected.
            terminal.type("echo ATTACHED-$((6 * 7))")
            return "ATTACHED-42" in terminal.screen()

        wait_for(echoed, timeout=30, interval=2, what="the console's echo")

    # the host's own libvirt shows it, named after the pod, labelled with its UID
    assert host.running() == [domain]
    metadata = host.virsh("metadata", domain, METADATA).stdout
    assert f'uid="{uid}"' in metadata and f'node="{libvirt_node.name}"' in metadata
    domain_id, qemu = host.virsh("domid", domain).stdout.strip(), libvirt_node.domain_pid(domain)

    # live resize through libvirt (setVcpusFlags, a DIMM attached): 1 -> 2 vCPUs, +512 MiB
    grown = _resize_live(kubectl, host, namespace, pod, domain, libvirt_node.workdir)

    # an agent killed and started again adopts the same domain: same id, same QEMU
    libvirt_node.agent.stop(signal.SIGKILL)
    libvirt_node.agent = libvirt_node.restart()
    wait_for(lambda: node_ready(kubectl, libvirt_node.name), timeout=90, what="node Ready again")
    wait_for(
        lambda: libvirt_node.agent.log().count("listening on port") >= 2,
        timeout=60,
        what="the restarted agent's kubelet API",
    )

    def exec_answers() -> bool:
        done = kubectl("-n", namespace, "exec", pod, "--", "cat", "/proc/uptime", check=False)
        return done.returncode == 0

    wait_for(exec_answers, timeout=60, what="exec after the restart")
    assert host.running() == [domain]
    assert host.virsh("domid", domain).stdout.strip() == domain_id
    assert libvirt_node.domain_pid(domain) == qemu
    status = _get(kubectl, namespace, pod)["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"]
    assert kubectl("-n", namespace, "logs", pod).stdout.count("booted hostname=") == 1
    # ...with its size: the status and the guest as resized, nothing plugged again
    assert _limits(kubectl, namespace, pod) == {"cpu": "2", "memory": "768Mi"}
    assert _sh(kubectl, namespace, pod, "nproc") == "2"
    assert _mem_total_kib(kubectl, namespace, pod) == grown
    assert _vcpucount(host, domain) == {"current live": 2, "current config": 2, **MAX_VCPUS}

    # the host's libvirtd restarted under it: the domain runs on, the agent connects again
    host.restart_libvirtd()

    def marked_after_restart() -> bool:
        mark = "echo MARK-AFTER-LIBVIRTD >/dev/console"
        kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", mark, check=False)
        return "MARK-AFTER-LIBVIRTD" in kubectl("-n", namespace, "logs", pod).stdout

    wait_for(marked_after_restart, timeout=60, interval=2, what="exec and logs after libvirtd")
    assert host.virsh("domid", domain).stdout.strip() == domain_id

    # the PVC is a disk of the domain, found by its serial; what the guest writes on it is synced
    claim_disk = kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", FIND_CLAIM).stdout.strip()
    assert claim_disk.startswith("vd"), claim_disk
    on_claim = f"claim-{uuid.uuid4().hex[:8]}"
    write = f"echo {on_claim} | dd of=/dev/{claim_disk} bs=512 conv=sync && sync"
    kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", write)

    # backups through libvirt's backup API, full then incremental, restored to a new VM
    _backed_up_and_restored(libvirt_node, kubectl, namespace, pod)

    # hibernate: what the guest keeps in RAM (/run is a tmpfs) and its uptime before
    marker = uuid.uuid4().hex
    keep = f"echo {marker} > /run/marker; cut -d' ' -f1 /proc/uptime"
    uptime = float(kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", keep).stdout)
    kubectl("-n", namespace, "delete", "pod", pod, "--wait=true", "--timeout=90s")
    hibernated = kubectl.json(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={pod}"
    )["items"]
    assert any(e["reason"] == "Hibernated" and "managed save" in e["message"] for e in hibernated)

    def saved_domain() -> None:
        """Shut off with a managed save image, its name and metadata kept."""
        assert host.running() == []
        assert host.virsh("list", "--all", "--name").stdout.split() == [domain]
        assert host.virsh("domstate", "--reason", domain).stdout.strip() == "shut off (saved)"
        assert _managed_save(host, domain) == "yes"
        assert f'uid="{uid}"' in host.virsh("metadata", domain, METADATA).stdout

    saved_domain()
    # an agent restart while hibernated keeps it hibernated
    libvirt_node.agent.stop()
    libvirt_node.agent = libvirt_node.restart()
    wait_for(lambda: node_ready(kubectl, libvirt_node.name), timeout=90, what="node Ready again")
    saved_domain()

    # the machine's next pod (another name, as the controller's are) resumes the same domain
    resumed = "guest-2"
    kubectl(
        "-n", namespace, "apply", "-f", "-",
        input=json.dumps(_pod(resumed, libvirt_node.name, machine, claim="data")),
    )  # fmt: skip
    wait_for(lambda: _running(kubectl, namespace, resumed), timeout=120, what="the VM resumed")
    after = "cat /run/marker; cut -d' ' -f1 /proc/uptime"
    kept, now = kubectl("-n", namespace, "exec", resumed, "--", "sh", "-c", after).stdout.split()
    assert kept == marker and float(now) > uptime
    # the claim's data came through the domain's power cycle on its disk (the page cache
    # dropped: read from the file, not from the restored RAM)
    read = f"echo 3 > /proc/sys/vm/drop_caches; head -c {len(on_claim)} /dev/{claim_disk}"
    assert kubectl("-n", namespace, "exec", resumed, "--", "sh", "-c", read).stdout == on_claim
    assert _sh(kubectl, namespace, resumed, "nproc") == "2"  # the plugged vCPU came back too
    assert _mem_total_kib(kubectl, namespace, resumed) == grown
    assert "booted hostname=" not in kubectl("-n", namespace, "logs", resumed).stdout
    events = kubectl.json(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={resumed}"
    )["items"]
    assert any(e["reason"] == "Resumed" for e in events), [e["reason"] for e in events]
    assert host.running() == [domain]  # libvirt renames no saved domain: the name stays
    new_uid = _get(kubectl, namespace, resumed)["metadata"]["uid"]
    metadata = host.virsh("metadata", domain, METADATA).stdout
    assert f'uid="{new_uid}"' in metadata and f'name="{resumed}"' in metadata
    assert _managed_save(host, domain) == "no"
    # the restored interface carries the new pod's address: the hypervisor reaches the guest
    address = _get(kubectl, namespace, resumed)["status"]["podIP"]
    assert f'address="{address}"' in host.virsh("metadata", domain, NETWORK).stdout
    assert host.run("busybox", "ping", "-c", "1", "-W", "5", address).returncode == 0

    # SIGTERM of an agent with a domain running: a clean exit within its stop bound, the
    # domain runs on (same id), and the next agent adopts it
    domain_id = host.virsh("domid", domain).stdout.strip()
    stopping = time.monotonic()
    libvirt_node.agent.stop()
    assert libvirt_node.agent.proc is not None and libvirt_node.agent.proc.returncode == 0
    assert time.monotonic() - stopping < 10, "the agent's stop took longer than its bound"
    assert host.running() == [domain] and host.virsh("domid", domain).stdout.strip() == domain_id
    libvirt_node.agent = libvirt_node.restart()

    def marker_read() -> bool:  # the node's old port is refused until the new agent's is in
        done = kubectl("-n", namespace, "exec", resumed, "--", "cat", "/run/marker", check=False)
        return done.returncode == 0 and done.stdout.strip() == marker

    wait_for(marker_read, timeout=90, what="exec on the adopted domain after the restart")

    # deleting the pod ends the domain and removes its definition
    kubectl("-n", namespace, "delete", "pod", resumed, "--wait=true", "--timeout=90s")
    assert host.running() == []
    assert host.virsh("list", "--all", "--name").stdout.split() == []


MAX_VCPUS = {"maximum live": 4, "maximum config": 4}  # the config's hotplug.maxCpus


def _sh(kubectl: Kubectl, namespace: str, pod: str, command: str) -> str:
    return kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", command).stdout.strip()


def _mem_total_kib(kubectl: Kubectl, namespace: str, pod: str) -> int:
    return int(_sh(kubectl, namespace, pod, "grep MemTotal /proc/meminfo").split()[1])


def _limits(kubectl: Kubectl, namespace: str, pod: str) -> dict[str, str]:
    status = _get(kubectl, namespace, pod)["status"]["containerStatuses"][0]
    return dict((status.get("resources") or {}).get("limits") or {})


def _vcpucount(host: LibvirtHost, domain: str) -> dict[str, int]:
    """`virsh vcpucount`: {"maximum live": 4, "current config": 2, ...}."""
    lines = [line.split() for line in host.virsh("vcpucount", domain).stdout.splitlines()]
    return {f"{kind} {where}": int(count) for kind, where, count in filter(None, lines)}


def _dominfo(host: LibvirtHost, domain: str) -> dict[str, str]:
    lines = host.virsh("dominfo", domain).stdout.splitlines()
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines) if v}


def _pending(kubectl: Kubectl, namespace: str, pod: str) -> dict[str, Any] | None:
    for c in _get(kubectl, namespace, pod)["status"].get("conditions", []):
        if c["type"] == "PodResizePending" and c["status"] == "True":
            return dict(c)
    return None


def _resize_live(
    kubectl: Kubectl, host: LibvirtHost, namespace: str, pod: str, domain: str, workdir: Path
) -> int:
    """1 -> 2 vCPUs and 256 -> 768 MiB on the running domain: the guest sees them in the same
    boot, the status reports them, libvirt's own view (live and the definition) agrees; less
    memory is then deferred to the next power cycle, as with QEMU; a DIMM libvirt refuses is a
    ResizeFailed, the domain running on; the root disk grows to 2 GiB. The guest's MemTotal
    after."""
    assert _sh(kubectl, namespace, pod, "nproc") == "1"
    memory_before = _mem_total_kib(kubectl, namespace, pod)
    boot_id = _sh(kubectl, namespace, pod, "cat /proc/sys/kernel/random/boot_id")

    def resize(cpu: str, memory: str) -> None:
        size = {"cpu": cpu, "memory": memory}
        resources = {"requests": size, "limits": size}  # (the pod's QoS class stays)
        patch = {"spec": {"containers": [{"name": "vm", "resources": resources}]}}
        kubectl(
            "-n", namespace, "patch", "pod", pod, "--subresource", "resize", "-p",
            json.dumps(patch),
        )  # fmt: skip

    resize("2", "768Mi")
    wait_for(
        lambda: _limits(kubectl, namespace, pod) == {"cpu": "2", "memory": "768Mi"},
        timeout=120,
        what="status resources = the new size",
    )
    assert _sh(kubectl, namespace, pod, "nproc") == "2"
    memory = _mem_total_kib(kubectl, namespace, pod)
    assert 500 * 1024 <= memory - memory_before <= 520 * 1024, memory - memory_before
    assert _sh(kubectl, namespace, pod, "cat /proc/sys/kernel/random/boot_id") == boot_id
    assert _vcpucount(host, domain) == {"current live": 2, "current config": 2, **MAX_VCPUS}
    info = _dominfo(host, domain)
    assert info["CPU(s)"] == "2" and info["Max memory"] == f"{768 * 1024} KiB", info
    dimms = host.virsh("dumpxml", "--inactive", domain).stdout.count("<memory model='dimm'>")
    assert dimms == 1  # in the definition too
    events = kubectl.json(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={pod}"
    )["items"]
    assert any(e["reason"] == "Resized" for e in events), [e["reason"] for e in events]

    resize("2", "512Mi")  # less memory: not live, as on QEMU
    pending = wait_for(lambda: _pending(kubectl, namespace, pod), timeout=60, what="pending")
    assert pending["reason"] == "Deferred" and "applied at next power cycle" in pending["message"]
    resize("2", "768Mi")  # back to what runs: nothing pending any more
    wait_for(lambda: _pending(kubectl, namespace, pod) is None, timeout=60, what="not pending")
    assert _mem_total_kib(kubectl, namespace, pod) == memory

    # a DIMM libvirt refuses (the free slots taken behind vkubelet's back): ResizeFailed with
    # libvirt's words, the domain running on at the size it had; asked back, nothing is wrong
    by_hand = workdir / "dimm.xml"
    by_hand.write_text("<memory model='dimm'><target><size unit='MiB'>128</size>"
                       "<node>0</node></target></memory>")  # fmt: skip
    for _ in range(3):  # 1 plugged by vkubelet + 3 by hand = the 4 slots
        host.virsh("attach-device", domain, str(by_hand), "--live")
    resize("2", "896Mi")

    def refused() -> dict[str, Any] | None:
        for c in _get(kubectl, namespace, pod)["status"].get("conditions", []):
            if c["type"] == "PodResizeInProgress" and c.get("reason") == "Error":
                return dict(c) if c["status"] == "True" else None
        return None

    failed = wait_for(refused, timeout=60, what="PodResizeInProgress Error")
    assert "live resize failed: libvirt qemu+ssh://" in failed["message"], failed
    events = kubectl.json(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={pod}"
    )["items"]
    assert any(e["reason"] == "ResizeFailed" and e["type"] == "Warning" for e in events)
    assert _limits(kubectl, namespace, pod) == {"cpu": "2", "memory": "768Mi"}
    assert _mem_total_kib(kubectl, namespace, pod) == memory  # (running on, as it was)
    resize("2", "768Mi")
    wait_for(lambda: refused() is None, timeout=60, what="no resize error")

    # a bigger root disk (virDomainBlockResize): the guest sees it at once
    assert int(_sh(kubectl, namespace, pod, "cat /sys/block/vda/size")) < 2 * 2**30 // 512
    kubectl("-n", namespace, "annotate", "pod", pod, "vm.vkubelet.io/root-disk-size=2Gi")
    wait_for(
        lambda: _sh(kubectl, namespace, pod, "cat /sys/block/vda/size") == str(2 * 2**30 // 512),
        timeout=60,
        what="the guest sees a 2 GiB disk",
    )
    return memory


def _backup_pod(
    node: str, kubectl: Kubectl, namespace: str, name: str, of: str, directory: Path
) -> dict[str, Any]:
    """A backup pod as the VirtualMachineBackup controller makes it, run to its end."""
    backup = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {
                "vm.vkubelet.io/backup-of": of,
                "vm.vkubelet.io/backup-target": json.dumps({"directory": str(directory)}),
            },
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "tolerations": [TOLERATION],
            "containers": [{"name": "backup", "image": "vm.vkubelet.io/backup"}],
        },
    }
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(backup))

    def ended() -> dict[str, Any] | None:
        found = _get(kubectl, namespace, name)
        return found if found["status"].get("phase") in ("Succeeded", "Failed") else None

    result: dict[str, Any] = wait_for(ended, timeout=120, what=f"backup pod {name} ended")
    return result


def _backed_up_and_restored(
    node: LibvirtNode, kubectl: Kubectl, namespace: str, pod: str, domain: str | None = None
) -> None:
    """A file written, a full backup, another file, an incremental backup (each a libvirt
    push backup with a checkpoint, the guest frozen by libvirt), then a new VM restored from
    the chain reads both; a target outside the backup directories is refused, the VM runs on
    and no checkpoint is left of it. The VM's domain keeps its one checkpoint, so the
    hibernation and the removal after this run with one."""
    host, domain = node.host, domain or f"{namespace}_{pod}"
    target = node.workdir / "state" / "backups"  # the default backupDirectories
    write = "echo {0} > /root/{0} && sync"
    kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", write.format("one"))
    full = _backup_pod(node.name, kubectl, namespace, "backup-1", pod, target)
    kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", write.format("two"))
    incremental = _backup_pod(node.name, kubectl, namespace, "backup-2", pod, target)
    results = []
    for done in (full, incremental):
        terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
        assert done["status"]["phase"] == "Succeeded", terminated
        results.append(json.loads(terminated["message"]))
    assert [r["kind"] for r in results] == ["full", "incremental"]
    assert all(r["consistency"] == "filesystem-consistent" for r in results), results
    assert results[1]["sizeBytes"] < results[0]["sizeBytes"] / 2, results
    logs = kubectl("-n", namespace, "logs", "backup-2").stdout
    assert "guest filesystems frozen" in logs and "done: incremental" in logs, logs
    # one checkpoint per chain: the latest backup's, on the domain of the host
    checkpoints = host.virsh("checkpoint-list", domain, "--name").stdout.split()
    assert len(checkpoints) == 1 and checkpoints[0].endswith("-0002"), checkpoints

    # a target outside the node's backup directories: refused, nothing made, the VM runs on
    refused = _backup_pod(node.name, kubectl, namespace, "backup-bad", pod, Path("/etc/vkb-nope"))
    terminated = refused["status"]["containerStatuses"][0]["state"]["terminated"]
    assert refused["status"]["phase"] == "Failed" and terminated["reason"] == "TargetRefused"
    assert "backupDirectories" in terminated["message"]
    assert host.virsh("checkpoint-list", domain, "--name").stdout.split() == checkpoints
    assert host.running() == [domain]

    # a new VM from the chain (the manifest: its latest backup) has both files
    manifest = Path(results[1]["path"]).parent / "manifest.json"
    restored = _pod("restored", node.name, {"vm.vkubelet.io/restore-from": str(manifest)})
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(restored))
    wait_for(
        lambda: _running(kubectl, namespace, "restored"), timeout=BOOT_TIMEOUT, what="restored"
    )
    both = kubectl("-n", namespace, "exec", "restored", "--", "cat", "/root/one", "/root/two")
    assert both.stdout.split() == ["one", "two"]
    kubectl("-n", namespace, "delete", "pod", "restored", "--wait=true", "--timeout=90s")
    for name in ("backup-1", "backup-2", "backup-bad"):
        kubectl("-n", namespace, "delete", "pod", name, "--wait=false")
    assert host.running() == [domain]


def test_a_domain_of_the_pod_s_name_that_vkubelet_does_not_own_fails_the_pod_untouched(
    libvirt_node: LibvirtNode, kubectl: Kubectl, vm_guest_image: Path
) -> None:
    namespace = create_namespace(kubectl, f"lv-{uuid.uuid4().hex[:6]}")
    host, pod = libvirt_node.host, "clash"
    domain = f"{namespace}_{pod}"
    disk = host.overlay(vm_guest_image, domain)
    xml = virtlab.guest_domain_xml(domain, disk)
    (libvirt_node.workdir / "clash.xml").write_text(xml)
    host.virsh("define", str(libvirt_node.workdir / "clash.xml"))
    before = host.virsh("dumpxml", domain).stdout
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(_pod(pod, libvirt_node.name)))

    def refused() -> dict[str, Any] | None:
        statuses = _get(kubectl, namespace, pod).get("status", {}).get("containerStatuses") or []
        waiting = statuses[0].get("state", {}).get("waiting") if statuses else None
        return waiting if waiting and waiting.get("reason") == "DomainExists" else None

    waiting = wait_for(refused, timeout=60, what="the pod refused with DomainExists")
    assert domain in waiting["message"] and "not this pod's" in waiting["message"]
    events = kubectl.json(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={pod}"
    )
    assert any(e["type"] == "Warning" and domain in e["message"] for e in events["items"]), events[
        "items"
    ]
    # the domain is as it was: defined, not started, its XML unchanged
    assert host.virsh("domstate", domain).stdout.strip() == "shut off"
    assert host.virsh("dumpxml", domain).stdout == before
    kubectl("-n", namespace, "delete", "pod", pod, "--wait=true", "--timeout=60s")
    assert domain in host.virsh("list", "--all", "--name").stdout.split()
    host.virsh("undefine", domain)


def test_refused_credentials_make_the_node_not_ready_with_libvirt_s_message(
    libvirt_node: LibvirtNode, kubectl: Kubectl
) -> None:
    def not_ready() -> str | None:
        found = kubectl("get", "node", libvirt_node.refused_node, "-o", "json", check=False)
        if found.returncode != 0:
            return None
        conditions = json.loads(found.stdout)["status"].get("conditions") or []
        ready = [c for c in conditions if c["type"] == "Ready"]
        if ready and ready[0]["status"] == "False" and "libvirt" in ready[0]["message"]:
            return str(ready[0]["message"])
        return None

    message = wait_for(not_ready, timeout=90, what="the node NotReady saying why")
    assert "qemu+ssh://" in message and "Permission denied" in message, message


def test_with_libvirt_pool_pvc_disks_backups_restores_and_growth_use_host_volumes(
    libvirt_node: LibvirtNode, kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path
) -> None:
    """`libvirt.pool` (what a fleet always uses: the daemon never reads the agent's files): a
    claim's disk is a blank qcow2 volume the daemon makes in the pool (the domain's disk is that
    volume's path on the host); a full and an incremental backup are copied by libvirt into
    volumes, then fetched into the agent's backup files; what the pod wrote is on the claim for
    the machine's next pod, whose root disk (a volume) was grown while powered off, and in the
    backup chain, which a new VM is restored from (uploaded as its volume); the claim deleted
    (policy Delete), its volume leaves the pool, and no backup volume is left there."""
    host = libvirt_node.host
    workdir = libvirt_node.workdir / "pooled"
    workdir.mkdir()
    pool = f"vkt-{uuid.uuid4().hex[:6]}"
    name, cidr = f"{libvirt_node.name}-pool", f"10.213.{random.randrange(1, 250)}.0/24"  # noqa: S311
    namespace = create_namespace(kubectl, f"lvp-{uuid.uuid4().hex[:6]}")
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            kube_cluster, workdir, name=name, address=address, cidr=cidr, image=vm_guest_image,
            runtime="libvirt", imageGCIntervalSeconds=1, guestAgentTimeoutSeconds=300,
            libvirt={"uri": f"{host.ssh_uri}&no_tty=1",
                     "pool": {"name": pool, "path": str(workdir / "pool")}},
            storage={"kubeconfig": str(kube_cluster.kubeconfig), "intervalSeconds": 1},
        )  # fmt: skip
        stack.callback(kubectl, "delete", "node", name, "--wait=false", check=False)
        stack.callback(clean_up, workdir / "state", cidr)
        stack.callback(agent.stop)
        stack.callback(delete_namespace, kubectl, namespace)
        wait_for(lambda: node_ready(kubectl, name), timeout=90, what=f"node {name} Ready")

        def volumes() -> list[str]:
            listing = host.virsh("vol-list", pool).stdout.splitlines()  # name, path
            return [line.split()[0] for line in listing if line.strip()]

        def sh(pod: str, command: str) -> str:
            return str(kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", command).stdout)

        def boot(pod: str, annotations: dict[str, str], claim: str | None = "data") -> None:
            manifest = _pod(pod, name, annotations, claim=claim)
            kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(manifest))
            try:
                wait_for(lambda: _running(kubectl, namespace, pod), timeout=BOOT_TIMEOUT,
                         what=f"{pod} Running")  # fmt: skip
            except pytest.fail.Exception:  # why (it failed once in CI without a word)
                print(kubectl("-n", namespace, "describe", "pod", pod, check=False).stdout)
                print(kubectl("-n", namespace, "get", "pvc,events", check=False).stdout)
                print(agent.log()[-6000:])
                raise

        def delete(pod: str) -> None:
            kubectl("-n", namespace, "delete", "pod", pod, "--wait=true", "--timeout=90s")

        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(CLAIM))
        marker = uuid.uuid4().hex
        machine = {"vm.vkubelet.io/machine": f"m-{uuid.uuid4().hex[:8]}"}
        boot("writer", machine)
        files = host.virsh("domblklist", f"{namespace}_writer").stdout
        pv = kubectl.json("-n", namespace, "get", "pvc", "data")["spec"]["volumeName"]
        (claim_volume,) = [v for v in volumes() if pv in v]
        assert f"{workdir / 'pool'}/{claim_volume}" in files, files  # the pool's volume
        sh("writer", f"d=$({FIND_CLAIM}); echo {marker} | dd of=/dev/$d bs=512 conv=sync; sync")

        # backups: full, then incremental, each copied into volumes and fetched
        target = workdir / "state" / "backups"
        results = []
        for number, file in ((1, "one"), (2, "two")):
            sh("writer", f"echo {file} > /root/{file} && sync")
            done = _backup_pod(name, kubectl, namespace, f"backup-{number}", "writer", target)
            terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
            assert done["status"]["phase"] == "Succeeded", terminated
            results.append(json.loads(terminated["message"]))
        assert [r["kind"] for r in results] == ["full", "incremental"], results
        assert results[1]["sizeBytes"] < results[0]["sizeBytes"] / 2, results
        assert not [v for v in volumes() if v.startswith("vkubelet.backup-")]
        delete("writer")

        # the machine's next pod asks a bigger root disk: its volume grown while off
        boot("reader", {**machine, "vm.vkubelet.io/root-size": "1Gi"})
        read = (
            f"d=$({FIND_CLAIM}); echo 3 > /proc/sys/vm/drop_caches; head -c {len(marker)} /dev/$d"
        )
        assert sh("reader", read) == marker  # from the host's volume
        assert int(sh("reader", "cat /sys/block/vda/size")) * 512 == 2**30  # was 257 MiB
        delete("reader")

        # a new VM from the chain: both files
        manifest = Path(results[1]["path"]).parent / "manifest.json"
        boot("restored", {"vm.vkubelet.io/restore-from": str(manifest)}, claim=None)
        assert sh("restored", "cat /root/one /root/two").split() == ["one", "two"]
        delete("restored")

        kubectl("-n", namespace, "delete", "pvc", "data", "--wait=true", "--timeout=60s")
        wait_for(lambda: not [v for v in volumes() if pv in v], timeout=60, what="volume gone")
        assert host.running() == []


IMPORT_URI = "https://vkubelet.io/xmlns/vm-import/1"
POLICY_TO_DELETE = (
    '[{"op": "replace", "path": "/spec/importDomain/deletionPolicy", "value": "Delete"}]'
)


def _vkubelet(kube_cluster: Cluster, *args: str) -> subprocess.Popen[str]:
    """The `vkubelet` command a user runs (this environment's, with its PYTHONPATH), started:
    the test runs the imports it expects refused beside the work that boots."""
    argv = [str(Path(sys.prefix) / "bin" / "vkubelet"), *args]
    argv += ["--kubeconfig", str(kube_cluster.kubeconfig)]
    pipe = subprocess.PIPE
    return subprocess.Popen(argv, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, text=True)


def _ended(command: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = command.communicate(timeout=360)
    return command.returncode, out, err


def test_a_domain_defined_with_virsh_is_imported_powered_off_and_on_by_replicas_and_retained(
    libvirt_node: LibvirtNode, kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path
) -> None:
    """`vkubelet vm import`: the domain boots as it is defined (its own disk and NIC, no seed),
    exec and logs work on its pod, whose IP is the guest's own (none before the guest has one,
    then followed through a new lease); a second import of it and one of a domain that does not
    exist are refused (nothing left behind, the domain unchanged); replicas 0 shuts it off
    without undefining it, replicas 1 starts the same domain (same UUID) with what the guest
    wrote; hibernated (managed save) and resumed with what it kept in RAM (its address too);
    its own disk backed up, full then incremental, and restored into a new VM; deleting the
    VirtualMachine (Retain) leaves it defined, without vkubelet's backup checkpoint."""
    host, node = libvirt_node.host, libvirt_node.name
    install_crds(kube_cluster)
    namespace = create_namespace(kubectl, f"lvi-{uuid.uuid4().hex[:6]}")
    domain = f"site-{uuid.uuid4().hex[:6]}"
    xml_file = libvirt_node.workdir / f"{domain}.xml"
    disk = host.overlay(vm_guest_image, domain)
    xml_file.write_text(virtlab.guest_domain_xml(domain, disk, nic=True))
    host.virsh("define", str(xml_file))
    domain_uuid = host.virsh("domuuid", domain).stdout.strip()
    log_path = libvirt_node.workdir / "controller.log"
    with log_path.open("wb") as log:
        controller = subprocess.Popen(
            [str(Path(sys.prefix) / "bin" / "vkubelet"), "vm-controller",
             "--kubeconfig", str(kube_cluster.kubeconfig), "--namespace", namespace,
             "--lease-namespace", namespace, "--identity", "lvi"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def vm(name: str) -> dict[str, Any]:
        return dict(kubectl.json("-n", namespace, "get", "vm", name))

    started: list[subprocess.Popen[str]] = []

    def vm_import(name: str, *options: str) -> subprocess.Popen[str]:
        command = _vkubelet(
            kube_cluster, "vm", "import", name, "--node", node, "-n", namespace, *options
        )
        started.append(command)
        return command

    def phase_is(name: str, phase: str) -> str | None:
        status = vm(name).get("status") or {}
        return str(status.get("podName") or phase) if status.get("phase") == phase else None

    try:
        # a domain this node's host does not define: refused, the VirtualMachine deleted again
        missing = vm_import("no-such-domain")
        importing = vm_import(domain, "--name", "db")
        code, _, err = _ended(missing)
        assert code == 1 and "DomainNotFound" in err and "'no-such-domain'" in err, err
        code, out, err = _ended(importing)
        assert code == 0 and f"domain {domain} imported" in out, err
        pod = str(wait_for(lambda: phase_is("db", "Running"), timeout=BOOT_TIMEOUT, what="Running"))
        assert host.running() == [domain]  # the site's own domain: same name, same UUID
        assert host.virsh("domuuid", domain).stdout.strip() == domain_uuid
        machine = vm("db")["metadata"]["uid"]
        assert f'machine="{machine}"' in host.virsh("metadata", domain, IMPORT_URI).stdout
        assert "vkubelet-guest: booted" in kubectl("-n", namespace, "logs", pod).stdout
        marker = uuid.uuid4().hex
        write = f"echo {marker} > /root/imported && sync"
        kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", write)
        assert vm("db")["status"]["runtime"] == "libvirt"

        # its own NIC, no address of ours: the pod has no IP (not the node's) until the guest
        # has one, then the guest's as `ip -4 addr` shows it, and it follows a new lease
        assert "podIP" not in _get(kubectl, namespace, pod)["status"]
        names = kubectl("-n", namespace, "exec", pod, "--", "ls", "/sys/class/net").stdout
        nic = next(name for name in names.split() if name != "lo")

        def lease(address: str) -> None:  # what a DHCP client does, by hand
            steps = f"ip addr flush dev {nic} && ip addr add {address}/24 dev {nic}"
            kubectl(
                "-n", namespace, "exec", pod, "--", "sh", "-c", f"{steps} && ip link set {nic} up"
            )

        def guest_ip() -> str:
            shown = kubectl("-n", namespace, "exec", pod, "--", "ip", "-4", "addr", "show", nic)
            (address,) = [w.split("/")[0] for w in shown.stdout.split("inet ")[1:]]
            return address

        def pod_ip_is(address: str) -> bool:
            return bool(_get(kubectl, namespace, pod)["status"].get("podIP") == address)

        lease("10.214.7.23")
        assert guest_ip() == "10.214.7.23"
        wait_for(lambda: pod_ip_is("10.214.7.23"), timeout=30, what="the guest's address")
        lease("10.214.7.24")  # renewed: checked below (its re-read overlaps the next checks)
        assert guest_ip() == "10.214.7.24"
        # the apiserver keeps the VM that domain: no other name, no removal, no restoreFrom
        for bad, words in (
            ('[{"op": "replace", "path": "/spec/importDomain/name", "value": "x"}]', "change"),
            ('[{"op": "remove", "path": "/spec/importDomain"}]', "added or removed"),
            ('[{"op": "add", "path": "/spec/restoreFrom", "value": {"backup": "b"}}]', "own disks"),
            (POLICY_TO_DELETE, "deletionPolicy cannot change"),
        ):
            refused = kubectl(
                "-n", namespace, "patch", "vm", "db", "--type=json", "-p", bad, check=False
            )
            assert refused.returncode != 0 and words in refused.stderr, refused.stderr
        wait_for(lambda: pod_ip_is("10.214.7.24"), timeout=30, what="the guest's new address")
        wait_for(lambda: vm("db")["status"].get("ip") == "10.214.7.24", timeout=30, what="VM ip")

        # the same domain for another VirtualMachine (refused naming the one that holds it,
        # checked below) while replicas 0 shuts it off, still defined; replicas 1: the same
        # domain runs again
        again = vm_import(domain, "--name", "db2")
        kubectl("-n", namespace, "scale", "vm/db", "--replicas=0")
        wait_for(lambda: phase_is("db", "Stopped"), timeout=120, what="the VM Stopped")
        assert host.running() == []
        assert host.virsh("domstate", domain).stdout.strip() == "shut off"
        assert host.virsh("domuuid", domain).stdout.strip() == domain_uuid
        kubectl("-n", namespace, "scale", "vm/db", "--replicas=1")
        pod = str(wait_for(lambda: phase_is("db", "Running"), timeout=BOOT_TIMEOUT, what="on"))
        assert host.running() == [domain]
        assert host.virsh("domuuid", domain).stdout.strip() == domain_uuid
        kept = kubectl("-n", namespace, "exec", pod, "--", "cat", "/root/imported").stdout
        assert kept.strip() == marker  # its own disk: what the guest wrote is there
        assert "podIP" not in _get(kubectl, namespace, pod)["status"]  # a boot with no lease
        code, _, err = _ended(again)
        assert code == 1 and "DomainOwned" in err and f"{namespace}/db" in err, err
        vms = kubectl.json("-n", namespace, "get", "vm")["items"]
        assert [v["metadata"]["name"] for v in vms] == ["db"]  # the refused ones deleted

        # powerOffMode Hibernate: libvirt's managed save of the site's domain, which stays
        # defined with its image; the next power-on restores it (what the guest kept in RAM)
        in_ram = uuid.uuid4().hex
        kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", f"echo {in_ram} > /run/in-ram")
        lease("10.214.7.25")  # kept in RAM too: the resumed pod's IP
        hibernate = '{"spec": {"powerOffMode": "Hibernate"}}'
        kubectl("-n", namespace, "patch", "vm", "db", "--type=merge", "-p", hibernate)
        kubectl("-n", namespace, "scale", "vm/db", "--replicas=0")
        wait_for(lambda: phase_is("db", "Hibernated"), timeout=120, what="the VM Hibernated")
        assert host.running() == []
        assert host.virsh("domstate", "--reason", domain).stdout.strip() == "shut off (saved)"
        kubectl("-n", namespace, "scale", "vm/db", "--replicas=1")
        pod = str(wait_for(lambda: phase_is("db", "Running"), timeout=120, what="resumed"))
        kept = kubectl("-n", namespace, "exec", pod, "--", "cat", "/run/in-ram").stdout
        assert kept.strip() == in_ram and host.running() == [domain]
        wait_for(lambda: pod_ip_is("10.214.7.25"), timeout=30, what="the resumed guest's address")
        assert guest_ip() == "10.214.7.25"
        assert host.virsh("domuuid", domain).stdout.strip() == domain_uuid

        # its own disk backed up (full, then incremental) and restored into a new VM
        _backed_up_and_restored(libvirt_node, kubectl, namespace, pod, domain)

        # deleting the VirtualMachine (Retain): the domain shut down and still defined, its
        # claim and the backup's checkpoint dropped by the machine GC (turned on here)
        libvirt_node.agent.stop()
        libvirt_node.agent = libvirt_node.restart(machine_gc=True)
        wait_for(lambda: node_ready(kubectl, node), timeout=90, what="node Ready again")
        kubectl("-n", namespace, "delete", "vm", "db", "--wait=true", "--timeout=90s")

        def pods_gone() -> bool:
            return not kubectl.json("-n", namespace, "get", "pods")["items"]

        wait_for(pods_gone, timeout=90, what="the VM's pod gone")
        assert host.running() == []
        assert domain in host.virsh("list", "--all", "--name").stdout.split()

        def released() -> bool:  # by the machine GC, once it sees the VirtualMachine gone
            claim = host.virsh("metadata", domain, IMPORT_URI, check=False)
            checkpoints = host.virsh("checkpoint-list", domain, "--name").stdout.split()
            return claim.returncode != 0 and not checkpoints

        wait_for(released, timeout=60, what="claim and backup checkpoint gone")
    finally:
        processes: list[subprocess.Popen[Any]] = [*started, controller]
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        host.virsh("destroy", domain, check=False)
        host.virsh("undefine", domain, check=False)
        delete_namespace(kubectl, namespace)
