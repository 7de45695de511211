"""QEMU's argv from a MachineSpec, and how QEMU's reports become a MachineExit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vkubelet.providers.vm._machine import (
    Disk,
    Machine,
    MachineError,
    MachineSpec,
    _outcome_of,
    _spec_from_json,
    _spec_to_json,
    qemu_argv,
)
from vkubelet.providers.vm._net import GuestNetwork

NETWORK = GuestNetwork("10.88.0.2", 24, "10.88.0.1", "52:54:00:01:02:03")


def _spec(**changes: object) -> MachineSpec:
    base: dict[str, object] = {
        "name": "ns/web-0",
        "run_dir": Path("/run/vk/m1"),
        "vcpus": 2,
        "memory_mib": 512,
        "disks": (Disk(Path("/images/root.qcow2")),),
        "seed": Path("/run/vk/m1/seed.iso"),
        "network": NETWORK,
        "netns": "vkvm-abc",
    }
    base.update(changes)
    return MachineSpec(**base)  # type: ignore[arg-type]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_qemu_runs_detached_in_the_pods_netns_and_keeps_a_powered_off_guest_observable() -> None:
    argv = qemu_argv(_spec())
    assert argv[:5] == ["ip", "netns", "exec", "vkvm-abc", "qemu-system-x86_64"]
    assert "-daemonize" in argv and "-no-shutdown" in argv
    assert _option(argv, "-pidfile") == ["/run/vk/m1/pid"]
    assert _option(argv, "-smp") == ["2"] and _option(argv, "-m") == ["512M"]
    assert "tap,id=net0,ifname=vktap0,script=no,downscript=no" in _option(argv, "-netdev")
    assert any("mac=52:54:00:01:02:03" in d for d in _option(argv, "-device"))


def test_a_comma_in_a_pod_field_cannot_add_qemu_options() -> None:
    argv = qemu_argv(_spec(name="ns/web,debug-threads=on", netns=None, network=None))
    assert argv[0] == "qemu-system-x86_64"
    assert _option(argv, "-name") == ["guest=ns/web,,debug-threads=on"]
    assert "-netdev" not in argv


def test_root_disk_boots_first_and_the_seed_is_read_only() -> None:
    disks = (
        Disk(Path("/images/root.qcow2")),
        Disk(Path("/scratch/empty.raw"), format="raw", bus="scsi"),
    )
    argv = qemu_argv(_spec(disks=disks))
    drives = _option(argv, "-drive")
    devices = _option(argv, "-device")
    assert drives[0].startswith("file=/images/root.qcow2,") and "format=qcow2" in drives[0]
    assert "virtio-blk-pci,drive=disk0,bootindex=0" in devices
    assert "scsi-hd,bus=scsi.0,drive=disk1" in devices and "virtio-scsi-pci,id=scsi" in devices
    seed = next(d for d in drives if "id=seed" in d)
    assert seed.endswith("readonly=on") and "format=raw" in seed


def test_guest_poweroff_is_completed_and_a_crash_is_an_error() -> None:
    assert _outcome_of("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"}) is not None
    completed = _outcome_of("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"})
    assert completed is not None and (completed.code, completed.reason) == (0, "Completed")
    panic = _outcome_of("GUEST_PANICKED", {"action": "pause"})
    assert panic is not None and (panic.code, panic.reason) == (1, "Error")
    # Host-initiated ends are explained by whoever caused them (exit.json), not guessed here.
    assert _outcome_of("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"}) is None


def test_spec_survives_the_round_trip_through_spec_json() -> None:
    spec = _spec(extra_args=("-rtc", "base=utc"))
    assert _spec_from_json(_spec_to_json(spec)) == spec


async def test_a_run_dir_too_deep_for_unix_socket_paths_is_refused_before_qemu_starts(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(MachineError, match="too deep"):
        await Machine.launch(_spec(run_dir=deep, netns=None, network=None))
    assert not deep.exists()


def test_resize_headroom_adds_hotpluggable_cpus_and_memory_slots() -> None:
    argv = qemu_argv(_spec(max_vcpus=4, max_memory_mib=2048, memory_slots=2))
    assert _option(argv, "-smp") == ["2,maxcpus=4"]
    assert _option(argv, "-m") == ["512M,slots=2,maxmem=2048M"]
    fixed = qemu_argv(_spec(max_vcpus=2, max_memory_mib=512, memory_slots=2))
    assert _option(fixed, "-smp") == ["2"] and _option(fixed, "-m") == ["512M"]
    assert _spec_from_json(_spec_to_json(_spec(max_vcpus=4))).max_vcpus == 4


def test_qemu_starts_in_a_scope_of_the_vm_slice_only_when_the_agent_is_a_systemd_service(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vkubelet.providers.vm import _machine

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(_machine, "SYSTEMD_RUNTIME", tmp_path)  # booted with systemd
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    assert _machine.scope_argv("ns/web-0") == []  # run by hand: QEMU is the agent's child
    monkeypatch.setenv("INVOCATION_ID", "0123")
    scope = _machine.scope_argv("ns/web-0")
    assert scope[:2] == ["/usr/bin/systemd-run", "--scope"]
    assert "--slice=vkubelet-vms.slice" in scope and scope[-1] == "--"
    monkeypatch.setattr(_machine, "SYSTEMD_RUNTIME", tmp_path / "absent")  # a container
    assert _machine.scope_argv("ns/web-0") == []
