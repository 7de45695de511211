"""The libvirt runtime's rules that need the binding but no daemon: what a domain's end means,
and an unreachable daemon's message (the node's NotReady). tests/integration/vm/test_vm_libvirt.py
runs VMs on a real daemon over SSH."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._config import VMConfig
from vkubelet.providers.vm._machine import MachineError, MachineExit

libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")

from vkubelet.providers.vm._libvirt import LibvirtRuntime, _outcome  # noqa: E402

# libvirt takes one event loop implementation per process (libvirtaio's, on the loop of the
# first connection): every test that connects shares the module's loop.
ONE_LOOP = pytest.mark.asyncio(loop_scope="module")


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


@ONE_LOOP
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


# -- hibernated domains, on libvirt's test driver (a daemon-less libvirt in this process) ------
def _test_runtime(tmp_path: Path) -> LibvirtRuntime:
    config = VMConfig(
        state_dir=tmp_path,
        image_store=tmp_path / "images",
        runtime="libvirt",
        libvirt_uri="test:///default",
    )
    return LibvirtRuntime(config, "hv-1")


async def _saved_domain(runtime: LibvirtRuntime, name: str, *, ours: bool = True) -> str:
    """A domain of the test driver, started and then managed-saved: a hibernated VM's."""
    metadata = (
        '<metadata><vkubelet:pod xmlns:vkubelet="https://vkubelet.io/xmlns/vm-domain/1" '
        f'uid="old-uid" namespace="ns" name="{name}" node="hv-1"/></metadata>'
        if ours
        else ""
    )
    xml = (
        f"<domain type='test'><name>ns_{name}</name><memory>65536</memory>"
        f"<os><type>hvm</type></os>{metadata}</domain>"
    )
    conn = await runtime.connection.get()
    domain = conn.defineXML(xml)
    domain.create()
    domain.managedSave(0)
    assert domain.hasManagedSaveImage(0)
    return str(domain.UUIDString())


@ONE_LOOP
async def test_the_hibernated_domain_a_pod_restores_is_not_a_name_clash(tmp_path: Path) -> None:
    from vkubelet.providers.vm._backend import MachineRefused

    runtime = _test_runtime(tmp_path)
    uuid = await _saved_domain(runtime, "same-name")
    # a pod of the machine named as the one that hibernated it (another UID): its restore
    await runtime.check_machine("ns", "same-name", "new-uid", restoring=uuid)
    with pytest.raises(MachineRefused):  # any other pod of that name: a clash
        await runtime.check_machine("ns", "same-name", "new-uid")


@ONE_LOOP
async def test_a_restore_of_a_domain_gone_or_refused_by_libvirt_boots_cold(tmp_path: Path) -> None:
    from vkubelet.providers.vm._backend import LaunchSpec, RestoreFailed

    runtime = _test_runtime(tmp_path)
    uuid = await _saved_domain(runtime, "refused")
    spec = LaunchSpec("ns/next", tmp_path / "m", 1, 256, (), None, "new-uid", "tcg", restore=uuid)
    with pytest.raises(RestoreFailed, match="not supported"):  # the test driver's refusal
        await runtime.launch(spec)
    gone = "00000000-0000-0000-0000-000000000001"
    with pytest.raises(RestoreFailed, match="is gone"):
        await runtime.launch(LaunchSpec(**{**spec.__dict__, "restore": gone}))


@ONE_LOOP
async def test_a_discarded_state_removes_our_domain_and_image_only(tmp_path: Path) -> None:
    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    ours, theirs = (
        await _saved_domain(runtime, "ours"),
        await _saved_domain(runtime, "theirs", ours=False),
    )
    await runtime.discard_saved(ours)
    await runtime.discard_saved(theirs)  # no vkubelet metadata: left as it is
    names = conn.listDefinedDomains()
    assert "ns_ours" not in names and "ns_theirs" in names
    await runtime.discard_saved(ours)  # gone already: nothing to do


@ONE_LOOP
async def test_a_hibernated_domain_is_never_removed_as_an_ended_one(tmp_path: Path) -> None:
    from vkubelet.providers.vm._libvirt import LibvirtMachine

    runtime = _test_runtime(tmp_path)
    uuid = await _saved_domain(runtime, "kept")
    machine = LibvirtMachine(runtime.connection, tmp_path, uuid, -1, 0.0)
    assert await machine.wait() == MachineExit(
        0, "Hibernated", "the domain was saved (libvirt's managed save)"
    )
    conn = await runtime.connection.get()
    assert "ns_kept" in conn.listDefinedDomains()


# -- imported domains (`_domainimport`), on the test driver ------------------------------------
DEVICES = (
    "<devices><serial type='pty'><target port='0'/></serial><console type='pty'/>"
    "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>"
    "</devices>"
)


async def _site_domain(runtime: LibvirtRuntime, name: str, devices: str = DEVICES) -> str:
    """A domain a site defined by hand (`virsh define`): no vkubelet metadata."""
    xml = (
        f"<domain type='test'><name>{name}</name><memory>65536</memory>"
        f"<os><type>hvm</type></os>{devices}</domain>"
    )
    conn = await runtime.connection.get()
    return str(conn.defineXML(xml).UUIDString())


def _request(name: str, machine: str = "m-1", policy: str = "Retain") -> Any:
    from vkubelet.providers.vm._backend import DomainImport

    return DomainImport(name=name, machine=machine, owner="team-a/db", policy=policy)


@ONE_LOOP
async def test_an_import_that_cannot_be_taken_is_refused_naming_why_and_changes_nothing(
    tmp_path: Path,
) -> None:
    from vkubelet.providers.vm._backend import MachineRefused

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    uuid = await _site_domain(runtime, "site-db")
    assert await runtime.check_import(_request("site-db")) == uuid

    with pytest.raises(MachineRefused) as missing:
        await runtime.check_import(_request("no-such-domain"))
    assert missing.value.reason == "DomainNotFound" and "'no-such-domain'" in str(missing.value)

    await _site_domain(runtime, "bare", devices="<devices/>")
    before = conn.lookupByName("bare").XMLDesc(0)
    with pytest.raises(MachineRefused) as bare:
        await runtime.check_import(_request("bare"))
    assert bare.value.reason == "DomainUnsupported"
    assert "serial console" in str(bare.value) and "org.qemu.guest_agent.0" in str(bare.value)
    assert conn.lookupByName("bare").XMLDesc(0) == before

    ours = await _saved_domain(runtime, "made-for-a-pod")  # vkubelet's own, for a pod
    with pytest.raises(MachineRefused) as made:
        await runtime.check_import(_request("ns_made-for-a-pod"))
    assert made.value.reason == "DomainOwned" and "pod ns/made-for-a-pod" in str(made.value)
    assert conn.lookupByUUIDString(ours).hasManagedSaveImage(0)


@ONE_LOOP
async def test_an_imported_domain_is_one_machine_s_and_released_by_its_deletion_policy(
    tmp_path: Path,
) -> None:
    from vkubelet.providers.vm._backend import MachineRefused
    from vkubelet.providers.vm._domainimport import IMPORT_URI

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    for name in ("kept", "deleted"):
        await _site_domain(runtime, name)
        domain = conn.lookupByName(name)
        # what the launch writes: the machine's claim (the test driver has no console stream)
        claim = '<import machine="m-1" owner="team-a/db" node="hv-1" policy="Retain"/>'
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
        element = libvirt.VIR_DOMAIN_METADATA_ELEMENT
        domain.setMetadata(element, claim, "vkubelet-import", IMPORT_URI, flags)
    with pytest.raises(MachineRefused) as taken:  # another VirtualMachine's machine
        await runtime.check_import(_request("kept", machine="m-2"))
    assert taken.value.reason == "DomainOwned" and "team-a/db" in str(taken.value)
    assert await runtime.check_import(_request("kept"))  # its own machine: again and again

    kept = conn.lookupByName("kept").UUIDString()
    await runtime.release_import(kept, "m-2", delete=True)  # not that machine's: untouched
    assert "kept" in conn.listDefinedDomains()
    await runtime.release_import(kept, "m-1", delete=False)  # Retain: defined, claim dropped
    assert "kept" in conn.listDefinedDomains()
    assert await runtime.check_import(_request("kept", machine="m-2"))  # importable again
    deleted = conn.lookupByName("deleted").UUIDString()
    await runtime.release_import(deleted, "m-1", delete=True)
    assert "deleted" not in conn.listDefinedDomains()
    await runtime.release_import(deleted, "m-1", delete=True)  # gone already: nothing to do


@ONE_LOOP
async def test_an_imported_domain_that_ended_while_no_agent_ran_stays_defined(
    tmp_path: Path,
) -> None:
    """After an agent restart the run directory's `domain.json` says the domain was imported:
    its end is recorded as any domain's, and its definition (the site's) is kept; a domain
    vkubelet made is undefined as before."""
    import json

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    for name, imported in (("site-kept", True), ("ns_ours-gone", False)):
        uuid = await _site_domain(runtime, name)
        conn.lookupByName(name).create()
        conn.lookupByName(name).destroy()  # ended meanwhile (destroyed: exit 137)
        run_dir = tmp_path / name
        run_dir.mkdir()
        record = {"uri": "test:///default", "uuid": uuid, "id": 1, "started": 0.0}
        (run_dir / "domain.json").write_text(json.dumps({**record, "imported": imported}))
        assert await runtime.adopt(run_dir) is None
        assert json.loads((run_dir / "exit.json").read_text())["code"] == 137
    defined = conn.listDefinedDomains()
    assert "site-kept" in defined and "ns_ours-gone" not in defined


@ONE_LOOP
async def test_an_imported_domain_killed_is_destroyed_but_stays_defined(tmp_path: Path) -> None:
    from vkubelet.providers.vm._libvirt import LibvirtMachine

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    uuid = await _site_domain(runtime, "site-killed")
    conn.lookupByName("site-killed").create()
    machine = LibvirtMachine(runtime.connection, tmp_path, uuid, 1, 0.0, imported=True)
    await machine.kill()  # the end of a grace period, or SIGKILL
    domain = conn.lookupByName("site-killed")
    assert not domain.isActive() and "site-killed" in conn.listDefinedDomains()


@ONE_LOOP
async def test_an_imported_domain_s_hibernation_is_dropped_by_its_image_only(
    tmp_path: Path,
) -> None:
    """A state that will not be restored (the VirtualMachine gone, a resume refused): an
    imported domain loses its managed save image, never its definition; a restore of one
    whose image is gone boots cold (RestoreFailed)."""
    from vkubelet.providers.vm._backend import LaunchSpec, RestoreFailed
    from vkubelet.providers.vm._domainimport import IMPORT_URI, ImportClaim

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    uuid = await _site_domain(runtime, "site-saved")
    domain = conn.lookupByName("site-saved")
    flags, element = libvirt.VIR_DOMAIN_AFFECT_CONFIG, libvirt.VIR_DOMAIN_METADATA_ELEMENT
    claim = ImportClaim("m-1", "team-a/db", "hv-1", "Retain").xml()
    domain.setMetadata(element, claim, "vkubelet-import", IMPORT_URI, flags)
    pod = '<pod uid="u" namespace="team-a" name="db-x" node="hv-1"/>'
    domain.setMetadata(element, pod, "vkubelet", "https://vkubelet.io/xmlns/vm-domain/1", flags)
    domain.create()
    domain.managedSave(0)
    await runtime.discard_saved(uuid)
    assert not domain.hasManagedSaveImage(0) and "site-saved" in conn.listDefinedDomains()
    spec = LaunchSpec("team-a/db-y", tmp_path / "m", 1, 256, (), None, None, "tcg")
    resumed = LaunchSpec(**{**spec.__dict__, "restore": uuid, "domain": _request("site-saved")})
    with pytest.raises(RestoreFailed, match="no managed save image"):
        await runtime.launch(resumed)


# -- live resize through libvirt's own calls (`_lvhotplug`), on the test driver ----------------
@ONE_LOOP
async def test_vcpus_are_plugged_live_and_into_the_definition_and_libvirt_s_refusal_is_told(
    tmp_path: Path,
) -> None:
    from vkubelet.providers.vm._hotplug import ResizeError
    from vkubelet.providers.vm._lvhotplug import LibvirtHotplug

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    disks = "".join(
        f"<disk type='file' device='disk'><source file='/{n}.qcow2'/>"
        f"<target dev='{n}' bus='virtio'/></disk>"
        for n in ("vdb", "vda")
    )
    domain = conn.defineXML(
        "<domain type='test'><name>ns_resized</name><memory unit='MiB'>256</memory>"
        f"<vcpu current='1'>4</vcpu><os><type>hvm</type></os><devices>{disks}</devices></domain>"
    )
    domain.create()
    hotplug = LibvirtHotplug(runtime.connection, domain.UUIDString())
    assert await hotplug.plug_vcpu("vcpu1", 2) == {"id": "vcpu1"}
    live, config = libvirt.VIR_DOMAIN_AFFECT_LIVE, libvirt.VIR_DOMAIN_AFFECT_CONFIG
    assert (domain.vcpusFlags(live), domain.vcpusFlags(config)) == (2, 2)
    # beyond the domain's maximum: libvirt's words, the URI; the domain as it was
    with pytest.raises(ResizeError, match=r"^libvirt test:///default: .*5 > 4"):
        await hotplug.plug_vcpu("vcpu2", 5)
    assert domain.vcpusFlags(live) == 2 and domain.isActive()
    # the root disk is the domain's first (as `domain_xml` attaches it), whatever its name
    assert await hotplug.root_disk_size() == domain.blockInfo("vdb", 0)[0]
    domain.destroy()
    domain.undefine()
    with pytest.raises(ResizeError, match="is gone"):
        await hotplug.plug_memory("dimm1", 512)


# -- an imported domain's migration target (`_lvimportmig`), on the test driver -----------------
async def _incoming_target(runtime: LibvirtRuntime, tmp_path: Path, uid: str) -> Any:
    """A target pod's machine for an imported domain, its pool holding the disk libvirt made
    for the copy (as its migration's pre-creation does)."""
    from vkubelet.providers.vm._libvirt import IncomingLibvirtMachine
    from vkubelet.providers.vm._lvimportmig import pool_xml
    from vkubelet.providers.vm._migrate import DomainTarget

    directory = str(tmp_path / "imported" / uid)
    (tmp_path / uid).mkdir()  # the pod's run directory
    conn = await runtime.connection.get()
    pool = conn.storagePoolCreateXML(pool_xml(uid, directory), 0)  # (the driver cannot build)
    volume = "<volume><name>vda.qcow2</name><capacity>1048576</capacity></volume>"
    pool.createXML(volume, 0)
    target = DomainTarget(
        uri="test:///default",
        domain=f"site-{uid}",
        files=(),
        owner=(uid, "ns", f"imp-{uid}", "hv-1"),
        directory=directory,
    )
    return IncomingLibvirtMachine(runtime.connection, tmp_path / uid, target, imported=True)


def _pools(conn: Any) -> dict[str, list[str]]:
    return {
        str(p.name()): [str(v.name()) for v in p.listAllVolumes(0)]
        for p in conn.listAllStoragePools(0)
    }


@ONE_LOOP
async def test_a_target_the_imported_domain_never_reached_discards_the_copy_libvirt_made(
    tmp_path: Path,
) -> None:
    """A refused or abandoned move: the copy in the target's pool (the size of the domain's
    disks) goes with the target pod; one that arrived after all (defined here) keeps it."""
    from vkubelet.providers.vm._lvimportmig import pool_name

    runtime = _test_runtime(tmp_path)
    conn = await runtime.connection.get()
    refused = await _incoming_target(runtime, tmp_path, "refused-uid")
    assert _pools(conn)[pool_name("refused-uid")] == ["vda.qcow2"]
    await refused.kill()
    assert pool_name("refused-uid") not in _pools(conn)  # its volume deleted, then the pool

    arrived = await _incoming_target(runtime, tmp_path, "arrived-uid")
    metadata = (
        '<metadata><vkubelet:pod xmlns:vkubelet="https://vkubelet.io/xmlns/vm-domain/1" '
        'uid="arrived-uid" namespace="ns" name="imp-arrived-uid" node="hv-1"/></metadata>'
    )
    xml = (
        "<domain type='test'><name>site-arrived-uid</name><memory>65536</memory>"
        f"<os><type>hvm</type></os>{metadata}</domain>"
    )
    domain = conn.defineXML(xml)  # arrived, persistent, before the agent took it
    domain.create()
    assert await arrived._destroy_incoming()  # destroyed, still defined: its disks kept
    assert not domain.isActive() and domain.isPersistent()
    await arrived.kill()
    assert pool_name("arrived-uid") not in _pools(conn)  # the pool ends all the same
    domain.undefine()
