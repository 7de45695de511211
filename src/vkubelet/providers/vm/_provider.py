"""The VM provider: each pod is a QEMU virtual machine, run as the kubelet runs a container.

A pod goes through two stages. *Preparing* (the kubelet's image pull and container creation):
the image is translated and pulled (failures are `ErrImagePull`, then `ImagePullBackOff` with
the kubelet's back-off, retried for ever: a translation rule may appear later), then the root
overlay, the blank disks, the seed and the pod's network are made. *Running*: the SDK's
`PodRunner` runs the single container, whose one "run" is one boot of the machine: launch (or,
after an agent restart, adopt the QEMU that kept running), Running once the guest agent
answers, and the run's exit code is the machine's (a guest poweroff, a crash); the restart
policy and back-off are the runner's. Deleting the pod stops the machine gracefully (guest
agent shutdown, ACPI, quit) within the grace period.

What a restarted agent needs is kept in the pod's run directory, `<stateDir>/vms/<uid>/`:
`pod.json` (the pod), `state.json` (run number, address, what to launch again, the pod's start
time and the run's), the disks and seed, the console position of the log tailer, and `m/`
(QEMU's sockets, pid, console file).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lightkube.models.core_v1 import EphemeralContainer, PodIP
from lightkube.resources.core_v1 import Node, Pod

from ..._files import make_private, private_dir, write_atomic, write_private
from ...kube import ApiError, KubeClient
from ...sdk import (
    AttachIO,
    ByteStream,
    ContainerLogOptions,
    ContainerReport,
    ExecResult,
    NodeCondition,
    PodRunner,
    ProbeUnknown,
    ProviderContext,
    ProviderError,
    ResolvedPod,
    RunnerProvider,
    Running,
    TaskSet,
    Terminated,
    Waiting,
    build_pod_status,
)
from ...sdk.backoff import INITIAL_SECONDS, MAX_SECONDS
from ...sdk.logs import stale_logs
from ...sdk.provider import EventSink, EventType, UpperAPI
from ...sdk.retry import Backoff
from ...sdk.stats import NodeUsage, PodUsage, resource_metrics, summary
from ...sdk.status import ephemeral_run_before
from . import _domainimport, _guestaddr, _hibernate, _persist, _resize
from ._backend import (
    DomainImport,
    GuestAddress,
    LaunchSpec,
    MachineHandle,
    MachineRefused,
    PulledImage,
    Runtime,
    SavingMachine,
)
from ._backup import BackupSource, is_backup_pod, restore_if_asked
from ._backups import BackupPods
from ._config import VMConfig
from ._console import ConsoleTailer
from ._migrate import MIGRATION_SOURCE, MigrationError
from ._migrations import Migrations
from ._net import AddressRefused, NetworkRefused
from ._spec import ENV_FILE, MachinePlan, ScratchDisk, SpecError, plan_machine
from ._stats import QemuReading, VMUsage
from ._verbs import TTY_REFUSED, attach_console, exec_through_agent, forward_tcp
from ._vm import ADDRESS_ANNOTATION, VM, Launch, decorate, pod_annotations
from ._volumes import DiskProvisioner, VolumeNotReady, claim_disks

__all__ = ["ACCELERATOR_CONDITION", "VMProvider", "create"]

# Replace file $1 with stdin, mode $2, at once (a reader sees the old or the new content). The
# path and mode are arguments, never part of the script.
_REPLACE_FILE = (
    'mkdir -p "$(dirname "$1")" && cat > "$1.vkubelet-new" && chmod "$2" "$1.vkubelet-new" '
    '&& mv -f "$1.vkubelet-new" "$1"'
)

log = logging.getLogger(__name__)

ACCELERATOR_CONDITION = "Accelerator"
_IMPORT_FILE = "import.json"  # a machine's imported domain (`_prepare_imported`)
_MIB = 2**20


def _write_pod_file(vm: VM) -> None:
    """The pod as given, for adoption after a restart. Owner-only, like the seed ISO: its env
    holds the values of the Secrets it refers to, resolved by the node."""
    write_private(vm.dir / "pod.json", json.dumps(vm.pod.to_dict()))


class _Transport:
    """The probe engine's way into a VM: exec through the guest agent, TCP to the pod IP."""

    def __init__(self, provider: VMProvider, key: str) -> None:
        self._provider, self._key = provider, key

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        vm = self._provider.vms.get(self._key)
        if vm is None or vm.machine is None or not vm.up:
            raise ProbeUnknown("the guest is not up")
        output = await vm.machine.exec(list(command), timeout=limit)
        return ExecResult(output.exit_code, output.stdout + output.stderr)

    async def open_connection(self, host: str, port: int) -> Any:
        vm = self._provider.vms.get(self._key)
        if vm is not None and _imported(vm):  # `host` is the pod IP the runner was started with
            if vm.guest_address is None:
                raise ProbeUnknown("the guest's address is not known yet")
            host = vm.guest_address
        return await asyncio.open_connection(host, port)

    def available(self) -> bool:
        vm = self._provider.vms.get(self._key)
        return vm is not None and vm.up


# -- the provider -------------------------------------------------------------------------------
async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


class _Kept:
    """An ephemeral container's output with no client attached: its log, the last 64 KiB."""

    def __init__(self) -> None:
        self._data = bytearray()

    async def write(self, data: bytes) -> None:
        self._data += data
        del self._data[:-65536]

    def data(self) -> bytes:
        return bytes(self._data)


class VMProvider(RunnerProvider):
    def __init__(
        self,
        node_name: str,
        config: VMConfig,
        runtime: Runtime,
        *,
        host_ip: str,
        events: EventSink | None = None,
        host_millicpu: int | None = None,
        host_memory: int | None = None,
    ) -> None:
        super().__init__(host_ip=host_ip, log_dir=config.log_root, events=events)
        self.node_name, self.config, self.runtime = node_name, config, runtime
        self.vms: dict[str, VM] = {}  # "namespace/name"
        cpus = host_millicpu if host_millicpu is not None else (os.cpu_count() or 1) * 1000
        memory = host_memory if host_memory is not None else _host_memory()
        self.millicpu = max(cpus - config.reserved_millicpu, 0)
        self.memory = max(memory - config.reserved_memory, 0)
        self.accel: tuple[str, str] | None = None  # (accel, reason) once probed
        self.disk_provisioner: DiskProvisioner | None = None  # PVC disks, with `storage`
        self.upper_api: UpperAPI | None = None  # the agent's client (migrate-to's check)
        self._push: Callable[[Pod], None] = lambda pod: None
        self._node_changed: Callable[[Node], None] = lambda node: None
        self._grace: dict[str, int] = {}
        self._preparing: dict[str, asyncio.Task[None]] = {}
        self._usage = VMUsage(self.node_name)
        self._tasks = TaskSet("vm provider")
        # What ephemeral containers (`kubectl debug`) without a client printed: (uid, name).
        self._debug_output: dict[tuple[str, str], bytes] = {}
        self._started: asyncio.Task[None] | None = None
        self._closed = False
        self.migrations = Migrations(self)
        private_dir(config.state_dir)  # tenants' disks and memory: the agent's alone
        config.run_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        config.log_root.mkdir(parents=True, exist_ok=True)
        self.backups = BackupPods(config.backup_roots, self._backup_source, events)

    def use_upper_api(self, api: UpperAPI) -> None:
        """The agent's client: a source checks a `migrate-to` against the target pod and its
        node with it before it connects anywhere (`_migrations`)."""
        self.upper_api = api

    # -- node -----------------------------------------------------------------------------------
    def configure_node(self, node: Node) -> None:
        assert node.status is not None
        capacity = {
            "cpu": f"{self.millicpu}m" if self.millicpu % 1000 else str(self.millicpu // 1000),
            "memory": f"{self.memory // 1024}Ki",
            "pods": "110",
        }
        node.status.capacity = dict(capacity)
        node.status.allocatable = dict(capacity)

    def node_conditions(self) -> Sequence[NodeCondition]:
        if self.accel is None:
            return [NodeCondition(ACCELERATOR_CONDITION, "Unknown", "Probing", "probing KVM")]
        accel, reason = self.accel
        why = "KVM" if accel == "kvm" else ("TCGFallback" if self.config.accel == "auto" else "TCG")
        return [NodeCondition(ACCELERATOR_CONDITION, "True", why, reason)]

    async def ping(self) -> None:
        """Unhealthy (the node NotReady, saying why) when the runtime cannot run machines:
        QEMU or qemu-img missing, the libvirt daemon unreachable (libvirt's message)."""
        await self.runtime.ping()
        await self._start()

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self._node_changed = callback

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._push = callback
        super().notify_pods(lambda pod: callback(self._decorated(pod)))

    def _decorated(self, pod: Pod) -> Pod:
        """The runner's status plus what only the VM knows (hibernation, resize)."""
        meta = pod.metadata
        vm = self.vms.get(f"{meta.namespace}/{meta.name}") if meta else None
        if vm is not None and pod.status is not None:
            machine = vm.machine
            container_id = f"{machine.runtime}://{machine.pid}" if machine is not None else None
            decorate(pod.status, vm.power, vm.container, container_id)
            if _imported(vm):  # the guest's address, or none yet (not the node's)
                ip = vm.guest_address
                pod.status.podIP, pod.status.podIPs = ip, [PodIP(ip=ip)] if ip else None
        return pod

    async def _start(self) -> None:
        """Once: probe the accelerator, adopt the VMs a previous agent left, start image GC."""
        if self._started is None:
            self._started = asyncio.create_task(self._start_once(), name="vm provider start")
        await asyncio.shield(self._started)

    async def _start_once(self) -> None:
        try:
            accel, reason = await self.runtime.probe_accel(self.config.accel)
        except Exception as e:  # a broken probe must not keep the node from running VMs
            accel, reason = "tcg", f"the KVM probe failed ({e}); using TCG"
        self.accel = (accel, reason)
        try:  # a remote hypervisor's CPUs and memory are the node's capacity, not this host's
            resources = await self.runtime.host_resources()
        except Exception as e:
            log.warning("node %s: the runtime's host resources are unknown: %s", self.node_name, e)
            resources = None
        if resources is not None:
            cpus, memory = resources
            self.millicpu = max(cpus - self.config.reserved_millicpu, 0)
            self.memory = max(memory - self.config.reserved_memory, 0)
            log.info(
                "node %s: capacity from the runtime's host: %d CPU, %d MiB",
                self.node_name, cpus // 1000, memory // 2**20,
            )  # fmt: skip
        kind: EventType = "Normal" if accel == "kvm" or self.config.accel == "tcg" else "Warning"
        if self.events is not None:
            self.events.node_event(self.node_name, kind, "Accelerator", f"{accel}: {reason}")
        log.info("node %s: accelerator %s (%s)", self.node_name, accel, reason)
        self._node_changed(Node())  # the Accelerator condition, published now
        for private in (self.config.state_dir / _persist.MACHINES, self.config.volume_root):
            await asyncio.to_thread(make_private, private)  # what older versions left readable
        await self._adopt_all()
        self._tasks.spawn(self._gc_loop(), name="image gc")
        if self.config.machine_gc is not None:  # persistent machines (_persist)
            self._tasks.spawn(self._machine_gc_loop(), name="machine gc")
        if (storage := self.config.storage) is not None:
            self.disk_provisioner = DiskProvisioner(
                self.node_name, storage, self.config.volume_root, self.runtime.create_blank
            )
            self._tasks.spawn(self.disk_provisioner.run(), name="disk provisioner")
        if self.config.translation_config_map is not None:
            self._tasks.spawn(self._config_map_loop(), name="translation configmap")

    # -- pods -----------------------------------------------------------------------------------
    async def pod_ips(self, pod: Pod) -> list[str]:
        """The VM's address, known before it starts (so `status.podIP` in its env is right):
        the pod network is attached here (attaching is idempotent per pod UID)."""
        await self._start()  # adopted VMs claim their machines before any new pod may
        spec, meta = pod.spec, pod.metadata
        image = spec.containers[0].image if spec and spec.containers else None
        if meta is None or not meta.uid or not self._is_vm_image(image or ""):
            return [self.host_ip]  # create_pod refuses it
        if is_backup_pod(meta.annotations):
            return [self.host_ip]  # a task on the host, not a VM
        if _domainimport.DOMAIN_ANNOTATION in (meta.annotations or {}):
            return []  # its own NICs: no address until its guest tells (`_guestaddr`)
        standby = bool(pod_annotations(pod).get(MIGRATION_SOURCE))  # not arrived: no VM yet
        return [(await self._attach(pod, standby=standby)).address]

    async def _attach(self, pod: Pod, *, standby: bool) -> GuestAddress:
        """The pod's network, with the address its VM keeps when the pod asks for one (the VM
        controller sets `ADDRESS_ANNOTATION` from the VirtualMachine's status.ip); a refusal
        names the annotation and becomes the pod's reason. A machine's address is recorded in
        its directory, so that this node keeps it while the machine is powered off."""
        try:  # before anything is attached: a refused pod leaves nothing on the host
            _persist.machine_dir(self.config.state_dir, pod)
        except _persist.MachineRefused as e:
            raise ProviderError(e.reason, str(e)) from None
        field = f"metadata.annotations[{ADDRESS_ANNOTATION}]"
        wanted = pod_annotations(pod).get(ADDRESS_ANNOTATION, "").strip() or None
        if wanted is not None:
            try:
                wanted = str(ipaddress.IPv4Address(wanted))
            except ValueError:
                message = f"{field}: {wanted!r} is not an IPv4 address"
                raise ProviderError("InvalidAddress", message) from None
        assert pod.metadata is not None
        uid = str(pod.metadata.uid)
        try:
            network = await self.runtime.attach_network(uid, wanted, standby=standby)
        except NetworkRefused as e:
            if not isinstance(e, AddressRefused) or wanted is None:
                # The node's network settings (bridged mode's bridge, its pool), named in the
                # message: the pod waits and says why, retried (the site may fix it).
                raise ProviderError(e.reason, str(e), permanent=False) from None
            if not (standby and e.reason == "AddressOutOfRange"):
                raise ProviderError(e.reason, f"{field}: {e}") from None
            # A migration to a node that cannot route the VM's address (no shared range)
            # still moves the VM: with an address of this node, given to the guest on arrival.
            network = await self.runtime.attach_network(uid, standby=standby)
            if self.events is not None:
                message = f"{field}: {e}; the VM gets {network.address} here"
                self.events.pod_event(pod, "Warning", "AddressNotKept", message)
        if not standby:
            self._keep_address(pod, network.address)
        return network

    def _keep_address(self, pod: Pod, address: str) -> None:
        try:
            directory = _persist.claim_machine(self.config.state_dir, pod)
        except _persist.MachineRefused as e:
            raise ProviderError(e.reason, str(e)) from None
        if directory is not None:
            _persist.record_address(directory, address)

    async def claim_network(self, vm: VM) -> GuestAddress:
        network = await self.runtime.claim_network(vm.uid)
        self._keep_address(vm.pod, network.address)
        return network

    async def release_pod_ips(self, namespace: str, name: str, uid: str) -> None:
        vm = self.vms.get(f"{namespace}/{name}")
        if vm is None or vm.uid != uid:  # a VM's own deletion detaches its network
            await self.runtime.detach_network(uid)

    def _is_vm_image(self, image: str) -> bool:
        return image.startswith(self.config.image_prefix.rstrip("/") + "/")

    def _plan(self, pod: ResolvedPod) -> MachinePlan:
        return plan_machine(
            pod,
            allocatable_millicpu=self.millicpu,
            allocatable_memory=self.memory,
            default_millicpu=self.config.default_millicpu,
            default_memory=self.config.default_memory,
        )

    async def create_pod(self, pod: ResolvedPod) -> None:
        await self._start()
        key = f"{pod.namespace}/{pod.name}"
        if is_backup_pod(pod.pod.metadata.annotations if pod.pod.metadata else None):
            if (known_runner := self.runners.get(key)) is None or _uid(known_runner) != pod.uid:
                self.start_runner(
                    pod,
                    lambda container, count: self.backups.run(
                        pod.pod, self.log_path(pod.uid, container.name, count)
                    ),
                    lambda container, signum: self.backups.cancel(key),
                    pod_ips=[self.host_ip],
                )
            return
        known = self.vms.get(key)
        if known is not None and known.uid == pod.uid:
            return  # adopted, or already being prepared
        try:
            plan = self._plan(pod)
            request = self._import_request(pod)
        except SpecError as e:
            await self.runtime.detach_network(pod.uid)
            raise ProviderError("InvalidVMSpec", str(e)) from None
        if request is not None:
            self._create_imported(key, pod, plan, request)
            return
        if not self._is_vm_image(plan.image):
            await self.runtime.detach_network(pod.uid)
            raise ProviderError(
                "UnsupportedImage",
                f"spec.containers[0].image: {plan.image!r} is not a VM image "
                f"(this node runs {self.config.image_prefix.rstrip('/')}/<name> images)",
            )
        vm = VM(pod.pod, self.config.run_root / pod.uid, plan=plan)
        vm.address = (await self._attach(pod.pod, standby=self.migrations.is_target(vm))).address
        self.vms[key] = vm
        self._report_waiting(vm, Waiting())
        task = self._tasks.spawn(self._prepare(key, vm, pod), name=f"prepare {key}")
        self._preparing[key] = task
        task.add_done_callback(lambda _: self._preparing.pop(key, None))

    # -- imported domains (`_domainimport`) --------------------------------------------------
    @staticmethod
    def _import_request(pod: ResolvedPod) -> DomainImport | None:
        """The existing domain the pod runs as (`vm.vkubelet.io/domain`), None for a VM of its
        own; SpecError naming the field for one the node cannot take (its disks are the
        domain's own: no emptyDir or PVC disk is added to it)."""
        meta = pod.pod.metadata
        assert meta is not None
        annotations = dict(meta.annotations or {})
        if _domainimport.DOMAIN_ANNOTATION not in annotations:
            return None
        vm_name = next((r.name for r in meta.ownerReferences or [] if r.controller), str(meta.name))
        try:
            machine = _persist.machine_id(pod.pod)
        except _persist.MachineRefused as e:
            raise ProviderError(e.reason, str(e)) from None
        request = _domainimport.requested(annotations, machine, f"{meta.namespace}/{vm_name}")
        volumes = pod.pod.spec.volumes if pod.pod.spec is not None else None
        disks = [v.name for v in volumes or [] if v.emptyDir or v.persistentVolumeClaim]
        if disks:
            raise SpecError(
                f"spec.volumes[{disks[0]}]",
                "an imported domain keeps its own disks; emptyDir and persistentVolumeClaim "
                "volumes are not added to it",
            )
        return request

    def _create_imported(
        self, key: str, pod: ResolvedPod, plan: MachinePlan, request: DomainImport
    ) -> None:
        """A pod of an imported domain: no image pulled, no network attached (the domain keeps
        its own NICs), checked and started by `_prepare_imported`."""
        vm = VM(pod.pod, self.config.run_root / pod.uid, plan=plan)
        self.vms[key] = vm
        self._report_waiting(vm, Waiting())
        task = self._tasks.spawn(self._prepare_imported(key, vm, request), name=f"prepare {key}")
        self._preparing[key] = task
        task.add_done_callback(lambda _: self._preparing.pop(key, None))

    async def _prepare_imported(self, key: str, vm: VM, request: DomainImport) -> None:
        """The domain checked (a refusal changes nothing and is the pod's reason: it is not
        retried), the machine claimed (one pod at a time) and the domain recorded in the
        machine's directory, for the machine GC's deletion policy; then started."""
        retry = Backoff(initial=1.0, cap=30.0)
        target = self.migrations.is_target(vm)  # the domain arrives (`_lvimportmig`)
        while True:
            try:
                uuid = "" if target else await self.runtime.check_import(request)
                directory = self._disk_dir(vm)
                break
            except (MachineRefused, ProviderError) as e:
                message = str(e) if isinstance(e, MachineRefused) else e.message
                self.event(vm, "Warning", "Failed", f"Error: {message}")
                self._report_waiting(vm, Waiting(e.reason, message))
                return
            except Exception as e:  # the daemon away, the machine's previous pod still there
                log.warning("%s: could not import domain %s: %s", key, request.name, e)
                self.event(vm, "Warning", "Failed", f"Error: {e}")
                self._report_waiting(vm, Waiting("CreateContainerError", str(e)))
                await asyncio.sleep(retry.next_delay())
        if uuid:
            self._record_import(directory, request, uuid)
        vm.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        vm.launch = Launch(name=key, domain=request)
        _write_pod_file(vm)
        vm.save()
        said = f"UUID {uuid}" if uuid else "arriving by live migration"
        self.event(vm, "Normal", "Created", f"Imported domain {request.name} ({said})")
        self._start_vm(key, vm, restart_count=0)

    @staticmethod
    def _record_import(directory: Path, request: DomainImport, uuid: str) -> None:
        """The machine's imported domain, for the machine GC's deletion policy on this node
        (a migration target's once the domain arrived: its UUID is the source's)."""
        record = {**asdict(request), "uuid": uuid}
        write_atomic(directory / _IMPORT_FILE, json.dumps(record) + "\n")

    async def _release_imported(self, directory: Path) -> None:
        """A machine going away: its imported domain is undefined (policy Delete) or left as it
        is, vkubelet's metadata removed (Retain), so that it can be imported again."""
        try:
            record = json.loads((directory / _IMPORT_FILE).read_text())
        except FileNotFoundError:
            return
        delete = record.get("policy") == "Delete"
        await self.runtime.release_import(str(record["uuid"]), directory.name, delete=delete)

    def _report_waiting(self, vm: VM, waiting: Waiting) -> None:
        vm.waiting = waiting
        assert vm.pod.spec is not None
        vm.status = build_pod_status(
            vm.pod.spec,
            {vm.container: ContainerReport(waiting)},
            host_ip=self.host_ip,
            pod_ips=[vm.address] if vm.address else [self.host_ip],
            start_time=vm.start_time,
            previous=vm.status,
        )
        if not vm.address:  # not known yet: no address rather than the node's
            vm.status.podIP, vm.status.podIPs = None, None
        self._push(Pod(metadata=vm.pod.metadata, spec=vm.pod.spec, status=vm.status))

    # -- what the parts get (`_vm.VMHost`) -------------------------------------------------------
    def event(self, vm: VM, kind: EventType, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.pod_event(vm.pod, kind, reason, message)

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self._tasks.spawn(work, name=name)

    def runner(self, vm: VM) -> PodRunner | None:
        return self.runners.get(vm.key)

    def publish(self, vm: VM) -> None:
        if (runner := self.runner(vm)) is not None:
            self._notify(runner.as_pod())

    async def launch_machine(
        self, vm: VM, extra_args: tuple[str, ...] = (), *, restore: str | None = None
    ) -> MachineHandle:
        spec = self._launch_spec(vm)
        extra = spec.extra_args + extra_args
        return await self.runtime.launch(replace(spec, extra_args=extra, restore=restore))

    async def discard_saved(self, reference: str) -> None:
        await self.runtime.discard_saved(reference)

    async def _prepare(self, key: str, vm: VM, resolved: ResolvedPod) -> None:
        """Pull (with the kubelet's image back-off), make the disks, seed and network, boot."""
        plan = vm.plan
        assert plan is not None
        image = await self._pull(vm, plan.image)
        backoff, retried = _image_backoff(), False
        while True:
            try:
                await self._make_machine(vm, resolved, plan, image)
                break
            except ProviderError as e:  # the pod's own fault: no retry helps until it changes
                self.event(vm, "Warning", "Failed", f"Error: {e.message}")
                self._report_waiting(vm, Waiting(e.reason, e.message))
                return
            except Exception as e:
                log.warning("%s: could not create the VM: %s", key, e)
                if isinstance(e, VolumeNotReady):  # the kubelet's words for unattached volumes
                    message = f"Unable to attach or mount volumes: {e}"
                    self.event(vm, "Warning", e.event_reason, message)
                    self._report_waiting(vm, Waiting(e.reason, message))
                else:
                    self.event(vm, "Warning", "Failed", f"Error: {e}")
                    self._report_waiting(vm, Waiting("CreateContainerError", str(e)))
                await asyncio.sleep(backoff.next_delay() if retried else 1.0)
                retried = True
        self._start_vm(key, vm, restart_count=0)

    async def _pull(self, vm: VM, image: str) -> PulledImage:
        backoff, retried = _image_backoff(), False
        while True:
            started = time.monotonic()
            self.event(vm, "Normal", "Pulling", f'Pulling image "{image}"')
            try:
                url, sha256 = self.runtime.translate(image)
                shown = [-1]

                def progress(done: int, total: int | None, shown: list[int] = shown) -> None:
                    if not total:
                        return
                    quarter = done * 4 // total
                    if quarter > shown[0] and quarter < 4:
                        shown[0] = quarter
                        self.event(
                            vm,
                            "Normal",
                            "Pulling",
                            f'Pulling image "{image}": {done * 100 // total}% of {total} bytes',
                        )

                pulled = await self.runtime.pull(image, url, sha256, progress)
            except Exception as e:
                message = f'Failed to pull image "{image}": {e}'
                self.event(vm, "Warning", "Failed", message)
                self.event(vm, "Warning", "Failed", "Error: ErrImagePull")
                self._report_waiting(vm, Waiting("ErrImagePull", str(e)))
                delay, retried = (backoff.next_delay() if retried else 1.0), True
                await asyncio.sleep(min(delay, 2.0))  # ErrImagePull shows for a moment
                self.event(vm, "Normal", "BackOff", f'Back-off pulling image "{image}"')
                self._report_waiting(
                    vm,
                    Waiting(
                        "ImagePullBackOff",
                        f'Back-off pulling image "{image}": ErrImagePull: {e}',
                    ),
                )
                await asyncio.sleep(max(delay - 2.0, 0.0))
                continue
            took = time.monotonic() - started
            self.event(
                vm,
                "Normal",
                "Pulled",
                f'Successfully pulled image "{image}" in {took:.3f}s. '
                f"Image size: {pulled.size} bytes.",
            )
            vm.image_sha256 = pulled.sha256
            return pulled

    # -- persistent machines (see _persist) ------------------------------------------------------
    @staticmethod
    def _scratch_path(vm: VM, disk_dir: Path, scratch: ScratchDisk, index: int) -> Path:
        """A machine's emptyDir disks are named by volume, so a new pod of the machine with the
        same volumes finds them; a plain pod's by position."""
        name = f"scratch{index}" if disk_dir == vm.dir else f"empty-{scratch.volume}"
        return disk_dir / f"{name}.qcow2"

    def _disk_dir(self, vm: VM) -> Path:
        """Where a pod's disks go: its machine's directory, claimed for this pod (a machine runs
        in one pod at a time), or the pod's own run directory."""
        try:
            directory = _persist.machine_dir(self.config.state_dir, vm.pod)
        except _persist.MachineRefused as e:
            raise ProviderError(e.reason, str(e)) from None
        if directory is None:
            return vm.dir
        for other in list(self.vms.values()):
            if other.uid != vm.uid and directory.name in _persist.machines_in_use([other.pod]):
                raise RuntimeError(f"machine {directory.name} is still in use by pod {other.key}")
        _persist.claim_machine(self.config.state_dir, vm.pod)
        _persist.record_image(directory, vm.image_sha256)
        return directory

    async def _machine_gc_loop(self) -> None:
        gc = self.config.machine_gc
        assert gc is not None
        while True:
            in_use = _persist.machines_in_use(vm.pod for vm in self.vms.values())
            try:
                removed = await _persist.gc_machines(
                    self.config.state_dir, gc.kubeconfig, in_use, self._machine_gone
                )
            except Exception as e:
                log.warning("machine gc failed: %s", e)
                removed = []
            for ident in removed:
                log.info("machine gc: removed machine %s (its VirtualMachine is gone)", ident)
            await asyncio.sleep(gc.interval)

    async def _machine_gone(self, directory: Path) -> None:
        await self._discard_hibernated(directory)
        await self._release_imported(directory)

    async def _discard_hibernated(self, directory: Path) -> None:
        """A machine going away: the hibernated state its runtime keeps (a libvirt domain with
        its managed save image) goes too."""
        saved = _hibernate.saved_state(directory)
        if saved is not None and saved.domain is not None and saved.here(self.config) is None:
            await self.runtime.discard_saved(saved.domain)

    def _restoring(self, vm: VM) -> str | None:
        """The runtime's saved state the VM's machine resumes from, if any (a libvirt domain)."""
        saved = _hibernate.saved_state(_hibernate.machine_dir(vm.pod, self.config.state_dir))
        return saved.domain if saved is not None else None

    async def _make_machine(
        self, vm: VM, resolved: ResolvedPod, plan: MachinePlan, image: PulledImage
    ) -> None:
        try:  # before anything is made for it (a libvirt domain of its name not the pod's)
            await self.runtime.check_machine(
                resolved.namespace, resolved.name, vm.uid, restoring=self._restoring(vm)
            )
        except MachineRefused as e:
            raise ProviderError(e.reason, str(e)) from None
        vm.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        disk_dir = self._disk_dir(vm)
        root = disk_dir / "root.qcow2"
        scratch_paths = [self._scratch_path(vm, disk_dir, s, i) for i, s in enumerate(plan.scratch)]
        try:  # restore-from: the disks come from a backup (before the first boot only)
            await restore_if_asked(
                resolved.namespace,
                vm.annotations,
                [root, *scratch_paths],
                self.config.backup_roots,
                plan.root_size,
            )
        except Exception as e:
            raise ProviderError(getattr(e, "reason", "RestoreFailed"), str(e)) from None
        if plan.root_size is not None and plan.root_size < image.size:
            raise ProviderError(
                "CreateContainerConfigError",
                f"metadata.annotations: the root size ({plan.root_size} bytes) is smaller than "
                f"the image {plan.image!r} ({image.size} bytes); a root disk cannot shrink",
            )
        if not root.exists():
            await self.runtime.create_overlay(image, root, plan.root_size)
        elif disk_dir != vm.dir and plan.root_size is not None:
            await self.runtime.grow_disk(root, plan.root_size)  # asked bigger while powered off
        for scratch, path in zip(plan.scratch, scratch_paths, strict=True):
            if not path.exists():
                await self.runtime.create_blank(path, scratch.size)
        disks = [(p, plan.disk_bus) for p in (root, *scratch_paths)]
        network = await self._attach(vm.pod, standby=self.migrations.is_target(vm))
        vm.address = network.address
        meta = vm.pod.metadata
        assert meta is not None
        seed = vm.dir / "seed.iso"
        try:
            self._write_seed(vm, vm.pod, seed, plan.files, plan.secret_files)
        except ValueError as e:
            raise ProviderError("CreateContainerConfigError", str(e)) from None
        launch = Launch(
            name=f"{meta.namespace}/{meta.name}",
            disks=[(str(p), bus) for p, bus in disks],
            seed=str(seed),
            network_key=vm.uid,
        )
        vm.launch = _resize.sized(launch, vm.pod, plan, self.config)
        vm.launch.claims = await claim_disks(
            self.disk_provisioner, str(meta.namespace), plan.claims
        )
        _write_pod_file(vm)
        vm.save()
        self.event(vm, "Normal", "Created", f"Created VM {vm.container}")

    def _write_seed(
        self, vm: VM, pod: Pod, path: Path, files: Mapping[str, bytes], secret: Collection[str]
    ) -> None:
        self.runtime.write_seed(
            path,
            pod_name=str(pod.metadata.name),  # type: ignore[union-attr]
            pod_namespace=str(pod.metadata.namespace),  # type: ignore[union-attr]
            pod_uid=vm.uid,
            annotations=pod_annotations(pod),
            files=files,
            network_key=vm.uid,
            secret_files=secret,
        )

    def _start_vm(self, key: str, vm: VM, *, restart_count: int) -> None:
        vm.status = None
        self.start_runner(
            ResolvedPod(vm.pod),
            lambda container, count: self._run(key, vm, count),
            lambda container, signum: self._signal(key, vm, signum),
            pod_ips=[vm.address] if vm.address else (),
            probe_transport=_Transport(self, key),
            restart_counts={vm.container: restart_count},
            start_time=vm.start_time,
            confirms_start=True,  # Running once the guest is up, not when QEMU starts
        )

    async def _run(self, key: str, vm: VM, count: int) -> int | Terminated:
        """Run `count` of the VM's container: one boot of the machine, to its exit code."""
        runner = self.runners[key]
        if vm.ended is not None:  # this run ended while no agent ran
            code, vm.ended = vm.ended, None
            await self.migrations.departed(vm)  # (a libvirt domain may have moved meanwhile)
            if (interrupted := self.migrations.ended_while_away(vm, runner)) is not None:
                return interrupted
            return code
        machine, vm.adopted = vm.adopted, None
        console_mark = vm.dir / "console.offset"
        incoming = machine is None and self.migrations.is_target(vm)
        adopted = machine is not None
        resumed_target = adopted and self.migrations.is_target(vm)
        if machine is None:
            vm.run_dir.mkdir(parents=True, exist_ok=True)
            # A new console file per run, so that each run's log starts at its own boot.
            for stale in (vm.run_dir / "console.log", console_mark):
                stale.unlink(missing_ok=True)
            vm.started_at = None
            self._machine_free(vm)
            try:
                machine = await _hibernate.launch(self, vm)
            except MachineRefused as e:  # (libvirt: the bridge missing on the daemon's host)
                self.event(vm, "Warning", e.reason, str(e))
                return Terminated(128, reason=e.reason, message=str(e))
            which = "domain id" if machine.runtime == "libvirt" else "pid"
            started = f"Started VM {vm.container} ({which} {machine.pid})"
            self.event(vm, "Normal", "Started", started)
        elif vm.started_at is not None:
            # Adopted, its guest up before the agent restarted: running since then. (One adopted
            # while still booting is up when its guest agent answers, as after a launch.)
            runner.confirm_start(vm.container, count, vm.started_at)
        vm.machine, vm.run = machine, count
        vm.started_wall = machine.started
        vm.save()
        self._drop_old_logs(vm, count)
        if incoming or resumed_target:  # a migration target: the VM arrives first
            try:
                if incoming:  # (with its console history)
                    await self.migrations.receive(vm, machine, runner, count)
                else:
                    await self.migrations.resume_incoming(vm, machine, runner)
                imported = vm.launch.domain if vm.launch is not None else None
                if imported is not None and isinstance(machine, SavingMachine):
                    self._record_import(self._disk_dir(vm), imported, machine.reference)
            except MigrationError:
                await machine.kill()
                vm.machine = None
                return 1
        elif adopted:  # a migration the previous agent left: finish it or roll it back
            self.migrations.resume(vm, machine, runner)
        tailer = ConsoleTailer(
            machine.console_log,
            self.log_path(vm.uid, vm.container, count),
            console_mark,
            rotation=self.config.log_rotation,
        )
        tail = self._tasks.spawn(tailer.run(), name=f"console {key}")
        boot = self._tasks.spawn(self._boot(key, vm, machine, runner), name=f"boot {key}")
        address = self._follow_address(key, vm, machine)
        try:
            end = await machine.wait()
            if self._closed:  # the agent is going: the next agent reports this exit
                await asyncio.Future()
            await self.migrations.settled(vm)  # (a libvirt domain leaves before it says so)
            if vm.migrated is not None:
                return Terminated(0, reason="Migrated", message=vm.migrated)
            return end.code
        finally:
            boot.cancel()
            tail.cancel()
            if address is not None:
                address.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tail
            with contextlib.suppress(OSError):
                tailer.copy(final=True)
            vm.machine, vm.booted_at = None, None

    def _follow_address(
        self, key: str, vm: VM, machine: MachineHandle
    ) -> asyncio.Task[None] | None:
        """An imported domain's pod IP, read from its guest while it runs (`_guestaddr`): in
        the background, so that a guest without an agent or an address starts all the same."""
        if not _imported(vm) or not isinstance(machine, _guestaddr.AddressSource):
            return None

        def changed(address: str) -> None:
            log.info("%s: the guest's address is %s", key, address)
            vm.guest_address = address
            self.publish(vm)

        return self._tasks.spawn(
            _guestaddr.follow(machine.guest_address, changed), name=f"address {key}"
        )

    async def _boot(self, key: str, vm: VM, machine: MachineHandle, runner: PodRunner) -> None:
        """Running once the guest agent answers (or after the timeout, with a warning: an image
        without an agent still runs, its readiness is then the probes')."""
        try:
            await machine.wait_guest_agent(self.config.guest_agent_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.event(
                vm, "Warning", "GuestAgentUnavailable", f"the guest agent did not answer: {e}"
            )
        vm.booted_at = time.monotonic()
        if vm.started_at is None:  # else adopted: up since then
            vm.started_at = datetime.now(UTC)
            vm.save()
        runner.confirm_start(vm.container, vm.run, vm.started_at)

    def _machine_free(self, vm: VM) -> None:
        """Two pods of one persistent machine never run at once (they would share its disks)."""
        directory = _hibernate.machine_dir(vm.pod, self.config.state_dir)
        if directory is None:
            return
        for other in self.vms.values():
            running = other is not vm and other.machine is not None
            if running and _hibernate.machine_dir(other.pod, self.config.state_dir) == directory:
                name = other.pod.metadata.name if other.pod.metadata else "?"
                raise RuntimeError(f"its machine still runs as pod {name}; waiting for it")

    def _launch_spec(self, vm: VM) -> LaunchSpec:
        launch = vm.launch
        assert launch is not None
        return LaunchSpec(
            name=launch.name,
            run_dir=vm.run_dir,
            vcpus=launch.vcpus,
            memory_mib=launch.memory_mib,
            disks=tuple((Path(p), bus) for p, bus in launch.disks),
            seed=Path(launch.seed) if launch.seed else None,
            network_key=launch.network_key,
            network_address=vm.address if launch.network_key else None,
            accel=self.accel[0] if self.accel else "tcg",
            max_vcpus=launch.max_vcpus,
            max_memory_mib=launch.max_memory_mib,
            memory_slots=launch.memory_slots,
            hotplug=launch.hotplug,
            claims=tuple((Path(p), serial) for p, serial in launch.claims),
            incoming=self.migrations.is_target(vm),
            domain=launch.domain,
        )

    def _drop_old_logs(self, vm: VM, run: int) -> None:
        """Keep the current and the previous run's log (`-p`), as the kubelet does."""
        for path in stale_logs(self.log_path(vm.uid, vm.container, run).parent, run):
            path.unlink(missing_ok=True)

    def _signal(self, key: str, vm: VM, signum: int) -> None:
        """SIGTERM: a graceful stop (guest agent, ACPI, quit) within the grace period; SIGKILL:
        QEMU is killed. The runner waits for the machine's exit either way."""
        machine = vm.machine
        if machine is None:
            raise ProcessLookupError(key)
        if signum == signal.SIGKILL or self.migrations.is_target(vm):  # no guest to ask yet
            self._tasks.spawn(machine.kill(), name=f"kill {key}")
            return
        spec = vm.pod.spec
        grace = self._grace.get(key)
        if grace is None:
            grace = spec.terminationGracePeriodSeconds if spec else None
        seconds = float(30 if grace is None else grace)
        stopping = key in self.runners and self.runners[key].stopping
        if stopping and (power_off := _hibernate.power_off(self, vm, machine, seconds)) is not None:
            self._tasks.spawn(power_off, name=f"power off {key}")
            return
        self._tasks.spawn(machine.stop(seconds), name=f"stop {key}")

    async def adopt_pod(self, pod: ResolvedPod) -> None:
        """A VM found running after a restart, whose pod did not change meanwhile: its files
        are the pod's as resolved now, so later updates write only what changes."""
        vm = self.vms.get(f"{pod.namespace}/{pod.name}")
        if vm is None or vm.uid != pod.uid or vm.plan is not None:
            return
        with contextlib.suppress(SpecError):  # a spec no longer valid: update_pod says so
            vm.plan = self._plan(pod)

    async def update_pod(self, pod: ResolvedPod) -> None:
        """New contents of configMap, secret, downwardAPI and projected volumes reach the guest
        as they reach a container: written in place through the guest agent (each file replaced
        at once, removed keys removed), and into the seed for later boots. The environment is a
        container's start-time environment: the env file changes only with the pod."""
        key = f"{pod.namespace}/{pod.name}"
        vm = self.vms.get(key)
        if vm is not None and vm.uid == pod.uid:  # (an adopted VM has no plan: checked below)
            annotations = dict(pod.pod.metadata.annotations or {})  # type: ignore[union-attr]
            self.migrations.update(vm, self.runners.get(key), annotations)
        if vm is None or vm.uid != pod.uid or vm.launch is None:
            return  # not made yet: the seed is written with the newest files anyway
        if vm.launch.domain is not None:  # no seed, nothing written into its guest
            why = (
                f"an imported domain keeps the size it is defined with ({vm.launch.domain.name}"
                " on the node's libvirt host): change it there (virsh setvcpus, setmem)"
            )
            _resize.refuse(self, vm, pod.pod, why)
            return
        try:
            plan = self._plan(pod)
        except SpecError as e:
            if not await _resize.resize(self, vm, pod, None, str(e)):
                raise ProviderError("InvalidVMSpec", str(e)) from None
            return
        await _resize.resize(self, vm, pod, plan, None)  # also for a VM adopted after a restart
        # Adopted after a restart and changed meanwhile: what the guest has is not known, so
        # every file is written again (the env file stays: a start-time environment).
        given = vm.plan or replace(plan, files={}, secret_files=frozenset())
        old = {p: d for p, d in given.files.items() if p != ENV_FILE}
        new = {p: d for p, d in plan.files.items() if p != ENV_FILE}
        env = (vm.plan or plan).files.get(ENV_FILE)
        plan_files = {**new, ENV_FILE: env} if env is not None else new
        if old == new:
            vm.plan = vm.plan or plan
            return
        changed = {p: d for p, d in new.items() if old.get(p) != d}
        removed = sorted(set(old) - set(new))
        secret = plan.secret_files | given.secret_files
        # First: a refused seed leaves the plan as it was, to retry.
        self._write_seed(vm, pod.pod, Path(str(vm.launch.seed)), plan_files, secret)
        vm.plan = replace(plan, files=plan_files)
        vm.pod = pod.pod
        _write_pod_file(vm)
        machine = vm.machine
        if machine is None or vm.booted_at is None:
            return  # the next boot reads the new seed
        for path, data in sorted(changed.items()):
            mode = "600" if path in secret else "644"
            result = await machine.exec(["sh", "-c", _REPLACE_FILE, "sh", path, mode], stdin=data)
            if result.exit_code != 0:
                message = f"could not update {path} in the guest: {result.stderr.decode()[:200]}"
                self.event(vm, "Warning", "FailedUpdate", message)
        if removed:
            await machine.exec(["rm", "-f", "--", *removed])
        self.event(vm, "Normal", "Updated", f"{len(changed) + len(removed)} file(s) updated")

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        meta = pod.metadata
        assert meta is not None
        key = f"{meta.namespace}/{meta.name}"
        if is_backup_pod(meta.annotations):
            await super().delete_pod(pod, grace_period_seconds)
            return
        vm = self.vms.get(key)
        if vm is None or vm.uid != meta.uid:
            return
        self._grace[key] = grace_period_seconds
        # The pod as deleted (its newest annotations: a controller sets power-off just before).
        vm.power.hibernate = _hibernate.wants_hibernate(pod)
        runner = self.runners.get(key)
        if runner is None:  # still preparing: nothing runs yet
            if (task := self._preparing.get(key)) is not None:
                task.cancel()
            self._tasks.spawn(self._finish(key, vm, None, 0), name=f"delete {key}")
            return
        if not runner.stopping or vm.migrated is not None:  # (a migrated one ended already)
            self._tasks.spawn(
                self._finish(key, vm, runner, grace_period_seconds), name=f"delete {key}"
            )

    async def _finish(self, key: str, vm: VM, runner: PodRunner | None, grace: int) -> None:
        if runner is not None:
            await runner.stop(grace)
            if self.runners.get(key) is runner:
                del self.runners[key]
        else:
            assert vm.pod.spec is not None
            vm.status = build_pod_status(
                vm.pod.spec,
                {vm.container: ContainerReport(vm.waiting)},
                host_ip=self.host_ip,
                previous=vm.status,
                terminating=True,
            )
            self._push(Pod(metadata=vm.pod.metadata, spec=vm.pod.spec, status=vm.status))
        if self.vms.get(key) is vm:
            del self.vms[key]
        self._grace.pop(key, None)
        with contextlib.suppress(Exception):
            await self.runtime.detach_network(vm.uid)
        shutil.rmtree(vm.dir, ignore_errors=True)
        shutil.rmtree(self.log_dir / vm.uid, ignore_errors=True)
        # Migrated away, the machine lives elsewhere now; or a migration target the VM never
        # reached, its disks a partial copy of a VM that runs at its source: no stale disks here.
        if vm.migrated is not None or self.migrations.is_target(vm):
            with contextlib.suppress(ValueError):
                if (gone := _persist.machine_dir(self.config.state_dir, vm.pod)) is not None:
                    shutil.rmtree(gone, ignore_errors=True)

    async def aclose(self) -> None:
        """The agent stops; the VMs do not: a restarted agent adopts them (see `_adopt_all`).
        A backup in progress is cancelled (its jobs and files dropped, the guest thawed); its
        pod runs again under the next agent."""
        self._closed = True
        await self.backups.aclose()
        await self._tasks.aclose()

    # -- status ----------------------------------------------------------------------------------
    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        await self._start()
        key = f"{namespace}/{name}"
        if key in self.runners:
            pod = await super().get_pod(namespace, name)
            return self._decorated(pod) if pod is not None else None
        vm = self.vms.get(key)
        if vm is None:
            return None
        return Pod(metadata=vm.pod.metadata, spec=vm.pod.spec, status=vm.status)

    async def list_pods(self) -> list[Pod]:
        await self._start()
        pods = []
        for key in list(self.vms):
            namespace, name = key.split("/", 1)
            if (pod := await self.get_pod(namespace, name)) is not None:
                pods.append(pod)
        backups = [r.as_pod() for k, r in self.runners.items() if k not in self.vms]
        return pods + backups

    def _backup_source(
        self, namespace: str, name: str
    ) -> tuple[MachineHandle | None, BackupSource] | None:
        """A VM pod for a backup pod: its machine (None when not up) and identity."""
        vm = self.vms.get(f"{namespace}/{name}")
        if vm is None or vm.launch is None or vm.pod.metadata is None:
            return None
        meta = vm.pod.metadata
        source = BackupSource(
            namespace=namespace,
            pod=name,
            pod_uid=vm.uid,
            vm_name=(meta.labels or {}).get("vm.vkubelet.io/name", name),
            machine=(meta.annotations or {}).get("vm.vkubelet.io/machine"),
            disks=tuple(Path(p) for p, _ in vm.launch.disks),
        )
        return (vm.machine if vm.up else None), source

    # -- adoption --------------------------------------------------------------------------------
    async def _adopt_all(self) -> None:
        """Take back the VMs a previous agent ran: the same QEMU processes, their run numbers
        (restart counts) and addresses; a machine that died meanwhile boots again."""
        for directory in sorted(self.config.run_root.iterdir()):
            try:
                pod = Pod.from_dict(json.loads((directory / "pod.json").read_text()))
                state = json.loads((directory / "state.json").read_text())
            except (OSError, ValueError) as e:
                log.warning("%s: not a VM this agent can adopt (%s); leaving it", directory, e)
                continue
            assert isinstance(pod, Pod) and pod.metadata is not None
            key = f"{pod.metadata.namespace}/{pod.metadata.name}"
            with contextlib.suppress(_persist.MachineRefused):  # (then its own pod never ran)
                # Its machine is this pod's: recorded before any new pod may claim it (a machine
                # an older version made has no owner yet).
                _persist.claim_machine(self.config.state_dir, pod)
            vm = VM(pod, directory, address=state.get("address"))
            vm.image_sha256, vm.run = state.get("image"), state["run"]
            vm.launch = Launch.from_json(state["launch"]) if state["launch"] else None
            vm.start_time = _moment(state.get("startTime")) or vm.start_time
            vm.started_at = _moment(state.get("startedAt"))
            try:
                vm.adopted = await self.runtime.adopt(vm.run_dir)
            except Exception as e:  # one VM never keeps the others from being adopted
                log.warning("%s: could not adopt its VM (%s); treating it as ended", key, e)
            self.vms[key] = vm
            if vm.adopted is not None:
                log.info("%s: adopted VM (pid %d, run %d)", key, vm.adopted.pid, vm.run)
                await self._reattach(key, vm)
                self._start_vm(key, vm, restart_count=vm.run)
                continue
            # The VM ended while no agent ran: its run is over (the console's last lines go to
            # that run's log), with the exit QEMU's watcher recorded (else unknown: 137); the
            # restart policy decides what comes next.
            vm.ended = _recorded_exit(vm.run_dir)
            log.info("%s: its VM ended (exit %d) while no agent ran", key, vm.ended)
            with contextlib.suppress(OSError):
                ConsoleTailer(
                    vm.run_dir / "console.log",
                    self.log_path(vm.uid, vm.container, vm.run),
                    directory / "console.offset",
                    rotation=self.config.log_rotation,
                ).copy(final=True)
            self._start_vm(key, vm, restart_count=vm.run)

    async def _reattach(self, key: str, vm: VM) -> None:
        """The running VM's links are the kernel's (they outlived the agent): found again, with
        this config's network mode applied to them (routed: the host forwards for the VM)."""
        if vm.launch is None or not vm.launch.network_key:
            return
        try:
            await self.runtime.attach_network(vm.launch.network_key)
        except Exception as e:  # the VM runs on; it is reachable as its links still allow
            log.warning("%s: could not re-attach its network: %s", key, e)

    # -- the translation ConfigMap ------------------------------------------------------------
    async def _config_map_loop(self) -> None:
        """Re-read the translation ConfigMap every interval; its rules win over the config's."""
        source = self.config.translation_config_map
        assert source is not None
        origin = f"ConfigMap {source.namespace}/{source.name}"
        path = f"/api/v1/namespaces/{source.namespace}/configmaps/{source.name}"
        client = KubeClient.from_kubeconfig(source.kubeconfig)
        seen: object = ()  # nothing yet
        try:
            while True:
                data: dict[str, str] | None
                try:
                    found = await client.get(path)
                    data = {str(k): str(v) for k, v in (found.get("data") or {}).items()}
                except Exception as e:  # the apiserver away: try again later
                    if not (isinstance(e, ApiError) and e.not_found):
                        log.warning("%s: cannot read it: %s", origin, e)
                        await asyncio.sleep(source.interval)
                        continue
                    data = None
                if data != seen:
                    seen = data
                    try:
                        self.runtime.set_translation_overrides(data, origin)
                        state = "applied" if data is not None else "absent: none applied"
                        log.info("translation rules from %s %s", origin, state)
                    except ValueError as e:
                        log.warning("%s: rules kept as they were: %s", origin, e)
                        if self.events is not None:
                            self.events.node_event(
                                self.node_name, "Warning", "InvalidTranslationRules", str(e)
                            )
                await asyncio.sleep(source.interval)
        finally:
            await client.aclose()

    # -- image gc --------------------------------------------------------------------------------
    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.image_gc_interval)
            in_use = {vm.image_sha256 for vm in self.vms.values() if vm.image_sha256}
            in_use |= _persist.machine_images(self.config.state_dir)  # powered-off machines
            try:
                removed = self.runtime.gc_images(in_use)
            except Exception as e:
                log.warning("image gc failed: %s", e)
                continue
            for digest in removed:
                log.info("image gc: removed unused image %s", digest)

    # -- kubectl verbs ---------------------------------------------------------------------------
    def _running(self, namespace: str, pod: str, container: str) -> VM:
        vm = self.vms.get(f"{namespace}/{pod}")
        if vm is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} not found")
        if container != vm.container:
            raise ProviderError("NotFound", f"container {container} is not valid for pod {pod}")
        if vm.machine is None:
            raise ProviderError("NotFound", f"container {container} of pod {pod} is not running")
        return vm

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        """Through the guest agent: stdin whole first, output at the end, `-t` refused."""
        if io.tty:
            raise ProviderError("BadRequest", TTY_REFUSED)
        machine = self._running(namespace, pod, container).machine
        assert machine is not None
        return await exec_through_agent(machine, command, io)

    # -- ephemeral containers (kubectl debug) ---------------------------------------------------
    async def start_ephemeral_container(self, pod: ResolvedPod, name: str) -> None:
        """A command through the guest agent, as `exec` runs one (the image is not used; the
        guest agent passes no env). Without stdin it runs now, its output its log. With stdin
        it runs when a client attaches: `-i` sends stdin whole first, the output comes at the
        end; `-it` (a terminal the guest agent cannot give) is the VM's serial console, as
        `kubectl attach` is, and the container ends when the client detaches."""
        key = f"{pod.namespace}/{pod.name}"
        runner, vm = self.runners.get(key), self.vms.get(key)
        if runner is None or vm is None or vm.uid != pod.uid or vm.machine is None:
            raise ProviderError("NotFound", f"VM of pod {key} is not running", permanent=False)
        if runner.ephemeral(name) is not None:
            return  # handed again
        spec = pod.pod.spec
        found = [c for c in (spec.ephemeralContainers if spec else None) or () if c.name == name]
        if not found:
            raise ProviderError("NotFound", f"pod {pod.name} has no ephemeral container {name}")
        container = found[0]
        earlier = ephemeral_run_before(pod.pod, name)
        if earlier is not None:  # run by the agent before a restart: never a second time
            runner.report_ephemeral(container, earlier)
            return
        argv = [*(container.command or []), *(container.args or [])]
        if not argv and not (container.stdin and container.tty):
            raise ProviderError(
                "NoCommand",
                f"ephemeral container {name}: a VM runs a command through its guest agent: "
                "give one (kubectl debug ... -- sh)",
            )
        now = datetime.now(UTC)
        runner.report_ephemeral(container, ContainerReport(state=Running(now)))
        if not container.stdin:
            output = _Kept()
            io = AttachIO(stdin=None, stdout=output, stderr=output)
            run = self._run_ephemeral(runner, vm.machine, container, io, output)
            self._tasks.spawn(run, name=f"debug {key}/{name}")

    async def _run_ephemeral(
        self,
        runner: PodRunner,
        machine: MachineHandle,
        container: EphemeralContainer,
        io: AttachIO,
        output: _Kept | None = None,
    ) -> None:
        """Run it with `io` as its stdio (the console with a terminal); it has terminated when
        this returns."""
        report = runner.ephemeral(container.name)
        started = report.state.started_at if report and isinstance(report.state, Running) else None
        argv = [*(container.command or []), *(container.args or [])]
        try:
            if io.tty:
                await attach_console(machine.console_socket, io)
                code = 0
            else:
                code = await exec_through_agent(machine, argv, io)
            ended = Terminated(code, started, datetime.now(UTC))
        except asyncio.CancelledError:  # the client detached
            if io.tty:  # from the console: that was the container
                ended = Terminated(0, started, datetime.now(UTC))
                runner.report_ephemeral(container, ContainerReport(state=ended))
            raise  # (with -i: stdin was not complete, nothing ran; it may attach again)
        except Exception as e:  # the guest agent failed: the container ends with its message
            ended = Terminated(126, started, datetime.now(UTC), message=str(e))
        if output is not None and runner.pod.metadata is not None:
            self._debug_output[(str(runner.pod.metadata.uid), container.name)] = output.data()
        runner.report_ephemeral(container, ContainerReport(state=ended))

    def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        """A VM's log is its console's; an ephemeral container's, what it printed."""
        vm = self.vms.get(f"{namespace}/{pod}")
        runner = self.runners.get(f"{namespace}/{pod}")
        if vm is not None and runner is not None and runner.ephemeral(container) is not None:
            return _once(self._debug_output.get((vm.uid, container), b""))
        return super().container_logs(namespace, pod, container, options)

    async def _attach_ephemeral(self, runner: PodRunner, vm: VM, name: str, io: AttachIO) -> None:
        report = runner.ephemeral(name)
        spec = runner.as_pod().spec
        found = [c for c in (spec.ephemeralContainers if spec else None) or () if c.name == name]
        if report is None or not found:
            raise ProviderError("NotFound", f"container {name} is not valid for this pod")
        if found[0].stdin and isinstance(report.state, Running) and vm.machine is not None:
            await self._run_ephemeral(runner, vm.machine, found[0], io)
            return
        out = io.stdout or io.stderr
        if out is not None:  # ran without stdin, or ended: what it printed
            await out.write(self._debug_output.get((vm.uid, name), b""))

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        """The serial console, both ways (the console log keeps everything regardless)."""
        key = f"{namespace}/{pod}"
        runner, vm = self.runners.get(key), self.vms.get(key)
        if runner is not None and vm is not None and runner.ephemeral(container) is not None:
            await self._attach_ephemeral(runner, vm, container, io)
            return
        machine = self._running(namespace, pod, container).machine
        assert machine is not None
        await attach_console(machine.console_socket, io)

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        vm = self.vms.get(f"{namespace}/{pod}")
        if vm is None or vm.address is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} has no address")
        await forward_tcp(vm.address, port, stream)

    async def stats_summary(self) -> dict[str, Any]:
        return summary(*await self._sample())

    async def metrics_resource(self) -> str:
        return resource_metrics(*await self._sample())

    async def _sample(self) -> tuple[NodeUsage, list[PodUsage], float]:
        """The node's and each running VM's QEMU usage now (a VM stopping meanwhile is left
        out)."""
        readings = []
        for vm in list(self.vms.values()):
            if vm.machine is None:
                continue
            try:
                usage = await vm.machine.usage()
            except Exception as e:
                log.debug("%s: no stats: %s", vm.uid, e)
                continue
            meta = vm.pod.metadata
            assert meta is not None
            readings.append(
                QemuReading(
                    namespace=str(meta.namespace),
                    name=str(meta.name),
                    uid=vm.uid,
                    container=vm.container,
                    started=vm.started_wall,
                    cpu_ns=usage.cpu_ns,
                    memory_bytes=usage.memory_bytes,
                )
            )
        when = time.time()
        return *self._usage.sample(readings, self.memory, when), when


def _imported(vm: VM) -> bool:
    """The VM is an existing libvirt domain (`_domainimport`) with its own NICs."""
    return _domainimport.DOMAIN_ANNOTATION in vm.annotations


def _uid(runner: PodRunner) -> str:
    return str(runner.pod.metadata.uid)  # type: ignore[union-attr]


def _recorded_exit(machine_dir: Path) -> int:
    """The exit code the machine's watcher recorded (`exit.json`), else 137 (unknown)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return int(json.loads((machine_dir / "exit.json").read_text())["code"])
    return 137


def _moment(text: object) -> datetime | None:
    """A time `VM.save` wrote, or None (missing: state written by an older agent)."""
    with contextlib.suppress(TypeError, ValueError):
        return datetime.fromisoformat(str(text)) if text else None
    return None


def _image_backoff() -> Backoff:
    """The kubelet's image back-off (pulls, and making the VM's disks): the first failure is
    tried again after a second, as the kubelet's first retry comes at once, then 10 s doubling
    to 5 min, without jitter (its waits are read in the pod's events)."""
    return Backoff(initial=INITIAL_SECONDS, cap=MAX_SECONDS, jitter=0.0)


def _host_memory() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 4 * 2**30


def create(context: ProviderContext) -> VMProvider:
    """Entry point (`vkubelet.providers`: vm)."""
    from ._config import ConfigError, load_config
    from ._net import bridge_missing, foreign_routes, host_routes
    from ._runtime import QemuRuntime

    config = load_config(context.config_path)
    # Before anything is made on the host: a missing bridge, or a range another route covers,
    # is a broken node. (With libvirt the VMs' network is the daemon's host's: `_lvnet`.)
    if config.runtime == "libvirt":
        pass
    elif config.bridged is not None:
        if (why := bridge_missing(config.bridged.bridge)) is not None:
            raise ConfigError(f"{config.origin}: {why}")
    elif clash := foreign_routes(config.pod_cidr, host_routes()):
        raise ConfigError(
            f"{config.origin}: podCIDR: {config.pod_cidr} overlaps route(s) of this host that "
            f"are not its VMs': {'; '.join(clash[:3])}. Give the node a range of its own."
        )
    runtime: QemuRuntime
    if config.runtime == "libvirt" and config.libvirt_pool is not None:
        from ._pool import PooledLibvirtRuntime  # disks as the daemon's volumes

        runtime = PooledLibvirtRuntime(config, context.node_name)
    elif config.runtime == "libvirt":
        from ._libvirt import LibvirtRuntime

        runtime = LibvirtRuntime(config, context.node_name)
    else:
        runtime = QemuRuntime(config)
    return VMProvider(
        context.node_name,
        config,
        runtime,
        host_ip=context.internal_ip,
        events=context.events,
    )
