"""The decisions behind hibernation, live resize and PVC disks (no QEMU, no apiserver)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

import pytest
from lightkube.models.core_v1 import (
    ContainerState,
    ContainerStateTerminated,
    ContainerStatus,
    PodCondition,
    PodStatus,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm import _hibernate, _hotplug, _resize, _volumes
from vkubelet.providers.vm._config import ConfigError, parse_config
from vkubelet.providers.vm._resize import Decision, Headroom, Size, decide
from vkubelet.providers.vm._vm import Launch, PowerState, ResizeState, decorate

ROOM = Headroom(max_vcpus=4, max_memory_mib=2048, slots=2)


def _decide(current: Size, desired: Size, dimms: int = 0) -> Decision:
    return decide(current, desired, ROOM, dimms=dimms, node_vcpus=8, node_memory_mib=8192)


def test_growth_within_the_headroom_is_live() -> None:
    assert _decide(Size(1, 256), Size(2, 768)) == Decision(2, 768, None)


def test_shrinking_waits_for_the_next_power_cycle() -> None:
    decision = _decide(Size(2, 768), Size(1, 512))
    assert (decision.vcpus, decision.memory_mib) == (2, 768)
    assert decision.pending is not None
    reason, message = decision.pending
    assert reason == "Deferred"
    assert "vCPUs cannot be removed live" in message
    assert "memory cannot be removed live" in message
    assert message.endswith("applied at next power cycle")


def test_beyond_the_headroom_is_deferred_but_what_fits_is_applied() -> None:
    decision = _decide(Size(1, 256), Size(6, 768))
    assert (decision.vcpus, decision.memory_mib) == (1, 768)
    assert decision.pending is not None and decision.pending[0] == "Deferred"
    assert "6 vCPUs exceed the 4" in decision.pending[1]


def test_memory_grows_in_whole_blocks_and_while_slots_are_free() -> None:
    odd = _decide(Size(1, 256), Size(1, 300))
    assert odd.memory_mib == 256 and odd.pending is not None and "128 MiB" in odd.pending[1]
    full = _decide(Size(1, 256), Size(1, 512), dimms=2)
    assert full.memory_mib == 256 and full.pending is not None and "slots" in full.pending[1]
    too_much = _decide(Size(1, 256), Size(1, 4096))
    assert too_much.pending is not None and "2048 MiB" in too_much.pending[1]


def test_more_than_the_node_has_is_infeasible() -> None:
    decision = decide(
        Size(1, 256), Size(16, 256), ROOM, dimms=0, node_vcpus=2, node_memory_mib=4096
    )
    assert decision == Decision(1, 256, decision.pending)
    assert decision.pending is not None and decision.pending[0] == "Infeasible"


def test_headroom_comes_from_the_config_or_the_pod_s_annotations() -> None:
    config = _resize.headroom_for({}, Size(1, 256), 4, 2 * 2**30, 4)
    assert config == Headroom(4, 2048, 4)
    annotated = _resize.headroom_for(
        {"vm.vkubelet.io/max-cpus": "8", "vm.vkubelet.io/max-memory": "1Gi"},
        Size(1, 256),
        4,
        2 * 2**30,
        4,
    )
    assert annotated == Headroom(8, 1024, 4)
    none = _resize.headroom_for({}, Size(2, 4096), 0, 0, 4)
    assert none == Headroom(2, 4096, 0)  # no room: a fixed machine, no slots
    with pytest.raises(ValueError, match="max-cpus"):
        _resize.headroom_for({"vm.vkubelet.io/max-cpus": "many"}, Size(1, 256), 4, 0, 4)


def test_hotplugged_devices_are_recreated_for_a_resume() -> None:
    launch = Launch(
        vcpus=1,
        memory_mib=256,
        hotplug={
            "cpus": [
                {
                    "driver": "qemu64-x86_64-cpu",
                    "id": "vcpu1",
                    "props": {"socket-id": 0, "core-id": 1},
                }
            ],
            "dimms": [{"id": "dimm1", "mib": 512}],
        },
    )
    assert _hotplug.qemu_args(launch.hotplug) == (
        "-device", "qemu64-x86_64-cpu,id=vcpu1,core-id=1,socket-id=0",
        "-object", "memory-backend-ram,id=mem-dimm1,size=512M",
        "-device", "pc-dimm,id=dimm1,memdev=mem-dimm1",
    )  # fmt: skip
    assert _resize.running_size(launch) == Size(2, 768)


def _pod(annotations: dict[str, str]) -> Pod:
    return Pod(metadata=ObjectMeta(name="p", annotations=annotations))


def test_the_machine_dir_is_only_for_plain_machine_ids(tmp_path: Path) -> None:
    machine = "vm.vkubelet.io/machine"
    assert _hibernate.machine_dir(_pod({machine: "0b1c-uid"}), tmp_path) == (
        tmp_path / "machines" / "0b1c-uid"
    )
    for bad in ("../etc", "a/b", "x; rm -rf /", ""):
        assert _hibernate.machine_dir(_pod({machine: bad}), tmp_path) is None
    assert _hibernate.machine_dir(_pod({}), tmp_path) is None


def test_hibernate_is_asked_by_the_power_off_annotation() -> None:
    assert _hibernate.wants_hibernate(_pod({"vm.vkubelet.io/power-off": "Hibernate"}))
    assert not _hibernate.wants_hibernate(_pod({"vm.vkubelet.io/power-off": "Shutdown"}))
    assert not _hibernate.wants_hibernate(_pod({}))


def test_a_saved_state_resumes_only_with_the_same_disks(tmp_path: Path) -> None:
    saved = _hibernate.Saved(
        tmp_path / "state", Launch(disks=[("r", "virtio")], seed="s", claims=[]), 0.0, 1
    )
    assert saved.compatible(Launch(disks=[("r", "virtio")], seed="another pod's")) is None
    assert saved.compatible(Launch(disks=[("r2", "virtio")], seed="s"))  # another root file
    assert saved.compatible(Launch(disks=[("r", "virtio"), ("x", "virtio")], seed="s"))
    assert saved.compatible(Launch(disks=[("r", "virtio")], seed="s", claims=[("c", "c")]))
    # the resumed launch takes the saved layout (hotplugged devices included), not the pod's
    launch = Launch(vcpus=1, memory_mib=256, seed="new")
    layout = Launch(vcpus=2, memory_mib=512, hotplug={"cpus": []})
    resumed = _hibernate.resumed_launch(launch, _hibernate.Saved(tmp_path, layout, 0.0, 1))
    assert resumed == Launch(vcpus=2, memory_mib=512, seed="new", hotplug={"cpus": []})


def test_the_incoming_command_quotes_the_state_path(tmp_path: Path) -> None:
    saved = _hibernate.Saved(tmp_path / "a b" / "state", Launch(), 0.0, 1)
    flag, uri = _hibernate.incoming_args(saved)
    assert flag == "-incoming" and uri == f"exec:cat '{tmp_path}/a b/state'"


def test_status_says_hibernated_and_carries_the_resize_fields() -> None:
    status = PodStatus(
        conditions=[PodCondition(type="Ready", status="False")],
        containerStatuses=[
            ContainerStatus(
                name="vm",
                image="i",
                imageID="",
                ready=False,
                restartCount=0,
                state=ContainerState(terminated=ContainerStateTerminated(exitCode=0)),
            )
        ],
    )
    power = PowerState(outcome=("Hibernated", "state saved"))
    power.resize = ResizeState(
        applied={"limits": {"cpu": "2"}}, pending=("Deferred", "x: applied at next power cycle")
    )
    decorate(status, power, "vm")
    cs = status.containerStatuses[0]  # type: ignore[index]
    assert cs.state.terminated.reason == "Hibernated"  # type: ignore[union-attr]
    assert cs.resources is not None and cs.resources.limits == {"cpu": "2"}
    assert cs.allocatedResources == {"cpu": "2"}
    pending = [c for c in status.conditions or [] if c.type == "PodResizePending"]
    assert [(c.status, c.reason) for c in pending] == [("True", "Deferred")]
    # resolved later: reported False (a merge patch would otherwise keep the True one)
    power.resize.pending = None
    decorate(status, power, "vm")
    pending = [c for c in status.conditions or [] if c.type == "PodResizePending"]
    assert [c.status for c in pending] == ["False"]


# -- PVC disks ----------------------------------------------------------------------------------
def _claim(**meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "data", "namespace": "ns", "uid": "u-1", **meta},
        "spec": {
            "storageClassName": "vkubelet-vm-disk",
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "64Mi"}},
        },
    }


def test_a_claim_is_provisioned_by_the_node_its_consumer_runs_on() -> None:
    classes = {"vkubelet-vm-disk"}
    selected = _claim(annotations={"volume.kubernetes.io/selected-node": "hv-1"})
    assert _volumes.to_provision(selected, "hv-1", classes, {})
    assert not _volumes.to_provision(selected, "hv-2", classes, {})
    # a pod that names its node (no scheduler) selects it too
    assert _volumes.to_provision(_claim(), "hv-1", classes, {"ns/data": "hv-1"})
    assert not _volumes.to_provision(_claim(), "hv-1", classes, {})
    bound = _claim(annotations={"volume.kubernetes.io/selected-node": "hv-1"})
    bound["spec"]["volumeName"] = "pv"
    assert not _volumes.to_provision(bound, "hv-1", classes, {})
    assert not _volumes.to_provision(selected, "hv-1", {"other"}, {})


def test_the_pv_is_a_local_volume_of_this_node_bound_to_the_claim(tmp_path: Path) -> None:
    pv = _volumes.pv_for(_claim(), "hv-1", tmp_path / "pvc-u-1.qcow2", "Retain")
    assert pv["metadata"]["name"] == "pvc-u-1"
    assert pv["spec"]["claimRef"]["uid"] == "u-1"
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["capacity"] == {"storage": "64Mi"}
    assert pv["spec"]["local"]["path"] == str(tmp_path / "pvc-u-1.qcow2")
    term = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["hv-1"]


def test_only_released_pvs_of_ours_with_delete_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "pvc-u-1.qcow2"
    pv = _volumes.pv_for(_claim(), "hv-1", path, "Delete")
    pv["status"] = {"phase": "Released"}
    assert _volumes.to_delete(pv, "hv-1", tmp_path) == path
    assert _volumes.to_delete(pv, "hv-2", tmp_path) is None
    assert _volumes.to_delete(pv, "hv-1", tmp_path / "elsewhere") is None
    pv["status"] = {"phase": "Bound"}
    assert _volumes.to_delete(pv, "hv-1", tmp_path) is None
    retained = _volumes.pv_for(_claim(), "hv-1", path, "Retain")
    retained["status"] = {"phase": "Released"}
    assert _volumes.to_delete(retained, "hv-1", tmp_path) is None


class _Api:
    def __init__(self, objects: dict[str, dict[str, Any]]) -> None:
        self.objects = objects

    async def get(self, path: str) -> dict[str, Any]:
        return self.objects[path]


async def test_a_claim_gets_a_volume_only_when_the_volume_is_bound_to_exactly_that_claim(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "pvc-u-1.qcow2"
    disk.write_bytes(b"namespace ns's disk")
    pv = _volumes.pv_for(_claim(), "hv-1", disk, "Delete") | {"status": {"phase": "Bound"}}
    mine = _claim() | {"status": {"phase": "Bound"}}
    mine["spec"]["volumeName"] = "pvc-u-1"
    # namespace other's claim, pre-bound by its author to ns's volume: the PV controller never
    # binds it (the PV's claimRef names ns/data), so it stays Pending
    theirs = _claim(namespace="other", uid="u-2") | {"status": {"phase": "Pending"}}
    theirs["spec"]["volumeName"] = "pvc-u-1"
    provisioner = _volumes.DiskProvisioner(
        "hv-1", _volumes.StorageConfig(tmp_path / "k"), tmp_path, _no_blank
    )
    claims = "/api/v1/namespaces/{}/persistentvolumeclaims/data"
    api = _Api(
        {
            claims.format("ns"): mine,
            claims.format("other"): theirs,
            "/api/v1/persistentvolumes/pvc-u-1": pv,
        }
    )
    provisioner._client = api  # type: ignore[assignment]
    assert (await provisioner.claim_disk("ns", "data")).path == disk
    with pytest.raises(_volumes.VolumeNotReady, match="bound to another claim") as refused:
        await provisioner.claim_disk("other", "data")
    assert refused.value.reason == "ContainerCreating"
    # the same name and namespace but another claim (deleted and made again): not its volume
    again = _claim(uid="u-3") | {"status": {"phase": "Bound"}}
    again["spec"]["volumeName"] = "pvc-u-1"
    api.objects[claims.format("ns")] = again
    with pytest.raises(_volumes.VolumeNotReady, match="bound to another claim"):
        await provisioner.claim_disk("ns", "data")
    assert disk.read_bytes() == b"namespace ns's disk"


async def _no_blank(path: Path, size: int) -> None:
    raise AssertionError("no disk is made here")


def test_claim_disks_attach_with_the_claim_name_as_serial(tmp_path: Path) -> None:
    disk = _volumes.ClaimDisk("a-very-long-claim-name-indeed", tmp_path / "x.qcow2")
    assert disk.serial == "a-very-long-claim-na"  # virtio-blk keeps 20 bytes
    args = _volumes.drive_args([(str(tmp_path / "x,y.qcow2"), "data")])
    assert args == (
        "-drive", f"file={tmp_path}/x,,y.qcow2,if=none,id=claim0,format=qcow2",
        "-device", "virtio-blk-pci,drive=claim0,serial=data",
    )  # fmt: skip


def test_config_takes_hotplug_headroom_and_storage_credentials(tmp_path: Path) -> None:
    config = parse_config(
        {
            "hotplug": {"maxCpus": 8, "maxMemory": "4Gi", "memorySlots": 2},
            "storage": {"kubeconfig": "admin.kubeconfig"},
        },
        origin="vm.yaml",
        base=tmp_path,
    )
    assert (config.hotplug_max_vcpus, config.hotplug_max_memory, config.hotplug_slots) == (
        8,
        4 * 2**30,
        2,
    )
    assert config.storage is not None and config.storage.kubeconfig == tmp_path / "admin.kubeconfig"
    with pytest.raises(ConfigError, match=r"vm.yaml: hotplug.maxCpus"):
        parse_config({"hotplug": {"maxCpus": -1}}, origin="vm.yaml", base=tmp_path)
    with pytest.raises(ConfigError, match=r"vm.yaml: storage.kubeconfig"):
        parse_config({"storage": {}}, origin="vm.yaml", base=tmp_path)


class _Monitor:
    def __init__(self, fail: str) -> None:
        self.fail, self.calls = fail, []  # type: tuple[str, list[str]]

    async def execute(self, command: str, arguments: Any = None) -> Any:
        from vkubelet.providers.vm._qmp import MonitorUnavailable

        self.calls.append(command)
        if command == self.fail:
            raise MonitorUnavailable("QMP migrate: gone")
        if command == "query-migrate":
            return {"status": "failed", "error-desc": "disk full"}
        return {}


@pytest.mark.parametrize("fail", ["migrate", "none"])
async def test_a_failed_save_leaves_the_guest_running_and_says_why(
    tmp_path: Path, fail: str
) -> None:
    monitor: Any = _Monitor(fail)
    with pytest.raises(_hibernate.HibernateError) as caught:
        await _hibernate.hibernate(monitor, tmp_path, Launch(vcpus=1))
    assert monitor.calls[0] == "stop" and monitor.calls[-1] == "cont"
    if fail == "none":
        assert "disk full" in str(caught.value)
    assert _hibernate.saved_state(tmp_path) is None


class _SavingMonitor:
    """QEMU saving the guest's memory: `exec:` runs its command in a shell with QEMU's umask
    (the agent's, 022 here)."""

    async def execute(self, command: str, arguments: Any = None) -> Any:
        if command == "migrate":
            script = arguments["uri"].removeprefix("exec:")
            shell = await asyncio.create_subprocess_exec(
                "sh", "-c", f"umask 022; {script}", stdin=asyncio.subprocess.PIPE
            )
            await shell.communicate(b"RAM" * 100)
        if command == "query-migrate":
            return {"status": "completed"}
        return {}


async def test_a_hibernated_guest_s_memory_is_readable_only_by_the_agent(tmp_path: Path) -> None:
    machine = tmp_path / "machine"
    monitor: Any = _SavingMonitor()
    await _hibernate.hibernate(monitor, machine, Launch(vcpus=1))
    saved = _hibernate.saved_state(machine)
    assert saved is not None and saved.state.read_bytes() == b"RAM" * 100
    assert saved.state.parent.stat().st_mode & 0o777 == 0o700
    for name in ("state", "meta.json"):
        assert (saved.state.parent / name).stat().st_mode & 0o777 == 0o600


# -- hibernation by libvirt (managed save): the state is the domain's, the record names it ----
URI = "qemu+ssh://root@hv-2/system"


class _Domain:
    """A libvirt machine as `_hibernate` sees it: it saves itself (`SavingMachine`)."""

    runtime, monitor, agent, reference = "libvirt", None, None, "dom-uuid"

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.calls = refuse, list[str]()

    async def save_state(self, timeout: float) -> str:  # noqa: ASYNC109
        from vkubelet.providers.vm._machine import MachineError

        self.calls.append("save")
        if self.refuse is not None:
            raise MachineError(self.refuse)
        return "state saved by libvirt (managed save) in 1.00 s"

    async def end(self, outcome: Any) -> Any:
        self.calls.append(f"end {outcome.reason}")
        return outcome

    async def stop(self, grace: float) -> Any:
        self.calls.append("stop")


class _Host:
    def __init__(
        self, tmp_path: Path, runtime: Literal["qemu", "libvirt"] = "libvirt", uri: str = URI
    ) -> None:
        from vkubelet.providers.vm._config import VMConfig

        extra: dict[str, Any] = {"libvirt_uri": uri} if runtime == "libvirt" else {}
        self.config = VMConfig(
            state_dir=tmp_path, image_store=tmp_path / "i", runtime=runtime, **extra
        )
        self.events: list[str] = []
        self.restores: list[str | None] = []
        self.discarded: list[str] = []
        self.restore_fails: str | None = None

    def event(self, vm: Any, kind: str, reason: str, message: str) -> None:
        self.events.append(reason)

    async def launch_machine(
        self, vm: Any, extra_args: tuple[str, ...] = (), *, restore: str | None = None
    ) -> Any:
        from vkubelet.providers.vm._backend import RestoreFailed

        self.restores.append(restore)
        if restore is not None and self.restore_fails is not None:
            raise RestoreFailed(self.restore_fails)
        return _Domain()

    async def discard_saved(self, reference: str) -> None:
        self.discarded.append(reference)


def _machine_vm(tmp_path: Path) -> Any:
    from lightkube.models.core_v1 import Container, PodSpec

    from vkubelet.providers.vm._vm import VM

    pod = Pod(
        metadata=ObjectMeta(name="db-1", uid="u1", annotations={"vm.vkubelet.io/machine": "m1"}),
        spec=PodSpec(containers=[Container(name="vm", image="vm.vkubelet.io/tiny")]),
    )
    (tmp_path / "vms" / "u1").mkdir(parents=True, exist_ok=True)
    return VM(pod, tmp_path / "vms" / "u1", launch=Launch(disks=[("r", "virtio")], seed="s"))


async def _hibernated(tmp_path: Path) -> tuple[_Host, Any]:
    host, vm, domain = _Host(tmp_path), _machine_vm(tmp_path), _Domain()
    vm.power.hibernate = True
    saving = _hibernate.power_off(host, vm, domain, 30.0)  # type: ignore[arg-type]
    assert saving is not None
    await saving
    assert domain.calls == ["save", "end Hibernated"]
    return host, vm


async def test_libvirt_hibernates_by_managed_save_and_records_the_domain(tmp_path: Path) -> None:
    host, vm = await _hibernated(tmp_path)
    saved = _hibernate.saved_state(tmp_path / "machines" / "m1")
    assert saved is not None and (saved.domain, saved.uri) == ("dom-uuid", URI)
    assert vm.power.outcome[0] == "Hibernated" and host.events == ["Hibernated"]


async def test_a_refused_managed_save_shuts_the_guest_down_and_keeps_no_record(
    tmp_path: Path,
) -> None:
    host, vm, domain = _Host(tmp_path), _machine_vm(tmp_path), _Domain("disk full")
    vm.power.hibernate = True
    await _hibernate.power_off(host, vm, domain, 30.0)  # type: ignore[arg-type, misc]
    assert domain.calls == ["save", "stop"]
    assert vm.power.outcome == ("HibernateFailed", "disk full")
    assert _hibernate.saved_state(tmp_path / "machines" / "m1") is None


async def test_the_next_pod_restores_the_saved_domain_and_the_record_goes(tmp_path: Path) -> None:
    host, _ = await _hibernated(tmp_path)
    await _hibernate.launch(host, _machine_vm(tmp_path))  # type: ignore[arg-type]
    assert host.restores == ["dom-uuid"] and host.events[-1] == "Resumed"
    assert _hibernate.saved_state(tmp_path / "machines" / "m1") is None


async def test_a_failed_restore_drops_the_domain_and_boots_cold(tmp_path: Path) -> None:
    host, _ = await _hibernated(tmp_path)
    host.restore_fails = "the hibernated domain dom-uuid is gone"
    await _hibernate.launch(host, _machine_vm(tmp_path))  # type: ignore[arg-type]
    assert host.restores == ["dom-uuid", None] and "ResumeFailed" in host.events
    assert host.discarded == ["dom-uuid"]
    assert _hibernate.saved_state(tmp_path / "machines" / "m1") is None


@pytest.mark.parametrize(("runtime", "uri"), [("qemu", ""), ("libvirt", "qemu:///system")])
async def test_only_the_daemon_that_saved_a_domain_resumes_it(
    tmp_path: Path, runtime: Literal["qemu", "libvirt"], uri: str
) -> None:
    _, _ = await _hibernated(tmp_path)
    other = _Host(tmp_path, runtime, uri)
    await _hibernate.launch(other, _machine_vm(tmp_path))  # type: ignore[arg-type]
    assert other.restores == [None] and "ResumeRefused" in other.events
    assert other.discarded == []  # not this node's daemon: left for the one that has it
