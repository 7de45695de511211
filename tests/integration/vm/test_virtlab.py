"""The libvirt lab (`vkubelet.testing.virtlab`) is what the libvirt runtime's tests stand on: two
hypervisor hosts, each a libvirt daemon reached over SSH, that keep their domains apart, define
a domain at once (capabilities cached, not probed per define), reach a guest's agent,
live-migrate a domain to each other over the lab network without shared storage, and restart a
daemon under a running guest.

One test, one booting guest: every fact is checked on it (each boot costs seconds under TCG).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest

from vkubelet.testing import wait_for
from vkubelet.testing.virtlab import (
    LibvirtHost,
    guest_domain_xml,
    libvirt_lab,
    libvirt_lab_unavailable,
)

libvirt = pytest.importorskip("libvirt", reason="the Python binding: pip install vkubelet[libvirt]")
libvirt_qemu = pytest.importorskip("libvirt_qemu")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        libvirt_lab_unavailable() is not None, reason=str(libvirt_lab_unavailable())
    ),
]

BOOT_TIMEOUT = 120.0  # the guest agent under TCG on a busy 2-core machine; ~6-20 s here


def agent(domain: Any, command: str, **arguments: Any) -> Any:
    """One guest-agent command through libvirt; its `return` value."""
    request = json.dumps(
        {"execute": command, "arguments": arguments} if arguments else {"execute": command}
    )
    return json.loads(libvirt_qemu.qemuAgentCommand(domain, request, 10, 0))["return"]


def guest_sh(domain: Any, script: str) -> str:
    """Run a sh script in the guest through its agent; its stdout (fails on a non-zero exit)."""
    pid = agent(
        domain, "guest-exec", path="/bin/sh", arg=["-c", script], **{"capture-output": True}
    )["pid"]
    status = wait_for(
        lambda: (s := agent(domain, "guest-exec-status", pid=pid))["exited"] and s,
        timeout=30,
        what=f"`{script}` in the guest",
    )
    assert status["exitcode"] == 0, status
    return base64.b64decode(status.get("out-data", "")).decode()


def agent_answers(domain: Any) -> bool:
    try:
        return bool(agent(domain, "guest-ping") == {})
    except libvirt.libvirtError:  # not connected yet: the guest is booting
        return False


def test_two_hosts_over_ssh_keep_their_domains_apart_and_migrate_one_live_without_shared_disks(
    vm_guest_image: Path, tmp_path: Path
) -> None:
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # errors are raised, not printed
    with libvirt_lab(2, tmp_path / "lab") as (source, target):
        connections = {host.name: libvirt.open(host.ssh_uri) for host in (source, target)}
        domains: dict[str, Any] = {}
        names = {source.name: "lab-vm-0", target.name: "lab-vm-1"}
        for host in (source, target):
            name = names[host.name]
            disk = host.overlay(vm_guest_image, name)
            xml = guest_domain_xml(
                name, disk, memory_mib=128, console_log=host.images / f"{name}.log"
            )
            started = time.monotonic()
            domain = connections[host.name].defineXML(xml)
            took = time.monotonic() - started
            assert took < 1.0, (
                f"define took {took:.1f} s on {host.name}: libvirt probed QEMU again "
                "(a /dev/kvm it finds unusable drops its capabilities cache)"
            )
            domain.create()
            domains[host.name] = domain
        # each host's daemon, asked over the network, runs its own domain and only that
        assert connections[source.name].getHostname() == source.name
        assert source.running() == [names[source.name]]
        assert target.running() == [names[target.name]]
        domains[target.name].destroy()  # one guest boots: two would halve TCG's speed

        moving = domains[source.name]
        wait_for(lambda: agent_answers(moving), timeout=BOOT_TIMEOUT, what="the guest's agent")
        guest_sh(moving, "echo written-at-the-source > /root/mark && sync")
        migrate_without_shared_disks(moving, source, target, vm_guest_image)

        # the domain runs on the target alone, with its disk's content, and is defined there only
        assert source.virsh("list", "--all", "--name").stdout.split() == []
        assert target.running() == [names[source.name]]
        moved = connections[target.name].lookupByName(names[source.name])
        assert agent_answers(moved)
        assert guest_sh(moved, "cat /root/mark") == "written-at-the-source\n"

        # a daemon restart leaves the guest running; connections made before it are dead
        target.restart_libvirtd()
        with pytest.raises(libvirt.libvirtError):
            connections[target.name].listAllDomains()
        moved = libvirt.open(target.ssh_uri).lookupByName(names[source.name])
        assert target.running() == [names[source.name]] and agent_answers(moved)
        moved.destroy()
        assert source.running() == target.running() == []


def migrate_without_shared_disks(
    domain: Any, source: LibvirtHost, target: LibvirtHost, base: Path
) -> None:
    """The recipe found to work here (see vkubelet.testing.virtlab's docstring): peer to peer
    (the source's daemon reaches the target's over qemu+ssh), the disk copied by the target's NBD
    server (`NON_SHARED_INC`: only the overlay, its base exists on both), to a path of the
    target's that the caller creates beforehand (libvirt creates it only inside a storage pool)."""
    name = domain.name()
    source_disk = str(source.images / f"{name}.qcow2")
    target_disk = target.overlay(base, name)
    xml = domain.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE).replace(source_disk, str(target_disk))
    params = {
        libvirt.VIR_MIGRATE_PARAM_DEST_XML: xml,
        libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS: ["vda"],
    }
    flags = (
        libvirt.VIR_MIGRATE_LIVE
        | libvirt.VIR_MIGRATE_PEER2PEER
        | libvirt.VIR_MIGRATE_NON_SHARED_INC
        | libvirt.VIR_MIGRATE_PERSIST_DEST
        | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
    )
    domain.migrateToURI3(target.ssh_uri, params, flags)
