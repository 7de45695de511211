"""Benchmark: the VirtualMachine resource (power, migration, backup), driven as a user would.

    .venv/bin/python bench/vm_resource.py [--cluster NAME] [--power-rounds 3]
        [--migration-rounds 3] [--backup-rounds 2] [--switchover-rounds 4] [--runtime-rounds 3]

Two vm nodes on this machine (`vkubelet run --provider vm`, each its own state directory, pod
CIDR and address, as tests/integration/vm/twonodes.py), the CRDs installed with `vkubelet vm
install-crds`, `vkubelet vm-controller` as a child process; everything else through the API
(the scale subresource, VirtualMachineMigration, VirtualMachineBackup) and `kubectl exec`. The
guest is the small test guest from the cache (`vkubelet dev vm-image`), QEMU under TCG. It
measures:
- power-on (scale to 1) -> the VM's pod Ready (the provider reports Ready once the guest agent
  answers): cold boot vs resume from hibernation, taking turns on one VirtualMachine
  (powerOffMode switched between Shutdown and Hibernate); and the power-off (scale to 0) ->
  phase Stopped / Hibernated;
- live migration between the two nodes of a 256 MiB and a 1 GiB guest, each with 40 % of its
  RAM filled with data (a tmpfs file; an idle guest's untouched RAM is zero pages, which QEMU does
  not send): QEMU's downtime and RAM-migration time (the migration's status), the whole move
  (VirtualMachineMigration created -> Succeeded) and the RAM sent, taking turns, back and forth;
- the switchover itself, at the provider's level (two QEMUs and `migrate_out`, no cluster, the
  idle guest, QEMU's trace of its run state on both sides): QEMU's downtime figure vs the guest
  really paused (source stopped -> target running, from the trace's timestamps), with the
  former tuning (`stream_buffer=0`: the kernel sizes the stream's socket buffers) and the current
  one, taking turns on one guest that hops from QEMU to QEMU;
- backups of a VM with 160 MiB on its data disk: full vs incremental (16 MiB rewritten between
  two backups), size, the block jobs' copy time and the whole backup's duration, MB/s of each;
- the QEMU runtime beside the libvirt runtime (`--runtime-rounds`, 0 to skip; needs the
  libvirt lab's packages, `vkubelet.testing.virtlab`): two more vm nodes with `runtime:
  libvirt`, each driving a libvirt host of a two-host lab over qemu+ssh, and in turns on each
  pair of nodes one 256 MiB VM created -> its pod Ready (the guest agent answers) and its
  live migration to the pair's other node (VirtualMachineMigration), with the downtime the
  runtime reports (QEMU's, or libvirt's job-completed figure). Each section runs only with
  rounds > 0, so `--power-rounds 0 --migration-rounds 0 --backup-rounds 0
  --switchover-rounds 0` runs this one alone.

It is a benchmark, not a test: it asserts nothing and only prints. It needs root and QEMU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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
from vkubelet.providers.vm._machine import Disk, Machine, MachineSpec
from vkubelet.providers.vm._migrate import STREAM_BUFFER, IncomingMigration, migrate_out
from vkubelet.providers.vm._net import PodNetwork
from vkubelet.testing import AgentProcess, local_test_address, start_agent, virtlab

GROUP = "/apis/vkubelet.io/v1alpha1"
NAME_LABEL = "vm.vkubelet.io/name"
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
LIMIT = 600.0
BIN = Path(sys.executable).parent


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def seconds(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 0.5):.2f} s ({min(values):.2f}-{max(values):.2f}, n={len(values)})"


def millis(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 0.5):.0f} ms ({min(values):.0f}-{max(values):.0f}, n={len(values)})"


def vm_manifest(
    name: str,
    memory: str,
    *,
    mode: str = "Shutdown",
    data: str | None = None,
    node: str = "",
    selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "tolerations": [TOLERATION],
        "terminationGracePeriodSeconds": 60,
        "containers": [
            {
                "name": "vm",
                "image": "vm.vkubelet.io/tiny",
                "resources": {"limits": {"cpu": "1", "memory": memory}},
            }
        ],
    }
    if data:
        spec["volumes"] = [{"name": "data", "emptyDir": {"sizeLimit": data}}]
    if selector:  # the pair of nodes of one runtime (a migration stays within it)
        spec["nodeSelector"] = selector
    if node:  # preferred, not required: a migration may not leave the template's selection
        term = {
            "matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
            ]
        }
        spec["affinity"] = {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100, "preference": term}
                ]
            }
        }
    return {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "powerOffMode": mode,
            "template": {"metadata": {"labels": {"bench": name}}, "spec": spec},
        },
    }


@dataclass
class PodWatch:
    """Every pod of the namespace as last seen, and when each was first seen Ready."""

    client: httpx.AsyncClient
    namespace: str
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)

    async def run(self) -> None:
        await watch_pods(self.client, self.namespace, self._seen)

    def _seen(self, kind: str, pod: dict[str, Any], now: float) -> None:
        name = pod["metadata"]["name"]
        self.pods[name] = pod
        self.seen_at.setdefault(name, now)
        if kind == "DELETED":
            self.deleted.add(name)
        conditions = pod.get("status", {}).get("conditions") or []
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            self.ready_at.setdefault(name, now)

    def of_vm(self, vm: str) -> list[str]:
        return [n for n, p in self.pods.items() if p["metadata"]["labels"].get(NAME_LABEL) == vm]


async def wait(check: Callable[[], Any], limit: float, what: str) -> Any:
    deadline = time.monotonic() + limit
    while not (result := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)
    return result


@dataclass
class Lab:
    client: httpx.AsyncClient
    ns: str
    watch: PodWatch
    kubectl: list[str]
    nodes: list[str]

    def path(self, plural: str, name: str = "") -> str:
        return f"{GROUP}/namespaces/{self.ns}/{plural}" + (f"/{name}" if name else "")

    async def create(self, plural: str, body: dict[str, Any]) -> None:
        (await self.client.post(self.path(plural), json=body)).raise_for_status()

    async def get(self, plural: str, name: str) -> dict[str, Any]:
        response = await self.client.get(self.path(plural, name))
        response.raise_for_status()
        return dict(response.json())

    async def status_until(
        self, plural: str, name: str, phases: tuple[str, ...], limit: float = LIMIT
    ) -> dict[str, Any]:
        deadline = time.monotonic() + limit
        while True:
            status = (await self.get(plural, name)).get("status") or {}
            if status.get("phase") in phases:
                return dict(status)
            if status.get("phase") == "Failed":
                raise RuntimeError(f"{plural}/{name} failed: {json.dumps(status)[:400]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{plural}/{name}: still {status.get('phase')}")
            await asyncio.sleep(0.05)

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        response = await self.client.patch(path, content=json.dumps(body), headers=headers)
        response.raise_for_status()

    async def scale(self, vm: str, replicas: int) -> None:
        """What `kubectl scale vm/NAME --replicas=N` does: the scale subresource."""
        await self.patch(
            self.path("virtualmachines", vm) + "/scale", {"spec": {"replicas": replicas}}
        )

    async def ready_pod(self, vm: str, known: set[str]) -> str:
        """A pod of the VM not in `known`, once Ready."""

        def ready() -> str | None:
            fresh = [n for n in self.watch.of_vm(vm) if n not in known]
            return next((n for n in fresh if n in self.watch.ready_at), None)

        return str(await wait(ready, LIMIT, f"a new pod of {vm} Ready"))

    async def exec(self, pod: str, script: str) -> str:
        argv = [*self.kubectl, "-n", self.ns, "exec", pod, "--", "sh", "-c", script]
        result = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, timeout=600, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"exec in {pod}: {result.stderr.strip()[:300]}")
        return result.stdout

    async def event_message(self, pod: str, reason: str) -> str:
        params = {"fieldSelector": f"involvedObject.name={pod},reason={reason}"}
        items = (
            await self.client.get(f"/api/v1/namespaces/{self.ns}/events", params=params)
        ).json()
        return str(items["items"][-1]["message"]) if items.get("items") else ""


# -- power: cold boot vs resume -------------------------------------------------------------------


@dataclass
class Power:
    cold: list[float] = field(default_factory=list)  # scale 1 -> pod Ready
    resume: list[float] = field(default_factory=list)
    cold_provider: list[float] = field(default_factory=list)  # pod seen -> pod Ready
    resume_provider: list[float] = field(default_factory=list)
    shutdown: list[float] = field(default_factory=list)  # scale 0 -> Stopped
    hibernate: list[float] = field(default_factory=list)  # scale 0 -> Hibernated
    first_boot: float = 0.0
    resumed_events: list[str] = field(default_factory=list)
    hibernated_messages: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)


async def power(lab: Lab, rounds: int) -> Power:
    result = Power()
    vm = "pw"
    start = time.monotonic()
    await lab.create("virtualmachines", vm_manifest(vm, "256Mi", node=lab.nodes[0]))
    pod = await lab.ready_pod(vm, set())
    result.first_boot = lab.watch.ready_at[pod] - start
    log(f"power: first boot {result.first_boot:.1f} s")
    for number in range(rounds):
        for mode in ("Hibernate", "Shutdown"):
            result.loads.append(load())
            await lab.patch(lab.path("virtualmachines", vm), {"spec": {"powerOffMode": mode}})
            known = set(lab.watch.of_vm(vm))
            start = time.monotonic()
            await lab.scale(vm, 0)
            want = "Hibernated" if mode == "Hibernate" else "Stopped"
            await lab.status_until("virtualmachines", vm, (want,))
            (result.hibernate if mode == "Hibernate" else result.shutdown).append(
                time.monotonic() - start
            )
            if mode == "Hibernate":
                result.hibernated_messages.append(await lab.event_message(pod, "Hibernated"))
            start = time.monotonic()
            await lab.scale(vm, 1)
            pod = await lab.ready_pod(vm, known)
            total = lab.watch.ready_at[pod] - start
            provider = lab.watch.ready_at[pod] - lab.watch.seen_at[pod]
            if mode == "Hibernate":
                result.resume.append(total)
                result.resume_provider.append(provider)
                result.resumed_events.append(await lab.event_message(pod, "Resumed"))
            else:
                result.cold.append(total)
                result.cold_provider.append(provider)
            log(f"power round {number + 1}: {mode} -> on {total:.2f} s, load {load()}")
    await lab.client.delete(lab.path("virtualmachines", vm))
    return result


# -- live migration through the API ---------------------------------------------------------------


@dataclass
class Moves:
    downtime: list[float] = field(default_factory=list)  # QEMU's, ms
    ram_time: list[float] = field(default_factory=list)  # QEMU's total-time, ms
    whole: list[float] = field(default_factory=list)  # created -> Succeeded, s
    ready: list[float] = field(default_factory=list)  # created -> the target pod Ready, s
    wall: list[float] = field(default_factory=list)  # the source agent's mirror + RAM, s
    ram_mb: list[float] = field(default_factory=list)
    disk_mb: list[float] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    status_without_figures: int = 0  # VirtualMachineMigrations Succeeded without QEMU's figures


FILL = (
    "mkdir -p /fill && mount -t tmpfs -o size={mib}m tmpfs /fill && "
    "head -c 1048576 /dev/urandom > /fill/r && i=0; "
    'while [ $i -lt {mib} ]; do cat /fill/r; i=$((i+1)); done > /fill/blob && echo "$i MiB"'
)


async def migrations(lab: Lab, rounds: int) -> dict[str, Moves]:
    sizes = {"256 MiB": ("m256", "256Mi", 256), "1 GiB": ("m1g", "1Gi", 1024)}
    for vm, memory, _ in sizes.values():
        await lab.create("virtualmachines", vm_manifest(vm, memory, node=lab.nodes[0]))
    for vm, _, mib in sizes.values():
        pod = await lab.ready_pod(vm, set())
        filled = await lab.exec(pod, FILL.format(mib=mib * 40 // 100))
        log(f"migration: {vm} Ready on {lab.nodes[0]}, filled {filled.strip()}")
    results = {label: Moves() for label in sizes}
    count = 0
    for number in range(rounds):
        for label, (vm, _, _) in sizes.items():
            count += 1
            status = (await lab.get("virtualmachines", vm))["status"]
            source_node, source_pod = status["nodeName"], status["podName"]
            target = next(n for n in lab.nodes if n != source_node)
            name = f"{vm}-move-{number}"
            moves = results[label]
            moves.loads.append(load())
            start = time.monotonic()
            await lab.create(
                "virtualmachinemigrations",
                {
                    "apiVersion": "vkubelet.io/v1alpha1",
                    "kind": "VirtualMachineMigration",
                    "metadata": {"name": name},
                    "spec": {"vmName": vm, "targetNode": target},
                },
            )
            done = await lab.status_until("virtualmachinemigrations", name, ("Succeeded",))
            moves.whole.append(time.monotonic() - start)
            target_pod = str(done["targetPod"])
            await target_ready(lab, target_pod)
            moves.ready.append(lab.watch.ready_at[target_pod] - start)
            # QEMU's figures as the source's provider reported them (its pod's condition): the
            # migration's status lacks them when the source pod was deleted before the
            # migration reconciler read them.
            if "downtimeMilliseconds" not in done:
                moves.status_without_figures += 1
            for condition in lab.watch.pods[source_pod]["status"].get("conditions") or []:
                if condition["type"] == "vm.vkubelet.io/Migration" and condition.get("reason") == (
                    "Completed"
                ):
                    outcome = json.loads(condition["message"])
                    moves.downtime.append(float(outcome["downtimeMilliseconds"]))
                    moves.ram_time.append(float(outcome["totalMilliseconds"]))
                    moves.wall.append(outcome["wallMilliseconds"] / 1000)
                    moves.ram_mb.append(outcome["ramBytes"] / 1e6)
                    moves.disk_mb.append(outcome["diskBytes"] / 1e6)
            log(
                f"migration {count}: {label} {source_node} -> {target}: downtime "
                f"{moves.downtime[-1] if moves.downtime else -1:.0f} ms, whole "
                f"{moves.whole[-1]:.1f} s, load {load()}"
            )
    for vm, _, _ in sizes.values():
        await lab.client.delete(lab.path("virtualmachines", vm))
    return results


async def target_ready(lab: Lab, pod: str) -> None:
    await wait(lambda: pod in lab.watch.ready_at, LIMIT, f"{pod} Ready")


# -- the switchover at the provider's level -------------------------------------------------------


@dataclass
class Switchover:
    qemu: list[float] = field(default_factory=list)  # QEMU's downtime figure, ms
    paused: list[float] = field(default_factory=list)  # source stopped -> target running, ms
    total: list[float] = field(default_factory=list)  # QEMU's total-time (the RAM migration), ms
    loads: list[str] = field(default_factory=list)


_STATE = re.compile(r"^\d+@(\d+)\.(\d+):vm_state_notify running (\d) reason \d+ \(([\w-]+)\)", re.M)


def state_changes(trace: Path) -> list[tuple[float, bool, str]]:
    """(time, running, reason) of each run-state change in a QEMU trace (`-msg timestamp=on`)."""
    text = trace.read_text(errors="replace") if trace.exists() else ""
    return [(int(m[1]) + int(m[2]) / 1e6, m[3] == "1", m[4]) for m in _STATE.finditer(text)]


async def switchover(
    work: Path, image: Path, memory_mib: int, rounds: int
) -> dict[str, Switchover]:
    """One guest hops from QEMU to QEMU on this host, the tunings taking turns (ABBA...)."""
    events = work / "trace-events"
    events.write_text("vm_state_notify\n")
    results = {"former": Switchover(), "current": Switchover()}

    async def launch(number: int, incoming: bool) -> Machine:
        run = work / f"sw{memory_mib}-{number}"
        run.mkdir()
        disk = run / "root.qcow2"
        await asyncio.to_thread(
            subprocess.run,
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image),
             str(disk), "1G"],
            check=True,
        )  # fmt: skip
        trace = ("-msg", "timestamp=on", "-trace", f"events={events},file={run}/trace")
        spec = MachineSpec(
            name=run.name,
            run_dir=run,
            vcpus=1,
            memory_mib=memory_mib,
            disks=(Disk(disk, share_rw=True),),
            extra_args=trace + (("-incoming", "defer") if incoming else ()),
        )
        return await Machine.launch(spec)

    source = await launch(0, incoming=False)
    try:
        await source.wait_guest_agent(LIMIT)
        order = [("former", "current")[(i + 1) // 2 % 2] for i in range(2 * rounds)]  # ABBA
        for number, tuning in enumerate(order, start=1):
            former = tuning == "former"
            target = await launch(number, incoming=True)
            token = secrets.token_hex(32)
            incoming = IncomingMigration(
                target.monitor,
                "127.0.0.1",
                token,
                target.run_dir / "nbd-in.sock",
                stream_buffer=0 if former else STREAM_BUFFER,
            )
            try:
                endpoint = await incoming.open()
                results[tuning].loads.append(load())
                outcome = await migrate_out(
                    source.monitor,
                    endpoint,
                    source.run_dir / "nbd.sock",
                    lambda _: None,
                    token=token,
                    stream_buffer=0 if former else STREAM_BUFFER,
                )
                await incoming.wait()
                await incoming.stop_exports()
            finally:
                await incoming.close()
            await source.kill()
            await source.close()
            stops = [
                t for t, running, why in state_changes(source.run_dir / "trace") if not running
            ]
            starts = [t for t, running, _ in state_changes(target.run_dir / "trace") if running]
            results[tuning].qemu.append(outcome.downtime_ms)
            results[tuning].total.append(outcome.total_ms)
            if stops and starts:
                results[tuning].paused.append((starts[0] - stops[-1]) * 1000)
            log(
                f"switchover {memory_mib} MiB #{number} ({tuning}): QEMU {outcome.downtime_ms} ms,"
                f" paused {results[tuning].paused[-1] if results[tuning].paused else -1:.1f} ms,"
                f" load {load()}"
            )
            source = target
    finally:
        await source.kill()
        await source.close()
    return results


# -- backups --------------------------------------------------------------------------------------


@dataclass
class Backups:
    rows: list[tuple[str, float, float, float, float]] = field(default_factory=list)
    # (kind, MB, copySeconds, durationSeconds, created -> Succeeded)
    loads: list[str] = field(default_factory=list)


async def backups(lab: Lab, rounds: int, directory: Path) -> Backups:
    vm = "bk"
    await lab.create("virtualmachines", vm_manifest(vm, "256Mi", data="256Mi", node=lab.nodes[0]))
    pod = await lab.ready_pod(vm, set())
    await lab.exec(
        pod,
        "head -c 1048576 /dev/urandom > /tmp/r && i=0; "
        "while [ $i -lt 160 ]; do cat /tmp/r; i=$((i+1)); done > /dev/vdb && sync",
    )
    log(f"backup: {vm} Ready, 160 MiB written to its data disk")
    result = Backups()
    count = 0
    for _ in range(rounds):
        for mode in ("Full", "Incremental"):
            count += 1
            if mode == "Incremental":  # 16 MiB rewritten somewhere in the first 160
                seek = random.randrange(0, 144)  # noqa: S311
                await lab.exec(
                    pod,
                    f"dd if=/dev/urandom of=/dev/vdb bs=1M count=16 seek={seek} 2>/dev/null"
                    " && sync",
                )
            name = f"bk-{count}"
            result.loads.append(load())
            start = time.monotonic()
            await lab.create(
                "virtualmachinebackups",
                {
                    "apiVersion": "vkubelet.io/v1alpha1",
                    "kind": "VirtualMachineBackup",
                    "metadata": {"name": name},
                    "spec": {"vmName": vm, "target": {"directory": str(directory)}, "mode": mode},
                },
            )
            status = await lab.status_until("virtualmachinebackups", name, ("Succeeded",))
            whole = time.monotonic() - start
            backup_pod = await lab.client.get(
                f"/api/v1/namespaces/{lab.ns}/pods/{status['podName']}"
            )
            terminated = backup_pod.json()["status"]["containerStatuses"][0]["state"]["terminated"]
            outcome = json.loads(terminated["message"])
            result.rows.append(
                (
                    str(status["kind"]),
                    int(status["sizeBytes"]) / 1e6,
                    float(outcome["copySeconds"]),
                    float(status["durationSeconds"]),
                    whole,
                )
            )
            log(f"backup {count}: {result.rows[-1]}, load {load()}")
    await lab.client.delete(lab.path("virtualmachines", vm))
    return result


# -- the QEMU runtime beside the libvirt runtime ---------------------------------------------------
RUNTIME_LABEL = "bench.vkubelet.io/runtime"


@dataclass
class RuntimeFigures:
    boot: list[float] = field(default_factory=list)  # VM created -> its pod Ready, s
    boot_provider: list[float] = field(default_factory=list)  # pod seen -> Ready, s
    downtime: list[float] = field(default_factory=list)  # the runtime's figure, ms
    whole: list[float] = field(default_factory=list)  # migration created -> Succeeded, s
    wall: list[float] = field(default_factory=list)  # the source agent's, s
    loads: list[str] = field(default_factory=list)


async def runtimes(labs: dict[str, Lab], rounds: int) -> dict[str, RuntimeFigures]:
    """In turns on each runtime's pair of nodes: one VM boots, migrates once, is deleted (and
    gone before the next, so that one guest at a time runs)."""
    results = {runtime: RuntimeFigures() for runtime in labs}
    for number in range(rounds):
        for runtime, lab in labs.items():
            figures = results[runtime]
            vm = f"rt-{runtime}-{number}"
            figures.loads.append(load())
            start = time.monotonic()
            manifest = vm_manifest(
                vm, "256Mi", node=lab.nodes[0], selector={RUNTIME_LABEL: runtime}
            )
            await lab.create("virtualmachines", manifest)
            pod = await lab.ready_pod(vm, set())
            figures.boot.append(lab.watch.ready_at[pod] - start)
            figures.boot_provider.append(lab.watch.ready_at[pod] - lab.watch.seen_at[pod])
            status = (await lab.get("virtualmachines", vm))["status"]
            source_node, source_pod = status["nodeName"], status["podName"]
            target = next(n for n in lab.nodes if n != source_node)
            start = time.monotonic()
            move = {
                "apiVersion": "vkubelet.io/v1alpha1",
                "kind": "VirtualMachineMigration",
                "metadata": {"name": f"{vm}-move"},
                "spec": {"vmName": vm, "targetNode": target},
            }
            await lab.create("virtualmachinemigrations", move)
            await lab.status_until("virtualmachinemigrations", f"{vm}-move", ("Succeeded",))
            figures.whole.append(time.monotonic() - start)
            for condition in lab.watch.pods[source_pod]["status"].get("conditions") or []:
                if condition["type"] == "vm.vkubelet.io/Migration" and condition.get("reason") == (
                    "Completed"
                ):
                    outcome = json.loads(condition["message"])
                    figures.downtime.append(float(outcome["downtimeMilliseconds"]))
                    figures.wall.append(outcome["wallMilliseconds"] / 1000)
            log(
                f"runtime {runtime} round {number + 1}: Ready {figures.boot[-1]:.2f} s, "
                f"downtime {figures.downtime[-1] if figures.downtime else -1:.0f} ms, "
                f"migration {figures.whole[-1]:.1f} s, load {load()}"
            )
            await lab.client.delete(lab.path("virtualmachines", vm))
            pods = set(lab.watch.of_vm(vm))
            deleted = lab.watch.deleted
            await wait(lambda: pods <= deleted, LIMIT, f"{vm}'s pods gone")  # noqa: B023
    return results


async def label_nodes(client: httpx.AsyncClient, nodes: list[str], runtime: str) -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    body = json.dumps({"metadata": {"labels": {RUNTIME_LABEL: runtime}}})
    for node in nodes:
        response = await client.patch(f"/api/v1/nodes/{node}", content=body, headers=headers)
        response.raise_for_status()


# -- the lab --------------------------------------------------------------------------------------


def kill_machines(state: Path) -> list[str]:
    for pid_file in state.glob("vms/*/m/pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
    return [run_dir.name for run_dir in state.glob("vms/*")]


def start_controller(log_path: Path, kubeconfig: str, namespace: str) -> subprocess.Popen[bytes]:
    """`vkubelet vm-controller` for the bench's namespace, its log in a file."""
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [
                str(BIN / "vkubelet"), "vm-controller", "--kubeconfig", kubeconfig,
                "--namespace", namespace, "--lease-namespace", namespace, "--identity", "bench",
            ],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip


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


async def benchmark(args: argparse.Namespace, cluster: Cluster, work: Path) -> None:
    built = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "vkubelet"), "dev", "vm-image"],
        capture_output=True,
        text=True,
        check=True,
    )
    image = Path(built.stdout.split()[-1])
    kubeconfig = str(cluster.kubeconfig)
    await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "vkubelet"), "vm", "install-crds", "--kubeconfig", kubeconfig],
        capture_output=True,
        check=True,
    )
    client = http_client(cluster.kubeconfig, 8)
    ns = await new_namespace(client, "vmres")
    suffix = uuid.uuid4().hex[:4]
    thirds = random.sample(range(1, 250), 4)
    agents: list[tuple[AgentProcess, Path, str, str]] = []
    controller: subprocess.Popen[bytes] | None = None
    switch: dict[int, dict[str, Switchover]] = {}
    compared: dict[str, RuntimeFigures] = {}
    with contextlib.ExitStack() as stack:
        try:

            def start_node(index: int, third: int, **extra: Any) -> str:
                workdir = work / f"n{index}"
                workdir.mkdir()
                (workdir / "backups").mkdir()
                config = workdir / "vm.yaml"
                cidr = f"10.215.{third}.0/24"
                config.write_text(
                    json.dumps(
                        {
                            "stateDir": "state",
                            "accel": "tcg",
                            "podCIDR": cidr,
                            "reserved": {"memory": "1Gi"},
                            "guestAgentTimeoutSeconds": 300,
                            "backupDirectories": [str(workdir / "backups")],
                            "translations": [{"name": "tiny", "url": image.as_uri()}],
                            **extra,
                        }
                    )
                )
                name = f"{'lv' if extra else 'hv'}-{index}-{suffix}"
                address = stack.enter_context(local_test_address())
                agent = start_agent(
                    cluster, workdir, provider="vm", config=config, name=name, address=address
                )
                agents.append((agent, workdir, cidr, name))
                return name

            for index, third in enumerate(thirds[:2], start=1):
                start_node(index, third)
            nodes = [name for _, _, _, name in agents][:2]
            for node in nodes:
                await wait_ready(client, node)
            controller = start_controller(work / "controller.log", kubeconfig, ns)
            watch = PodWatch(client, ns)
            watching = asyncio.create_task(watch.run())
            kubectl = [str(BIN / "kubectl"), "--kubeconfig", kubeconfig]
            lab = Lab(client, ns, watch, kubectl, nodes)
            log(f"two vm nodes {nodes} Ready, load {load()}")
            powered = await power(lab, args.power_rounds) if args.power_rounds else None
            moved = await migrations(lab, args.migration_rounds) if args.migration_rounds else {}
            copied = (
                await backups(lab, args.backup_rounds, agents[0][1] / "backups")
                if args.backup_rounds
                else None
            )
            if args.runtime_rounds:
                # After the QEMU sections: their VMs prefer a node, and must find no other.
                hosts = stack.enter_context(virtlab.libvirt_lab(2, work / "lab"))
                libvirt_nodes = [
                    start_node(
                        index,
                        third,
                        runtime="libvirt",
                        libvirt={
                            "uri": f"{host.ssh_uri}&no_tty=1",
                            "migrationURI": host.libssh_uri,
                        },
                    )
                    for index, (host, third) in enumerate(zip(hosts, thirds[2:], strict=True), 3)
                ]
                for node in libvirt_nodes:
                    await wait_ready(client, node)
                await label_nodes(client, nodes, "qemu")
                await label_nodes(client, libvirt_nodes, "libvirt")
                log(f"two libvirt vm nodes {libvirt_nodes} Ready, load {load()}")
                labs = {
                    "qemu": lab,
                    "libvirt": Lab(client, ns, watch, kubectl, libvirt_nodes),
                }
                compared = await runtimes(labs, args.runtime_rounds)
            watching.cancel()
            for size in (256, 1024) if args.switchover_rounds else ():
                where = work / "switchover"
                where.mkdir(exist_ok=True)
                switch[size] = await switchover(where, image, size, args.switchover_rounds)
        finally:
            if controller is not None:
                controller.terminate()
                controller.wait()
            with contextlib.suppress(Exception):
                await client.delete(f"/api/v1/namespaces/{ns}")
            for agent, workdir, cidr, name in agents:
                agent.stop()
                network = PodNetwork(cidr)
                for run_dir in kill_machines(workdir / "state"):
                    with contextlib.suppress(Exception):
                        await network.detach(run_dir)
                await asyncio.to_thread(
                    subprocess.run,
                    [
                        str(BIN / "kubectl"),
                        "--kubeconfig",
                        kubeconfig,
                        "delete",
                        "node",
                        name,
                        "--wait=false",
                    ],
                    capture_output=True,
                    check=False,
                )
            await client.aclose()

    report(powered, moved, switch, copied, compared)


def report(
    powered: Power | None,
    moved: dict[str, Moves],
    switch: dict[int, dict[str, Switchover]],
    copied: Backups | None,
    compared: dict[str, RuntimeFigures],
) -> None:
    print(f"# VirtualMachine resource benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"# machine: {os.cpu_count()} CPUs, QEMU TCG, the small test guest, two vm nodes")
    print(f"# load average (1/5/15 min) at the end: {load()}")
    if powered is not None:
        report_power(powered)
    if moved:
        report_moves(moved)
    if switch:
        report_switchover(switch)
    if copied is not None:
        report_backups(copied)
    if compared:
        report_runtimes(compared)


def report_power(powered: Power) -> None:
    print()
    print("power on -> pod Ready (guest agent answers), 256 MiB guest, median (min-max):")
    print_table(
        [
            ("", "scale 1 -> Ready", "pod seen -> Ready", "power off (scale 0 -> phase)"),
            (
                "cold boot (powerOffMode Shutdown)",
                seconds(powered.cold),
                seconds(powered.cold_provider),
                seconds(powered.shutdown),
            ),
            (
                "resume (powerOffMode Hibernate)",
                seconds(powered.resume),
                seconds(powered.resume_provider),
                seconds(powered.hibernate),
            ),
        ]
    )
    print(f"  first boot of the VM (new disks): {powered.first_boot:.2f} s")
    print(f"  load at each round's start: {', '.join(powered.loads)}")
    for message in powered.hibernated_messages[:1] + powered.resumed_events[:1]:
        print(f"  e.g. {message}")


def report_moves(moved: dict[str, Moves]) -> None:
    print()
    print(
        "live migration (VirtualMachineMigration), 40 % of the guest's RAM filled, back and forth:"
    )
    rows: list[tuple[str, ...]] = [
        (
            "",
            "QEMU downtime",
            "RAM migration",
            "mirror + RAM (agent)",
            "created -> Succeeded",
            "-> target Ready",
            "RAM sent",
            "disks",
        )
    ]
    for label, moves in moved.items():
        rows.append(
            (
                label,
                millis(moves.downtime),
                millis(moves.ram_time),
                seconds(moves.wall),
                seconds(moves.whole),
                seconds(moves.ready),
                f"{pct(moves.ram_mb, 0.5):.0f} MB",
                f"{pct(moves.disk_mb, 0.5):.0f} MB",
            )
        )
    print_table(rows)
    loads = [value for moves in moved.values() for value in moves.loads]
    print(f"  load at each migration's start: {', '.join(loads)}")
    lacking = sum(m.status_without_figures for m in moved.values())
    print(
        "  QEMU's figures from the source pod's Migration condition; migrations whose status "
        f"lacks them: {lacking} of {sum(len(m.whole) for m in moved.values())}"
    )


def report_switchover(switch: dict[int, dict[str, Switchover]]) -> None:
    if switch:
        print()
        print("switchover, provider level (migrate_out between two QEMUs, idle guest), in turns:")
        rows: list[tuple[str, ...]] = [
            ("", "QEMU downtime", "guest paused (stop -> run)", "RAM migration")
        ]
        for size, results in switch.items():
            for tuning, found in results.items():
                rows.append(
                    (
                        f"{size} MiB, {tuning}",
                        millis(found.qemu),
                        millis(found.paused),
                        millis(found.total),
                    )
                )
        print_table(rows)
        loads = [
            v for results in switch.values() for found in results.values() for v in found.loads
        ]
        print(
            "  former: the stream's socket buffers left to the kernel; current: "
            f"{STREAM_BUFFER // 1024} KiB each side (load {loads[0]} .. {loads[-1]})"
        )


def report_backups(copied: Backups) -> None:
    print()
    print("backups, 160 MiB on the data disk (16 MiB rewritten before each incremental):")
    rows: list[tuple[str, ...]] = [
        ("", "size", "copy (jobs)", "MB/s copy", "duration", "MB/s duration", "whole")
    ]
    for kind in ("full", "incremental"):
        found_rows = [r for r in copied.rows if r[0] == kind]
        if not found_rows:
            continue
        rows.append(
            (
                kind,
                f"{pct([r[1] for r in found_rows], 0.5):.1f} MB",
                seconds([r[2] for r in found_rows]),
                f"{pct([r[1] / r[2] for r in found_rows if r[2] > 0], 0.5):.0f}",
                seconds([r[3] for r in found_rows]),
                f"{pct([r[1] / r[3] for r in found_rows if r[3] > 0], 0.5):.0f}",
                seconds([r[4] for r in found_rows]),
            )
        )
    print_table(rows)
    print("  whole: VirtualMachineBackup created -> Succeeded")
    print(f"  load at each backup's start: {', '.join(copied.loads)}")


def report_runtimes(compared: dict[str, RuntimeFigures]) -> None:
    print()
    print("QEMU runtime beside libvirt runtime (a pair of vm nodes each; libvirt: two lab hosts")
    print("over qemu+ssh), 256 MiB guest, in turns, median (min-max):")
    rows: list[tuple[str, ...]] = [
        (
            "",
            "VM created -> pod Ready",
            "pod seen -> Ready",
            "downtime",
            "migration created -> Succeeded",
            "source agent's migration",
        )
    ]
    for runtime, figures in compared.items():
        rows.append(
            (
                runtime,
                seconds(figures.boot),
                seconds(figures.boot_provider),
                millis(figures.downtime),
                seconds(figures.whole),
                seconds(figures.wall),
            )
        )
    print_table(rows)
    loads = [value for figures in compared.values() for value in figures.loads]
    print(f"  load at each round's start: {', '.join(loads)}")
    print(
        "  downtime: QEMU's (query-migrate) or libvirt's (its job-completed event), as the"
        " source pod's Migration condition reports it"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", help="a running dev cluster (default: start one)")
    parser.add_argument("--power-rounds", type=int, default=3)
    parser.add_argument("--migration-rounds", type=int, default=3)
    parser.add_argument("--backup-rounds", type=int, default=2)
    parser.add_argument("--switchover-rounds", type=int, default=4, help="0 to skip")
    parser.add_argument(
        "--runtime-rounds", type=int, default=3, help="QEMU beside libvirt (0 to skip)"
    )
    args = parser.parse_args()
    run_vm_bench(lambda cluster, work: benchmark(args, cluster, work), args.cluster, "vmres")


if __name__ == "__main__":
    main()
