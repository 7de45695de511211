"""Accelerator choice: configured modes, the KVM device check, the per-boot cache of the probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.providers.vm import _accel
from vkubelet.providers.vm._accel import AccelChoice, probe_accel


async def test_configured_modes_are_taken_as_given() -> None:
    assert (await probe_accel("tcg")).accel == "tcg"
    assert (await probe_accel("kvm")).accel == "kvm"


async def test_auto_without_a_usable_kvm_device_falls_back_to_tcg_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.access", lambda path, mode: False)
    choice = await probe_accel("auto")
    assert choice.accel == "tcg" and "/dev/kvm" in choice.reason


async def test_auto_probes_once_per_host_boot_then_uses_the_cached_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[Path | None] = []

    async def fake_probe(kernel: Path | None, accel: str = "kvm") -> AccelChoice:
        calls.append(kernel)
        return AccelChoice("tcg", "KVM unusable, using TCG: firmware probe too slow")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("os.access", lambda path, mode: True)
    monkeypatch.setattr(_accel, "_probe", fake_probe)
    first = await probe_accel("auto")
    second = await probe_accel("auto")
    assert first == second and first.accel == "tcg"
    assert len(calls) == 1
    monkeypatch.setattr(_accel, "_boot_id", lambda: "another-boot")
    await probe_accel("auto")
    assert len(calls) == 2
