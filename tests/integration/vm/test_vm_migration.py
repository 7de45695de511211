"""Live migration between two vm nodes (issue 13), driven with plain pods carrying the seam's
annotations, as the VirtualMachineMigration controller drives them: a real control plane, two
real agents, real QEMU under TCG, the small test guest.

One VM boots on hv-1 and the tests take turns on it, in the order written: a `migrate-to` at
an address of no vm node is refused, it migrates to hv-2 while the guest counts, then a
migration back is cut off by killing the target's QEMU. (A target that dies after the stream
completed: `test_vm_switchover.py`, at the provider's level.)
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.testing import Kubectl, create_namespace, delete_namespace, wait_for

from .twonodes import VMNode
from .vmlab import TOLERATION, PodsOf, alive, install_crds

pytestmark = pytest.mark.integration

SOURCE = "vm.vkubelet.io/migration-source"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_READY = "vm.vkubelet.io/MigrationTarget"
MIGRATION = "vm.vkubelet.io/Migration"
TOKEN = "vm.vkubelet.io/migration-token"
MACHINE = "vm.vkubelet.io/machine"
DISK_MARKER = "migrated-disk-marker-42"
# The guest counts on its console every 100 ms (its own clock: uptime).
COUNTER = (
    "(i=0; while :; do i=$((i+1)); echo \"tick $i $(cut -d' ' -f1 /proc/uptime)\" > /dev/ttyS0;"
    " usleep 100000; done) </dev/null >/dev/null 2>&1 &"
)
TICK = re.compile(r"^tick (\d+) ([\d.]+)$", re.M)
# The switchover's host-side gap may exceed QEMU's downtime by one tick period (0.1 s) and the
# serial console's way to the file, the target's resume and the load of a shared machine.
SWITCH_MARGIN = 0.5


def vm_pod(name: str, node: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "mig"}, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 5,
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }


@dataclass
class Lab(PodsOf):
    hv1: VMNode
    hv2: VMNode

    def exec(self, name: str, *argv: str) -> str:
        return str(self.kubectl("-n", self.namespace, "exec", name, "--", *argv).stdout)

    def logs(self, name: str) -> str:
        return str(self.kubectl("-n", self.namespace, "logs", name).stdout)

    def running(self, name: str) -> bool:
        status = self.pod(name)["status"]
        states = status.get("containerStatuses") or [{}]
        return status.get("phase") == "Running" and "running" in states[0].get("state", {})

    def target(
        self, name: str, source: str, node: VMNode, annotations: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Create a target pod on `node` (with a token, as the controller makes it; and more
        `annotations`) and wait for its endpoint."""
        given = {SOURCE: source, TOKEN: secrets.token_hex(32), **(annotations or {})}
        self.apply(vm_pod(name, node.name, given))
        wait_for(
            lambda: self.condition(name, TARGET_READY).get("status") == "True",
            timeout=120,
            what=f"{name}'s endpoint",
        )
        return dict(json.loads(self.condition(name, TARGET_READY)["message"]))

    def migrate(self, source: str, target: str, endpoint: dict[str, Any]) -> None:
        """As the controller does: the endpoint and the target's token onto the source."""
        value = json.dumps(endpoint)
        token = self.pod(target)["metadata"]["annotations"][TOKEN]
        self.kubectl(
            "-n", self.namespace, "annotate", "--overwrite", "pod", source,
            f"{MIGRATE_TO}={value}", f"{TOKEN}={token}",
        )  # fmt: skip


@pytest.fixture(scope="module")
def lab(vm_node_pair: tuple[VMNode, VMNode], kubectl: Kubectl) -> Iterator[Lab]:
    hv1, hv2 = vm_node_pair
    namespace = create_namespace(kubectl, f"mig-{uuid.uuid4().hex[:6]}")
    handle = Lab(namespace, kubectl, hv1, hv2)
    handle.apply(vm_pod("vm", hv1.name))
    wait_for(lambda: handle.running("vm"), timeout=300, interval=2, what="the VM Running")
    handle.exec("vm", "sh", "-c", f"printf {DISK_MARKER} > /dev/vdb && sync")
    handle.exec("vm", "sh", "-c", COUNTER)
    wait_for(lambda: len(TICK.findall(handle.logs("vm"))) >= 5, timeout=60, what="ticks")
    try:
        yield handle
    finally:
        delete_namespace(kubectl, namespace)


def _ticks(text: str) -> list[tuple[int, float]]:
    return [(int(n), float(t)) for n, t in TICK.findall(text)]


class HostClock:
    """When each tick reaches the host: the serial console files of the source's and the
    target's QEMU, read every 5 ms by a thread. The guest's own clock stands still while it
    is paused, so only the host's can show the switchover's gap."""

    PERIOD = 0.005

    def __init__(self, *files: Path) -> None:
        self.files = files
        self.arrivals: dict[int, tuple[float, int]] = {}  # tick -> (host time, which file)
        self.uptimes: dict[int, float] = {}  # tick -> the guest's own time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HostClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        offsets = [0] * len(self.files)
        partial = [b""] * len(self.files)
        while not self._stop.is_set():
            now = time.monotonic()
            for index, path in enumerate(self.files):
                try:
                    with path.open("rb") as f:
                        f.seek(offsets[index])
                        data = f.read()
                except OSError:
                    continue
                offsets[index] += len(data)
                *lines, partial[index] = (partial[index] + data).split(b"\n")
                for line in lines:
                    found = TICK.match(line.decode(errors="replace").strip())
                    if found:
                        self.arrivals.setdefault(int(found.group(1)), (now, index))
                        self.uptimes[int(found.group(1))] = float(found.group(2))
            time.sleep(self.PERIOD)

    def gaps(self, since: float = 0.0, until: float = 1e18) -> list[tuple[float, int, int]]:
        """(gap in seconds, tick before, tick after) between consecutive ticks seen in
        [since, until], in tick order."""
        seen = sorted((n, t) for n, (t, _) in self.arrivals.items() if since <= t <= until)
        return [(b[1] - a[1], a[0], b[0]) for a, b in itertools.pairwise(seen)]

    def switch(self) -> tuple[float, int, int]:
        """The gap between the source's last tick and the target's first."""
        last = max(n for n, (_, f) in self.arrivals.items() if f == 0)
        first = min(n for n, (_, f) in self.arrivals.items() if f == 1)
        return self.arrivals[first][0] - self.arrivals[last][0], last, first


class Listener:
    """A TCP port that counts who connects to it (a thread accepts)."""

    def __init__(self, host: str) -> None:
        self.server = socket.create_server((host, 0))
        self.server.settimeout(0.2)
        self.port = int(self.server.getsockname()[1])
        self.peers: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                connection, peer = self.server.accept()
            except TimeoutError:
                continue
            self.peers.append(peer)
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


def _events(lab: Lab, pod: str, reason: str) -> list[str]:
    found = lab.kubectl.json(
        "-n", lab.namespace, "get", "events",
        "--field-selector", f"involvedObject.name={pod},reason={reason}",
    )  # fmt: skip
    return [str(e.get("message")) for e in found["items"]]


def test_a_migrate_to_at_an_address_of_no_vm_node_makes_no_connection_and_says_why(
    lab: Lab,
) -> None:
    """Anyone who may annotate their own pod could otherwise make the agent connect anywhere
    and write first (the token line, then NBD). Today's agent connected within a second."""
    listener = Listener("127.0.0.1")
    forged = {
        "host": "127.0.0.1",
        "migrationPort": listener.port,
        "nbdPort": listener.port,
        "consolePort": listener.port,
        "disks": ["disk0", "disk1"],
    }
    try:
        annotated = time.monotonic()
        lab.kubectl(
            "-n", lab.namespace, "annotate", "--overwrite", "pod", "vm",
            f"{MIGRATE_TO}={json.dumps(forged)}", f"{TOKEN}={secrets.token_hex(32)}",
        )  # fmt: skip
        wait_for(
            lambda: listener.peers or lab.condition("vm", MIGRATION).get("reason") == "Failed",
            timeout=60,
            interval=0.2,
            what="the migrate-to refused (or a connection)",
        )
        # The window in which the former agent connected (at once, for the first disk's NBD),
        # and then some: nothing comes.
        deadline = max(annotated + 5, time.monotonic() + 2)
        while time.monotonic() < deadline:
            assert listener.peers == [], f"the agent connected to {forged}"
            time.sleep(0.2)
        error = json.loads(lab.condition("vm", MIGRATION)["message"])["error"]
        print(f"refused: {error}")
        assert "migrate-to refused" in error and "names no target pod" in error
        wait_for(lambda: _events(lab, "vm", "MigrationRefused"), timeout=30, what="the Event")
        assert lab.running("vm")
    finally:
        listener.close()
        lab.kubectl("-n", lab.namespace, "annotate", "pod", "vm", f"{MIGRATE_TO}-", f"{TOKEN}-")


def test_a_running_vm_migrates_to_the_other_node_with_its_disk_and_console(lab: Lab) -> None:
    source_ip = lab.pod("vm")["status"]["podIP"]
    endpoint = lab.target("vm-2", "vm", lab.hv2)
    assert endpoint["host"] == lab.hv2.address
    consoles = [
        node.state / "vms" / lab.pod(pod)["metadata"]["uid"] / "m" / "console.log"
        for node, pod in ((lab.hv1, "vm"), (lab.hv2, "vm-2"))
    ]
    with HostClock(*consoles) as clock:
        watching = time.monotonic() + 0.2  # what the first read found came at once
        wait_for(lambda: len(clock.gaps(watching)) >= 30, timeout=60, what="3 s of ticks seen")
        started = time.monotonic()
        lab.migrate("vm", "vm-2", endpoint)
        wait_for(
            lambda: lab.condition("vm", MIGRATION).get("reason") in ("Completed", "Failed"),
            timeout=120,
            what="the migration's outcome",
        )
        wait_for(
            lambda: sum(f == 1 for _, f in clock.arrivals.values()) >= 20,
            timeout=60,
            what="2 s of ticks from the target's console",
        )
    outcome = lab.condition("vm", MIGRATION)
    assert outcome["reason"] == "Completed", outcome
    result = json.loads(outcome["message"])
    downtime = result["downtimeMilliseconds"] / 1000
    print(f"migration: {result}")

    # The source pod ended as migrated; the VM runs on hv-2 with its disk.
    def source_ended() -> bool:
        state = lab.pod("vm")["status"]["containerStatuses"][0]["state"]
        return bool(state.get("terminated", {}).get("reason") == "Migrated")

    wait_for(source_ended, timeout=60, what="the source pod terminated: Migrated")
    assert lab.pod("vm")["status"]["phase"] == "Succeeded"
    wait_for(lambda: lab.running("vm-2"), timeout=120, what="the target Running")
    target = lab.pod("vm-2")
    assert target["spec"]["nodeName"] == lab.hv2.name
    assert lab.exec("vm-2", "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    # Its hostname is still the source's: the same guest, not a new boot.
    assert lab.exec("vm-2", "cat", "/etc/hostname").strip() == "vm"

    # The pod IP changes (each node has its own CIDR); the guest is given the new one.
    new_ip = target["status"]["podIP"]
    assert new_ip != source_ip
    wait_for(
        lambda: f"{new_ip}/" in lab.exec("vm-2", "ip", "-o", "-4", "addr"),
        timeout=60,
        what="the guest's new address",
    )

    # kubectl logs of the target: the source's history first, then the count goes on.
    before = _ticks(lab.logs("vm"))
    wait_for(lambda: len(_ticks(lab.logs("vm-2"))) > len(before) + 5, timeout=60, what="ticks")
    text = lab.logs("vm-2")
    assert text.startswith(lab.logs("vm")[:200])
    assert "vkubelet-guest: booted hostname=vm" in text
    ticks = _ticks(text)
    numbers = [n for n, _ in ticks]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a tick was lost"
    # The guest's clock stands still while it is paused, so the pause itself (QEMU's downtime)
    # barely shows in its count. What can show is the precopy before it: under TCG on a busy
    # 2-core machine the migration thread can starve the guest's vCPU for the whole RAM phase.
    # So the bound is an ordinary gap plus the RAM phase plus the downtime; the run prints the
    # gap (with KVM, or on a quiet machine, it is an ordinary one: 0.2 s measured).
    # Host-side arrival times (HostClock): the guest is paused for QEMU's downtime, and its next
    # tick can come up to one period later; the rest of the margin is the serial console's
    # way to the file, the target's resume and the host's load (2 shared cores).
    # The host-side gap is what the guest saw (its clock runs: its vCPU starved by the precopy
    # under TCG on a loaded machine) plus the pause it could not see (its clock stopped): the
    # latter is the switchover's downtime as the guest lives it.
    switch_gap, last, first = clock.switch()
    assert first == last + 1, "a tick was lost at the switchover"
    seen_by_guest = clock.uptimes[first] - clock.uptimes[last]
    paused = switch_gap - seen_by_guest
    ordinary = max(clock.gaps(watching, started))[0]
    worst = max(clock.gaps(since=started))
    print(
        f"host-side: switchover gap {switch_gap:.3f} s (ticks {last}->{first}) = "
        f"{seen_by_guest:.3f} s the guest saw + {paused:.3f} s paused; QEMU's downtime "
        f"{downtime:.3f} s; worst gap during the migration {worst[0]:.3f} s (ticks "
        f"{worst[1]}->{worst[2]}), worst ordinary gap {ordinary:.3f} s"
    )
    assert paused <= downtime + SWITCH_MARGIN, (switch_gap, seen_by_guest, downtime)


def test_killing_the_target_midway_leaves_the_vm_running_at_the_source(lab: Lab) -> None:
    """A migration back to hv-1, slowed down (1 MB/s) so that its target can be killed. The
    target is a persistent machine's (its disks in `machines/<id>`): once its pod is gone,
    nothing of that machine stays on hv-1."""
    machine = f"mig-{uuid.uuid4().hex[:8]}"
    endpoint = lab.target("vm-3", "vm-2", lab.hv1, {MACHINE: machine})
    target_uid = lab.pod("vm-3")["metadata"]["uid"]
    assert (lab.hv1.state / "machines" / machine).is_dir()
    lab.migrate("vm-2", "vm-3", {**endpoint, "maxBandwidth": 1_000_000})

    _wait_migrating(lab, "vm-2")
    pid = lab.hv1.qemu_pid(lab.pod("vm-3")["metadata"]["uid"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: lab.condition("vm-2", MIGRATION).get("reason") == "Failed",
        timeout=60,
        what="the migration Failed",
    )
    error = json.loads(lab.condition("vm-2", MIGRATION)["message"])["error"]
    assert error
    print(f"failure: {error}")
    # The VM runs on at hv-2: the pod Running, the guest answering, still counting.
    assert lab.running("vm-2")
    count = len(_ticks(lab.logs("vm-2")))
    wait_for(lambda: len(_ticks(lab.logs("vm-2"))) > count + 5, timeout=60, what="more ticks")
    assert lab.exec("vm-2", "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    # The target pod goes (as the controller deletes it): its partial disk copy with it.
    lab.kubectl("-n", lab.namespace, "delete", "pod", "vm-3", "--wait=false")
    left = (lab.hv1.state / "machines" / machine, lab.hv1.state / "vms" / target_uid)
    wait_for(lambda: not any(p.exists() for p in left), timeout=60, what="the target's files gone")


def _wait_migrating(lab: Lab, source: str) -> None:
    def migrating() -> bool:
        condition = lab.condition(source, MIGRATION)
        assert condition.get("reason") != "Failed", condition
        return bool(json.loads(condition.get("message") or "{}").get("phase") == "migrating")

    wait_for(migrating, timeout=60, interval=0.5, what="the RAM migration under way")


def test_a_source_agent_killed_mid_migration_rolls_it_back_when_restarted(lab: Lab) -> None:
    """SIGKILL of the source's agent during the RAM migration (slowed to 1 MB/s so that the
    kill lands there): the disks' mirror dies with its relay, QEMU's RAM migration goes on
    alone but cannot switch over without the agent's word (pause-before-switchover); the
    restarted agent finds it from its record and QEMU's state, cancels it, and the guest runs
    on at the source in the same QEMU. The target's QEMU ends: never two guests on the disks."""
    endpoint = lab.target("vm-4", "vm-2", lab.hv1)
    source_uid, target_uid = (lab.pod(p)["metadata"]["uid"] for p in ("vm-2", "vm-4"))
    source_pid, target_pid = lab.hv2.qemu_pid(source_uid), lab.hv1.qemu_pid(target_uid)
    assert source_pid is not None and target_pid is not None
    lab.migrate("vm-2", "vm-4", {**endpoint, "maxBandwidth": 1_000_000})
    _wait_migrating(lab, "vm-2")
    lab.hv2.agent.stop(signal.SIGKILL)
    assert alive(source_pid)
    lab.hv2.agent.start()
    wait_for(
        lambda: lab.condition("vm-2", MIGRATION).get("reason") == "Failed",
        timeout=120,
        what="the interrupted migration Failed",
    )
    error = json.loads(lab.condition("vm-2", MIGRATION)["message"])["error"]
    print(f"after the restart: {error}")
    assert "agent restarted" in error
    wait_for(lambda: not alive(target_pid), timeout=60, what="the target's QEMU gone")
    assert lab.hv2.qemu_pid(source_uid) == source_pid and alive(source_pid)
    wait_for(lambda: lab.running("vm-2"), timeout=120, what="the source pod Running")
    assert not lab.running("vm-4")
    count = len(_ticks(lab.logs("vm-2")))
    wait_for(lambda: len(_ticks(lab.logs("vm-2"))) > count + 5, timeout=60, what="more ticks")
    assert lab.exec("vm-2", "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    lab.kubectl("-n", lab.namespace, "delete", "pod", "vm-4", "--wait=false")


# -- the VirtualMachineMigration reconciler against the real apiserver --------------------------
def _reconcile_until_done(lab: Lab, kubeconfig: Any, name: str) -> dict[str, Any]:
    """Run the reconciler as the controller would (level-triggered passes) until it is done."""
    import asyncio
    import time

    from vkubelet.kube import KubeClient
    from vkubelet.vmcontroller._base import Context
    from vkubelet.vmcontroller._migration import MigrationReconciler

    class Events:
        def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
            print(f"event {type} {reason}: {message}")

    async def run() -> None:
        client = KubeClient.from_kubeconfig(kubeconfig)
        reconciler = MigrationReconciler()  # a fresh one each pass: no memory between passes
        try:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                ctx = Context(client=client, events=Events())  # type: ignore[arg-type]
                if await reconciler.reconcile(ctx, lab.namespace, name) is None:
                    return
                reconciler = MigrationReconciler()
                await asyncio.sleep(0.5)
        finally:
            await client.aclose()

    asyncio.run(run())
    return dict(lab.kubectl.json("-n", lab.namespace, "get", "vmmigration", name)["status"])


def test_a_virtualmachinemigration_moves_the_vm_back_and_refuses_a_node_that_is_not_a_vm_node(
    lab: Lab, kube_cluster: Any
) -> None:
    install_crds(kube_cluster)
    kubeconfig = kube_cluster.kubeconfig
    lab.kubectl("-n", lab.namespace, "label", "pod", "vm-2", "vm.vkubelet.io/name=db")
    vm = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "db"},
    }
    # Only the migration reconciler runs here: the template is the CRD's required shape.
    template = {"spec": {"containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}]}}
    lab.apply({**vm, "spec": {"replicas": 1, "template": template}})
    plain = f"plain-{uuid.uuid4().hex[:5]}"
    lab.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": plain}}),
    )
    try:
        bad = {"apiVersion": "vkubelet.io/v1alpha1", "kind": "VirtualMachineMigration"}
        lab.apply(
            {**bad, "metadata": {"name": "bad"}, "spec": {"vmName": "db", "targetNode": plain}}
        )
        status = _reconcile_until_done(lab, kubeconfig, "bad")
        assert (status["phase"], status["message"]) == ("Failed", f"node {plain} is not a vm node")
        labelled = lab.kubectl.json(
            "-n", lab.namespace, "get", "pods", "-l", "vm.vkubelet.io/migration=bad"
        )
        assert labelled["items"] == [] and lab.running("vm-2")
    finally:
        lab.kubectl("delete", "node", plain, "--wait=false")
    # Without a target node the scheduler picks one: hv-1, the only other vm node.
    lab.apply({**bad, "metadata": {"name": "back"}, "spec": {"vmName": "db"}})
    status = _reconcile_until_done(lab, kubeconfig, "back")
    assert status["phase"] == "Succeeded", status
    assert (status["sourceNode"], status["targetNode"]) == (lab.hv2.name, lab.hv1.name)
    assert status["downtimeMilliseconds"] > 0 and status["progress"] == 100
    target = status["targetPod"]
    wait_for(lambda: lab.running(target), timeout=60, what="the VM Running on hv-1")
    assert lab.exec(target, "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    gone = lab.kubectl("-n", lab.namespace, "get", "pod", "vm-2", check=False)
    assert gone.returncode != 0 or "deletionTimestamp" in gone.stdout


# -- a change of the VM's node selection moves it (the controller as `vkubelet vm-controller`) --
ZONE = "vm-test.vkubelet.io/zone"


def _selector_vm(zone: str) -> dict[str, Any]:
    spec = vm_pod("unused", "unused")["spec"]
    del spec["nodeName"]
    spec["nodeSelector"] = {ZONE: zone}
    return {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "sel"},
        "spec": {"replicas": 1, "template": {"spec": spec}},
    }


def test_changing_the_node_selection_migrates_the_vm_and_an_unmatched_one_says_so(
    lab: Lab, kube_cluster: Any, tmp_path: Path
) -> None:
    install_crds(kube_cluster)
    k = lab.kubectl
    k("label", "node", lab.hv1.name, f"{ZONE}=one", "--overwrite")
    k("label", "node", lab.hv2.name, f"{ZONE}=two", "--overwrite")
    namespace = create_namespace(k, f"sel-{uuid.uuid4().hex[:6]}")
    log = (tmp_path / "controller.log").open("wb")

    def start_controller() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [str(Path(sys.prefix) / "bin" / "vkubelet"), "vm-controller",
             "--kubeconfig", str(kube_cluster.kubeconfig), "--namespace", namespace,
             "--lease-namespace", namespace, "--identity", "sel", "--lease-duration", "6",
             "--log-level", "DEBUG"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    controller = start_controller()

    def vm() -> dict[str, Any]:
        return dict(k.json("-n", namespace, "get", "vm", "sel"))

    def placed() -> dict[str, Any]:
        for condition in vm().get("status", {}).get("conditions") or []:
            if condition["type"] == "NodeSelectionMatched":
                return dict(condition)
        return {}

    def running_on(node: VMNode) -> bool:
        status = vm().get("status", {})
        return bool(status.get("phase") == "Running" and status.get("nodeName") == node.name)

    def migrations() -> list[dict[str, Any]]:
        return list(k.json("-n", namespace, "get", "vmmigration")["items"])

    def patch(zone: str) -> None:
        template = {"spec": {"nodeSelector": {ZONE: zone}}}
        body = json.dumps({"spec": {"template": template}})
        k("-n", namespace, "patch", "vm", "sel", "--type=merge", "-p", body)

    try:
        k("-n", namespace, "apply", "-f", "-", input=json.dumps(_selector_vm("one")))
        wait_for(lambda: running_on(lab.hv1), timeout=300, interval=2, what="sel Running on hv-1")
        pod = str(vm()["status"]["podName"])
        write = f"printf {DISK_MARKER} > /dev/vdb && sync"
        k("-n", namespace, "exec", pod, "--", "sh", "-c", write)
        wait_for(lambda: placed().get("status") == "True", timeout=30, what="NodeSelectionMatched")

        # hv-1 no longer matches: a migration the user can see moves the VM to hv-2; the
        # controller, SIGKILLed while it is under way, takes it up again when restarted.
        patch("two")
        wait_for(
            lambda: any(
                m.get("status", {}).get("phase") in ("Preparing", "Migrating") for m in migrations()
            ),
            timeout=60,
            interval=0.5,
            what="the migration under way",
        )
        controller.kill()
        controller.wait()
        controller = start_controller()
        wait_for(lambda: running_on(lab.hv2), timeout=240, interval=2, what="sel moved to hv-2")
        (migration,) = migrations()
        assert migration["metadata"]["name"] == "sel-nodeselection-2"
        assert migration["spec"] == {"vmName": "sel", "targetNode": lab.hv2.name}
        wait_for(
            lambda: migrations()[0].get("status", {}).get("phase") == "Succeeded",
            timeout=60,
            what="the migration Succeeded",
        )
        moved = str(vm()["status"]["podName"])
        guest = ("sh", "-c", f"head -c {len(DISK_MARKER)} /dev/vdb; echo; cat /etc/hostname")
        shown = str(k("-n", namespace, "exec", moved, "--", *guest).stdout).split()
        assert shown == [DISK_MARKER, pod], "the same guest, its disk moved along"
        wait_for(lambda: placed().get("status") == "True", timeout=30, what="matched again")

        # No vm node matches: the condition says so; nothing moves (checked over 15 s).
        patch("nowhere")
        wait_for(
            lambda: placed().get("reason") == "NoMatchingNode", timeout=60, what="NoMatchingNode"
        )
        print(f"unmatched: {placed()['message']}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert running_on(lab.hv2) and vm()["status"]["podName"] == moved
            assert len(migrations()) == 1
            time.sleep(1)
        # A selection the current node still matches: True again, and nothing moves.
        patch("two")
        wait_for(lambda: placed().get("status") == "True", timeout=60, what="matched again")
        assert vm()["status"]["podName"] == moved and len(migrations()) == 1
    finally:
        controller.terminate()
        controller.wait(timeout=30)
        log.close()
        print((tmp_path / "controller.log").read_text(errors="replace")[-3000:])
        delete_namespace(k, namespace)
        for node in (lab.hv1, lab.hv2):
            k("label", "node", node.name, f"{ZONE}-", check=False)
