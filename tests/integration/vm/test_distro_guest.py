"""Real cloud-init in a real distribution guest applies the seed the VM runtime writes.

The Debian guest (`vm_distro_image`: debootstrapped bookworm with systemd, cloud-init 22.4,
Debian's qemu-ga and sshd, booting from its own disk) is booted once under TCG with
`Machine.launch`, a qcow2 overlay and a NoCloud seed from `write_seed_iso` carrying what a pod's
seed carries: meta-data with instance-id and local-hostname, `#cloud-config` user-data with an
SSH key, write_files and runcmd, and a v2 network-config giving the pod address on a PodNetwork.
Slow by nature (~1-2 min to cloud-init done on a loaded 2-core host): one boot for the module.
Needs root (network namespaces; the image build debootstraps).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import asyncssh
import pytest
import pytest_asyncio

from vkubelet.providers.vm._cloudinit import build_seed_content
from vkubelet.providers.vm._machine import Disk, Machine, MachineSpec
from vkubelet.providers.vm._net import GuestNetwork, PodNetwork, pod_dns_search
from vkubelet.providers.vm._seed import write_seed_iso

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and debootstrap need root"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU not installed"),
]

BOOT_TIMEOUT = 600.0  # TCG on a busy 2-core machine; ~55 s to the agent when quiet-ish
POD = "distro-web-0"
USER = "debian"  # Debian's cloud.cfg default user: ssh_authorized_keys land there
CONFIG = "listen=8080\nmode=test\n"
SECRET = "s3cr3t-token\n"
RUNCMD_MARKER = "/run/vkubelet-runcmd"
CLUSTER_DNS = "10.96.0.10"
NAMESPACE = "shop"


@dataclass(frozen=True)
class Seed:
    """The shape of vmstore's SeedContent (what write_seed_iso reads)."""

    meta_data: str
    user_data: str
    network_config: str | None
    extra_files: dict[str, bytes] = field(default_factory=dict)
    kind: str = "nocloud"


@dataclass
class Booted:
    machine: Machine
    network: GuestNetwork
    key: asyncssh.SSHKey
    agent_seconds: float
    cloud_init_seconds: float


def seed_for(pod: str, uid: str, network: GuestNetwork, public_key: str) -> Seed:
    """A pod's seed as the provider writes it for a cloud-init guest."""
    user_data = f"""#cloud-config
ssh_authorized_keys:
  - {public_key}
write_files:
  - path: /etc/app/config
    content: {json.dumps(CONFIG)}
    permissions: "0644"
  - path: /run/secrets/token
    content: {json.dumps(SECRET)}
    permissions: "0600"
runcmd:
  - [sh, -c, "hostname > {RUNCMD_MARKER}"]
"""
    # The provider's own netplan, with the cluster DNS a routed vm node gives its guests.
    dns = replace(network, dns=(CLUSTER_DNS,), search=pod_dns_search(NAMESPACE, "cluster.local"))
    network_config = build_seed_content(pod, uid, {}, {}, dns).network_config
    return Seed(f"instance-id: {uid}\nlocal-hostname: {pod}\n", user_data, network_config)


@pytest.fixture(scope="module")
def pod_network() -> PodNetwork:
    return PodNetwork(f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}.0/24", prefix="vkds")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def booted(
    vm_distro_image: Path, tmp_path_factory: pytest.TempPathFactory, pod_network: PodNetwork
) -> AsyncIterator[Booted]:
    uid = f"distro-{os.getpid()}"
    network = await pod_network.attach(uid)
    run_dir = tmp_path_factory.mktemp("vm-distro")
    root = run_dir / "root.qcow2"
    overlay = await asyncio.create_subprocess_exec(
        "qemu-img", "create", "-q", "-f", "qcow2", "-b", str(vm_distro_image), "-F", "qcow2",
        str(root),
    )  # fmt: skip
    assert await overlay.wait() == 0
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key().decode().strip()
    write_seed_iso(seed_for(POD, uid, network, public), run_dir / "seed.iso")
    spec = MachineSpec(
        name=f"test/{POD}",
        run_dir=run_dir,
        vcpus=1,
        memory_mib=512,
        disks=(Disk(root),),
        seed=run_dir / "seed.iso",
        network=network,
        netns=pod_network.netns(uid),
    )
    start = time.monotonic()
    machine = await Machine.launch(spec)
    try:
        await machine.wait_guest_agent(BOOT_TIMEOUT)
        agent = time.monotonic() - start
        # `status --wait` blocks in the guest until cloud-init's last stage has run.
        waited = await machine.exec(
            ["cloud-init", "status", "--wait"], timeout=BOOT_TIMEOUT - agent
        )
        done = time.monotonic() - start
        print(
            f"\ndistro guest: agent {agent:.1f} s, cloud-init done {done:.1f} s "
            f"(exit {waited.exit_code})",
            file=sys.stderr,
        )
        yield Booted(machine, network, key, agent, done)
    finally:
        if machine.running():
            await machine.kill()
        await pod_network.detach(uid)


async def _run(booted: Booted, *argv: str) -> str:
    out = await booted.machine.exec(list(argv), timeout=60)
    assert out.exit_code == 0, (argv, out.stderr.decode(errors="replace"))
    return out.stdout.decode()


async def test_real_cloud_init_finishes_from_the_nocloud_seed_without_errors(
    booted: Booted,
) -> None:
    # cloud-init's own records (reading them is cheap; its CLI takes ~10 s to start under TCG).
    status = json.loads(await _run(booted, "cat", "/run/cloud-init/status.json"))["v1"]
    assert status["datasource"].startswith("DataSourceNoCloud")
    for stage in ("init-local", "init", "modules-config", "modules-final"):
        assert status[stage]["finished"], stage
        assert status[stage]["errors"] == [], stage
    result = json.loads(await _run(booted, "cat", "/run/cloud-init/result.json"))["v1"]
    assert result["errors"] == []
    assert "DataSourceNoCloud" in result["datasource"]
    # Debian's own cloud-init package, not a stand-in.
    assert (await _run(booted, "dpkg-query", "-W", "-f=${Status}", "cloud-init")).endswith(
        " installed"
    )


async def test_meta_data_local_hostname_becomes_the_guest_hostname(booted: Booted) -> None:
    assert (await _run(booted, "hostname")).strip() == POD
    assert (await _run(booted, "cat", "/etc/hostname")).strip() == POD
    instance = await _run(booted, "cat", "/var/lib/cloud/data/instance-id")
    assert instance.strip() == f"distro-{os.getpid()}"


async def test_user_data_write_files_and_runcmd_are_applied(booted: Booted) -> None:
    assert await _run(booted, "cat", "/etc/app/config") == CONFIG
    assert await _run(booted, "cat", "/run/secrets/token") == SECRET
    modes = await _run(booted, "stat", "-c", "%a %U", "/etc/app/config", "/run/secrets/token")
    assert modes.split("\n")[:2] == ["644 root", "600 root"]
    # runcmd runs in the final stage, after the hostname was set: it saw the pod name.
    assert (await _run(booted, "cat", RUNCMD_MARKER)).strip() == POD


async def test_network_config_gives_the_guest_its_pod_address(booted: Booted) -> None:
    address = await _run(booted, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
    assert f"{booted.network.address}/{booted.network.prefix}" in address
    route = await _run(booted, "ip", "-4", "route", "show", "default")
    assert f"via {booted.network.gateway} dev eth0" in route
    interfaces = await booted.machine.agent.network_interfaces()
    eth0 = next(i for i in interfaces if i.name == "eth0")
    assert eth0.mac == booted.network.mac
    assert (booted.network.address, booted.network.prefix) in eth0.addresses


async def test_network_config_names_the_cluster_dns_and_the_pod_s_search_list(
    booted: Booted,
) -> None:
    # networkd hands them to resolved: its stub resolv.conf carries the search list, and the
    # servers it asks are the cluster DNS.
    stub = await _run(booted, "cat", "/etc/resolv.conf")
    assert f"search {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local" in stub
    uplink = await _run(booted, "cat", "/run/systemd/resolve/resolv.conf")
    assert f"nameserver {CLUSTER_DNS}" in uplink


async def test_ssh_key_from_user_data_logs_in_over_the_pod_ip(booted: Booted) -> None:
    async with asyncssh.connect(
        booted.network.address,
        username=USER,
        client_keys=[booted.key],
        known_hosts=None,
        connect_timeout=60,
    ) as conn:
        result = await conn.run("hostname; cat ~/.ssh/authorized_keys", check=True, timeout=60)
    assert isinstance(result.stdout, str)
    hostname, keys = result.stdout.split("\n", 1)
    assert hostname == POD
    assert booted.key.export_public_key().decode().split()[1] in keys


async def test_another_key_is_refused_by_the_guests_sshd(booted: Booted) -> None:
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(asyncssh.PermissionDenied):
        async with asyncssh.connect(
            booted.network.address,
            username=USER,
            client_keys=[stranger],
            known_hosts=None,
            connect_timeout=60,
        ):
            pass


async def test_debians_own_guest_agent_answers(booted: Booted) -> None:
    info = await booted.machine.agent.info()
    assert info["version"].startswith("7.")
    osinfo = await booted.machine.agent.call("guest-get-osinfo")
    assert (osinfo["id"], osinfo["version-id"]) == ("debian", "12")
    out = await booted.machine.exec(["sh", "-c", "exit 3"])
    assert out.exit_code == 3


async def test_graceful_stop_powers_the_distro_guest_off_through_systemd(booted: Booted) -> None:
    """Runs last: it ends the module's machine (stop = agent shutdown -> systemd poweroff)."""
    start = time.monotonic()
    outcome = await booted.machine.stop(grace=120)
    print(f"\ndistro guest: graceful stop {time.monotonic() - start:.1f} s", file=sys.stderr)
    assert (outcome.code, outcome.reason) == (0, "Completed")
    console = booted.machine.console_log.read_bytes()
    assert b"reboot: Power down" in console
