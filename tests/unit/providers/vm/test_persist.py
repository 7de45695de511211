"""Persistent machines on the fake runtime: a pod annotated `vm.vkubelet.io/machine` keeps its
disks in the machine's directory, the next pod of that machine boots from them, a machine runs
in one pod at a time, and machine directories go only when their VirtualMachine is gone."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm import _persist
from vkubelet.providers.vm._config import ConfigError, parse_config
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.sdk import ProviderError, ResolvedPod
from vkubelet.sdk.volumes import EmptyDirVolume
from vkubelet.testing.harness import eventually

from .fakes import Events, FakeRuntime, launched, provider_for, state


def machine_pod(
    name: str, machine: str = "m-1", *, namespace: str = "ns", vm: str | None = None, **spec: Any
) -> Pod:
    """A pod of machine `machine`; `vm`: the uid of the VirtualMachine controlling it."""
    owner = {"apiVersion": "vkubelet.io/v1alpha1", "kind": "VirtualMachine", "name": "db"}
    owners = [{**owner, "uid": vm, "controller": True}]
    body = {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "annotations": {_persist.MACHINE_ANNOTATION: machine},
            **({"ownerReferences": owners} if vm else {}),
        },
        "spec": {
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}],
            "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}],
            **spec,
        },
    }
    return Pod.from_dict(body)  # type: ignore[return-value]


def resolved(pod: Pod) -> ResolvedPod:
    return ResolvedPod(pod, volumes={"data": EmptyDirVolume("data", size_limit="1Gi")})


async def _running(provider: VMProvider, name: str) -> bool:
    pod = await provider.get_pod("ns", name)
    statuses = (pod.status.containerStatuses if pod and pod.status else None) or []
    return bool(statuses and statuses[0].state and statuses[0].state.running)


async def _gone(provider: VMProvider, name: str) -> bool:
    return await provider.get_pod("ns", name) is None


async def test_the_next_pod_of_a_machine_boots_from_the_same_disks(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    first = machine_pod("db-abcde")
    await provider.create_pod(resolved(first))
    await eventually(lambda: _running(provider, "db-abcde"))
    machine_dir = tmp_path / "s" / "machines" / "m-1"
    assert _persist.machine_dir(provider.config.state_dir, first) == machine_dir
    disks = [Path(p) for p, _ in runtime.launches[0].disks]
    assert disks == [machine_dir / "root.qcow2", machine_dir / "empty-data.qcow2"]
    (machine_dir / "root.qcow2").write_bytes(b"written by the guest")

    await provider.delete_pod(first, 5)
    await eventually(lambda: _gone(provider, "db-abcde"))
    assert (machine_dir / "root.qcow2").read_bytes() == b"written by the guest"
    assert not (tmp_path / "s" / "vms" / "uid-db-abcde").exists()  # the run dir goes

    second = machine_pod("db-fghij")
    await provider.create_pod(resolved(second))
    await eventually(lambda: _running(provider, "db-fghij"))
    assert [Path(p) for p, _ in runtime.launches[1].disks] == disks
    assert (machine_dir / "root.qcow2").read_bytes() == b"written by the guest"
    assert _persist.machine_images(tmp_path / "s") == {"abc"}  # kept from the image GC


async def test_a_machine_runs_in_one_pod_at_a_time(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    await provider.create_pod(ResolvedPod(machine_pod("db-1")))
    await eventually(lambda: _running(provider, "db-1"))
    await provider.create_pod(ResolvedPod(machine_pod("db-2")))

    async def refused() -> bool:
        _, status = await state(provider, "db-2")
        waiting = status.state.waiting if status else None
        return waiting is not None and "still in use by pod ns/db-1" in (waiting.message or "")

    await eventually(refused)
    assert len(runtime.launches) == 1


async def test_a_plain_pod_keeps_its_disks_in_its_run_directory(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    pod = Pod.from_dict(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "uid-p"},
            "spec": {"containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}]},
        }
    )
    assert isinstance(pod, Pod)
    assert _persist.machine_dir(provider.config.state_dir, pod) is None
    await provider.create_pod(ResolvedPod(pod))
    await eventually(lambda: launched(runtime))
    assert Path(runtime.launches[0].disks[0][0]).parent == tmp_path / "s" / "vms" / "uid-p"


def test_a_machine_id_that_is_not_one_path_component_is_refused() -> None:
    for bad in ("../etc", "a/b", "..", "", "x" * 129):
        with pytest.raises(ValueError, match="not a machine id"):
            _persist.machine_id(machine_pod("p", machine=bad))
    assert _persist.machine_id(machine_pod("p", machine="0b6f-41c2.x_y")) == "0b6f-41c2.x_y"


async def test_machine_gc_removes_only_machines_whose_virtual_machine_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for ident in ("alive", "gone", "running"):
        (tmp_path / "machines" / ident).mkdir(parents=True)
    answers: list[set[str] | None] = [None, {"alive"}]

    async def existing(kubeconfig: Path) -> set[str] | None:
        return answers.pop(0)

    monkeypatch.setattr(_persist, "existing_machines", existing)
    # The VirtualMachines cannot be listed (no CRD, apiserver away): nothing goes.
    assert await _persist.gc_machines(tmp_path, Path("k"), {"running"}) == []
    removed = await _persist.gc_machines(tmp_path, Path("k"), {"running"})
    assert removed == ["gone"]
    assert sorted(p.name for p in (tmp_path / "machines").iterdir()) == ["alive", "running"]


def test_the_machine_gc_setting_is_checked(tmp_path: Path) -> None:
    config = parse_config(
        {"machineGC": {"kubeconfig": "k.yaml", "intervalSeconds": 60}},
        origin="vm.yaml",
        base=tmp_path,
    )
    assert config.machine_gc == _persist.MachineGC(tmp_path / "k.yaml", 60.0)
    with pytest.raises(ConfigError, match=r"machineGC\.intervalSeconds"):
        parse_config(
            {"machineGC": {"kubeconfig": "k", "intervalSeconds": 0}}, origin="v", base=tmp_path
        )


def test_a_machine_gc_without_a_kubeconfig_uses_the_process_s_own_credentials(
    tmp_path: Path,
) -> None:
    """What the Helm chart's agent sets: the pod's service account (found as kubectl would)."""
    config = parse_config({"machineGC": {"intervalSeconds": 5}}, origin="vm.yaml", base=tmp_path)
    assert config.machine_gc == _persist.MachineGC(None, 5.0)


def _checksums(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


async def test_a_pod_of_another_namespace_naming_a_machine_is_refused_its_files_untouched(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    owner = machine_pod("db-a")
    await provider.create_pod(resolved(owner))
    await eventually(lambda: _running(provider, "db-a"))
    machine = tmp_path / "s" / "machines" / "m-1"
    (machine / "root.qcow2").write_bytes(b"namespace ns's data")
    await provider.delete_pod(owner, 5)  # powered off: its disks wait for its next pod
    await eventually(lambda: _gone(provider, "db-a"))
    before = _checksums(machine)

    with pytest.raises(ProviderError) as refused:
        await provider.create_pod(resolved(machine_pod("db-b", namespace="other")))
    assert refused.value.reason == "MachineRefused"
    assert "machine m-1 belongs to another namespace" in refused.value.message
    assert _checksums(machine) == before
    assert len(runtime.launches) == 1
    assert await provider.get_pod("other", "db-b") is None
    # its owner's next pod boots it as before
    await provider.create_pod(resolved(machine_pod("db-c")))
    await eventually(lambda: _running(provider, "db-c"))
    assert (machine / "root.qcow2").read_bytes() == b"namespace ns's data"


def test_a_virtual_machine_s_machine_is_used_only_by_that_virtual_machine_s_pods(
    tmp_path: Path,
) -> None:
    made = _persist.claim_machine(tmp_path, machine_pod("db-1", machine="uid-vm", vm="uid-vm"))
    assert made == tmp_path / "machines" / "uid-vm"
    assert _persist.machine_dir(tmp_path, machine_pod("db-2", machine="uid-vm", vm="uid-vm"))
    for intruder in (
        machine_pod("x", machine="uid-vm"),  # not a VirtualMachine's pod
        machine_pod("x", machine="uid-vm", vm="uid-other"),  # another VirtualMachine's
        machine_pod("x", machine="uid-vm", vm="uid-vm", namespace="other"),
    ):
        with pytest.raises(_persist.MachineRefused):
            _persist.claim_machine(tmp_path, intruder)
        with pytest.raises(_persist.MachineRefused):
            _persist.machine_dir(tmp_path, intruder)


def test_a_machine_an_older_version_made_is_adopted_by_its_first_claimant_and_tightened(
    tmp_path: Path,
) -> None:
    machine = tmp_path / "machines" / "m-1"
    (machine / "hibernate").mkdir(parents=True, mode=0o755)
    (machine / "machine.json").write_text('{"images": ["abc"]}')
    for name in ("root.qcow2", "hibernate/state"):
        (machine / name).write_bytes(b"data")
        (machine / name).chmod(0o644)
    (machine / "link").symlink_to("/etc/hostname")  # never followed, never changed
    mode = Path("/etc/hostname").stat().st_mode

    assert _persist.claim_machine(tmp_path, machine_pod("db-1")) == machine
    record = json.loads((machine / "machine.json").read_text())
    assert record == {"images": ["abc"], "owner": {"namespace": "ns", "virtualMachine": None}}
    for path in (machine, machine / "hibernate"):
        assert path.stat().st_mode & 0o777 == 0o700
    for name in ("root.qcow2", "hibernate/state", "machine.json"):
        assert (machine / name).stat().st_mode & 0o777 == 0o600
    assert Path("/etc/hostname").stat().st_mode == mode
    with pytest.raises(_persist.MachineRefused):
        _persist.claim_machine(tmp_path, machine_pod("x", namespace="other"))


async def test_an_upgraded_agent_gives_an_adopted_vm_s_machine_to_its_pod_before_any_other(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    first = provider_for(tmp_path, runtime, events)
    await first.create_pod(resolved(machine_pod("db-a")))
    await eventually(lambda: _running(first, "db-a"))
    record = tmp_path / "s" / "machines" / "m-1" / "machine.json"
    older = {k: v for k, v in json.loads(record.read_text()).items() if k != "owner"}
    record.write_text(json.dumps(older))  # as a version before owners left it
    await first.aclose()  # the agent is upgraded; the VM runs on

    second = provider_for(tmp_path, runtime, events)
    with pytest.raises(ProviderError, match="belongs to another namespace"):
        await second.pod_ips(machine_pod("db-b", namespace="other"))
    assert json.loads(record.read_text())["owner"] == {"namespace": "ns", "virtualMachine": None}
    assert len(runtime.launches) == 1


async def test_machine_gc_drops_the_runtime_s_state_first_and_keeps_a_machine_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for ident in ("saved", "unreachable"):
        (tmp_path / "machines" / ident).mkdir(parents=True)

    async def existing(kubeconfig: Path) -> set[str] | None:
        return set()

    discarded: list[str] = []

    async def discard(directory: Path) -> None:
        if directory.name == "unreachable":
            raise RuntimeError("libvirt qemu+ssh://hv-2/system: Cannot recv data")
        discarded.append(directory.name)

    monkeypatch.setattr(_persist, "existing_machines", existing)
    assert await _persist.gc_machines(tmp_path, Path("k"), set(), discard) == ["saved"]
    assert discarded == ["saved"]
    assert [p.name for p in (tmp_path / "machines").iterdir()] == ["unreachable"]
