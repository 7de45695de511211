"""The libvirt runtime's rules that need the binding but no daemon: what a domain's end means,
and an unreachable daemon's message (the node's NotReady). tests/integration/vm/test_vm_libvirt.py
runs VMs on a real daemon over SSH."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.providers.vm._config import VMConfig
from vkubelet.providers.vm._machine import MachineError, MachineExit

libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")

from vkubelet.providers.vm._libvirt import LibvirtRuntime, _outcome  # noqa: E402


@pytest.mark.parametrize(
    ("state", "reason", "outcome"),
    [
        ("VIR_DOMAIN_RUNNING", 1, None),
        ("VIR_DOMAIN_PAUSED", 1, None),
        (
            "VIR_DOMAIN_SHUTOFF",
            "VIR_DOMAIN_SHUTOFF_SHUTDOWN",
            MachineExit(0, "Completed", "guest powered off"),
        ),
        (
            "VIR_DOMAIN_SHUTOFF",
            "VIR_DOMAIN_SHUTOFF_CRASHED",
            MachineExit(1, "Error", "guest kernel panic"),
        ),
        ("VIR_DOMAIN_CRASHED", 1, MachineExit(1, "Error", "guest kernel panic")),
        (
            "VIR_DOMAIN_SHUTOFF",
            "VIR_DOMAIN_SHUTOFF_DESTROYED",
            MachineExit(137, "Killed", "the domain was destroyed"),
        ),
        (
            "VIR_DOMAIN_SHUTOFF",
            "VIR_DOMAIN_SHUTOFF_FAILED",
            MachineExit(1, "Error", "the domain failed to start"),
        ),
        (
            "VIR_DOMAIN_SHUTOFF",
            "VIR_DOMAIN_SHUTOFF_SAVED",
            MachineExit(0, "Hibernated", "the domain was saved (libvirt's managed save)"),
        ),
    ],
)
def test_a_domain_s_end_is_a_container_exit_as_with_qemu(
    state: str, reason: str | int, outcome: MachineExit | None
) -> None:
    code = getattr(libvirt, reason) if isinstance(reason, str) else reason
    assert _outcome(libvirt, getattr(libvirt, state), code) == outcome


async def test_an_unreachable_daemon_is_named_with_its_uri_and_libvirt_s_words(
    tmp_path: Path,
) -> None:
    uri = f"qemu:///system?socket={tmp_path}/no-such-sock"
    config = VMConfig(
        state_dir=tmp_path, image_store=tmp_path / "images", runtime="libvirt", libvirt_uri=uri
    )
    runtime = LibvirtRuntime(config, "hv-1")
    with pytest.raises(MachineError) as refused:
        await runtime.ping()
    assert str(refused.value).startswith(f"libvirt {uri}: Failed to connect socket")
