"""The VM runtime against real QEMU under TCG, booting the small test guest.

One machine is booted for the module and shared by the tests that only look at it; the tests that
end a machine (guest poweroff, crash, kill) start their own. The shared machine's seed is a
ConfigDrive (label config-2), the others' NoCloud seeds (label cidata): the guest finds either.
Needs root (network namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from vkubelet.providers.vm._accel import _probe, probe_accel
from vkubelet.providers.vm._machine import Disk, Machine, MachineSpec
from vkubelet.providers.vm._net import GuestNetwork, NetworkError, PodNetwork
from vkubelet.providers.vm._seed import write_seed_iso
from vkubelet.testing.harness import eventually

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU not installed"),
]

BOOT_TIMEOUT = 90.0  # TCG on a busy 2-core machine; a quiet one boots in ~4 s


@dataclass(frozen=True)
class Seed:
    meta_data: str = "instance-id: test\n"
    user_data: str = "#cloud-config\n"
    network_config: str | None = None
    extra_files: dict[str, bytes] = field(default_factory=dict)
    kind: str = "nocloud"


@dataclass
class Booted:
    machine: Machine
    network: GuestNetwork
    pod_network: PodNetwork
    key: str
    boot_seconds: float


async def _launch(
    image: Path, run_dir: Path, name: str, *, network: GuestNetwork | None = None,
    netns: str | None = None, files: dict[str, bytes] | None = None, kind: str = "nocloud",
) -> Machine:  # fmt: skip
    return await Machine.launch(_prepare(image, run_dir, name, network, netns, files or {}, kind))


def _prepare(
    image: Path, run_dir: Path, name: str, network: GuestNetwork | None, netns: str | None,
    files: dict[str, bytes], kind: str = "nocloud",
) -> MachineSpec:  # fmt: skip
    """A qcow2 overlay on the test guest and a seed with its hostname, network and files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    root = run_dir / "root.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image), "-F", "qcow2", str(root)],
        check=True,
    )
    extra = {"vkubelet/hostname": f"{name}\n".encode(), **files}
    if network is not None:
        extra["vkubelet/network"] = network.seed_file()
    write_seed_iso(
        Seed(
            meta_data='{"uuid": "test"}\n' if kind == "configdrive" else Seed.meta_data,
            extra_files=extra,
            kind=kind,
        ),
        run_dir / "seed.iso",
        file_modes={"vkubelet/files/run/secret": 0o600},
    )
    return MachineSpec(
        name=f"test/{name}",
        run_dir=run_dir,
        vcpus=1,
        memory_mib=256,
        disks=(Disk(root),),
        seed=run_dir / "seed.iso",
        network=network,
        netns=netns,
    )


@pytest.fixture(scope="module")
def pod_network() -> PodNetwork:
    return PodNetwork(f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}.0/24", prefix="vkrt")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def booted(
    vm_guest_image: Path, tmp_path_factory: pytest.TempPathFactory, pod_network: PodNetwork
) -> AsyncIterator[Booted]:
    key = f"shared-{os.getpid()}"
    network = await pod_network.attach(key)
    start = time.monotonic()
    machine = await _launch(
        vm_guest_image,
        tmp_path_factory.mktemp("vm-shared"),
        "web-0",
        network=network,
        netns=pod_network.netns(key),
        files={"vkubelet/files/etc/app/config": b"a=1\n", "vkubelet/files/run/secret": b"s"},
        kind="configdrive",
    )
    try:
        await machine.wait_guest_agent(BOOT_TIMEOUT)
        boot = time.monotonic() - start
        print(f"\nboot to guest agent: {boot:.2f} s", file=sys.stderr)
        yield Booted(machine, network, pod_network, key, boot)
    finally:
        if machine.running():
            await machine.kill()
        await pod_network.detach(key)


async def test_guest_agent_answers_with_its_version(booted: Booted) -> None:
    info = await booted.machine.agent.info()
    assert info["version"].startswith("7.")


async def test_exec_prints_the_hostname_from_the_seed_and_exit_code_3_propagates(
    booted: Booted,
) -> None:
    hostname = await booted.machine.exec(["hostname"])
    assert (hostname.exit_code, hostname.stdout) == (0, b"web-0\n")
    failing = await booted.machine.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (failing.exit_code, failing.stdout, failing.stderr) == (3, b"out\n", b"err\n")
    piped = await booted.machine.exec(["cat"], stdin=b"through stdin")
    assert piped.stdout == b"through stdin"


async def test_seed_files_are_copied_into_the_guest_with_their_modes(booted: Booted) -> None:
    listing = await booted.machine.exec(
        ["sh", "-c", "cat /etc/app/config; stat -c %a /etc/app/config /run/secret"]
    )
    assert listing.stdout.decode().split() == ["a=1", "644", "600"]


async def test_host_reaches_a_tcp_server_in_the_guest_by_its_pod_ip(booted: Booted) -> None:
    started = await booted.machine.exec(
        ["sh", "-c", "mkdir -p /www && echo hello-from-guest > /www/index.html && "
         "httpd -p 8080 -h /www"]
    )  # fmt: skip
    assert started.exit_code == 0, started.stderr
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(booted.network.address, 8080), 10
    )
    writer.write(b"GET /index.html HTTP/1.0\r\n\r\n")
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert response.startswith(b"HTTP/1.") and response.endswith(b"hello-from-guest\n")
    interfaces = await booted.machine.agent.network_interfaces()
    assert any(
        i.mac == booted.network.mac
        and (booted.network.address, booted.network.prefix) in i.addresses
        for i in interfaces
    )


async def test_console_log_holds_the_boot_marker(booted: Booted) -> None:
    log = booted.machine.console_log.read_text(errors="replace")
    assert "vkubelet-guest: booted hostname=web-0" in log


async def test_console_socket_is_an_interactive_shell_for_attach(booted: Booted) -> None:
    reader, writer = await asyncio.open_unix_connection(booted.machine.console_socket)
    seen = b""
    async with asyncio.timeout(30):
        while b"ATTACH-42" not in seen:
            # Typed again until it shows: busybox's line editor may take the first bytes as the
            # answer to its terminal-size query (ESC[6n), as a terminal would send one.
            writer.write(b"\necho ATTACH-$((40 + 2))\n")
            with contextlib.suppress(TimeoutError):
                seen += await asyncio.wait_for(reader.read(4096), 2)
    writer.close()
    assert b"ATTACH-42" in booted.machine.console_log.read_bytes()


async def test_stats_report_qemu_cpu_and_memory(booted: Booted) -> None:
    stats = await booted.machine.stats()
    assert stats.cpu_ns > 0 and stats.memory_bytes > 50 * 2**20
    assert stats.balloon_bytes == 256 * 2**20


ADOPT = """
import asyncio, sys
from pathlib import Path
from vkubelet.providers.vm._machine import Machine

async def main():
    machine = await Machine.adopt(Path(sys.argv[1]))
    out = await machine.exec(["hostname"])
    print(machine.pid, out.stdout.decode().strip())
    await machine.close()

asyncio.run(main())
"""


async def test_adopt_from_a_fresh_process_finds_the_same_pid_and_talks_to_the_guest(
    booted: Booted,
) -> None:
    await booted.machine.close()  # the guest agent and QMP take one client at a time
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ADOPT, str(booted.machine.run_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(done.communicate(), 60)
    assert done.returncode == 0, err.decode()
    assert out.decode().split() == [str(booted.machine.pid), "web-0"]
    assert booted.machine.running()


async def test_stop_is_graceful_and_detach_leaves_no_netns_or_links(booted: Booted) -> None:
    outcome = await booted.machine.stop(grace=30)
    assert (outcome.code, outcome.reason) == (0, "Completed")
    assert "vkubelet-guest: shutdown requested" in booted.machine.console_log.read_text(
        errors="replace"
    )
    assert not booted.machine.running()
    await booted.pod_network.detach(booted.key)
    netns, links = _netns_and_links()
    assert booted.pod_network.netns(booted.key) not in netns
    assert booted.pod_network.host_link(booted.key) not in links


def _netns_and_links() -> tuple[str, str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return netns, links


async def test_guest_poweroff_ends_the_machine_with_exit_code_0(
    vm_guest_image: Path, tmp_path: Path
) -> None:
    machine = await _launch(vm_guest_image, tmp_path / "vm", "off-0")
    try:
        await machine.wait_guest_agent(BOOT_TIMEOUT)
        # In the background, so that the exec's own reply is not lost with the guest.
        await machine.exec(["sh", "-c", "(sleep 0.2; poweroff) </dev/null >/dev/null 2>&1 &"])
        outcome = await asyncio.wait_for(machine.wait(), 30)
        assert (outcome.code, outcome.reason) == (0, "Completed")
        assert not machine.running()
    finally:
        if machine.running():
            await machine.kill()


async def test_stop_without_a_guest_agent_presses_the_acpi_power_button(
    vm_guest_image: Path, tmp_path: Path
) -> None:
    machine = await _launch(vm_guest_image, tmp_path / "vm", "acpi-0")
    try:
        await machine.wait_guest_agent(BOOT_TIMEOUT)
        # The agent goes away, so stop() must escalate to the power button.
        await machine.exec(
            ["sh", "-c", "(sleep 0.5; kill $(pidof qemu-ga)) </dev/null >/dev/null 2>&1 &"]
        )

        async def agent_gone() -> bool:
            try:
                await machine.agent.call("guest-ping", timeout=1)
            except (TimeoutError, ConnectionError):
                return True
            return False

        await eventually(agent_gone, within=30, interval=0.1)
        outcome = await machine.stop(grace=30)
        assert (outcome.code, outcome.reason) == (0, "Completed")
        log = machine.console_log.read_text(errors="replace")
        assert "vkubelet-guest: ACPI power button" in log
        assert "vkubelet-guest: shutdown requested" in log
    finally:
        if machine.running():
            await machine.kill()


async def test_guest_crash_ends_the_machine_with_an_error(
    vm_guest_image: Path, tmp_path: Path
) -> None:
    machine = await _launch(vm_guest_image, tmp_path / "vm", "crash-0")
    try:
        await machine.wait_guest_agent(BOOT_TIMEOUT)
        crash = asyncio.create_task(machine.exec(["sh", "-c", "echo c > /proc/sysrq-trigger"]))
        outcome = await asyncio.wait_for(machine.wait(), 60)
        crash.cancel()
        assert (outcome.code, outcome.reason) == (1, "Error")
        assert "panic" in outcome.message
    finally:
        if machine.running():
            await machine.kill()


async def test_kill_ends_qemu_and_waiters_see_137(vm_guest_image: Path, tmp_path: Path) -> None:
    machine = await _launch(vm_guest_image, tmp_path / "vm", "kill-0")
    waiting = asyncio.create_task(machine.wait())
    await machine.kill()
    outcome = await asyncio.wait_for(waiting, 30)
    assert (outcome.code, outcome.reason) == (137, "Killed")
    assert not machine.running()
    assert await Machine.adopt(machine.run_dir) is None


async def test_attach_finds_the_same_address_after_a_restart_and_detach_cleans_up() -> None:
    first = PodNetwork("10.199.77.0/28", prefix="vkrn")
    keys = [f"reattach-{os.getpid()}-{i}" for i in range(2)]
    try:
        a = await first.attach(keys[0])
        b = await first.attach(keys[1])
        assert a.address != b.address
        assert {a.address, b.address} <= {"10.199.77.2", "10.199.77.3"}
        restarted = PodNetwork("10.199.77.0/28", prefix="vkrn")  # a new agent process
        assert await restarted.attach(keys[0]) == a
        assert await restarted.attach(keys[1]) == b
        explicit = await restarted.attach(f"{keys[0]}-x", address="10.199.77.9")
        assert explicit.address == "10.199.77.9"
        keys.append(f"{keys[0]}-x")
        # A host reboot resets the network: each VM gets its own address back (its guest is
        # configured with it), whatever the order, and one taken by another VM is refused.
        await first.detach(keys[0])
        await first.detach(keys[1])
        assert (await restarted.attach(keys[1], address=b.address)).address == b.address
        with pytest.raises(NetworkError, match=f"address {b.address} of this VM is taken"):
            await restarted.attach(keys[0], address=b.address)
        assert (await restarted.attach(keys[0], address=a.address)).address == a.address
    finally:
        for key in keys:
            await first.detach(key)
    netns, links = _netns_and_links()
    for key in keys:
        assert first.netns(key) not in netns and first.host_link(key) not in links


async def test_accel_probe_recognises_a_working_accelerator() -> None:
    assert (await probe_accel("tcg")).accel == "tcg"
    # The probe's detection itself, run with TCG (which works everywhere): firmware finishes.
    # The budget is generous: this checks the detection, not the speed of a loaded machine.
    choice = await _probe(None, accel="tcg", budget=30.0)
    assert (choice.accel, choice.reason.startswith("TCG works")) == ("tcg", True), choice.reason
