"""Live migration of an imported libvirt domain (`_lvimportmig`): what the source's daemon is
given and what the target publishes, checked without a daemon
(tests/integration/vm/test_vm_libvirt_migration.py moves an imported domain between two hosts)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vkubelet.providers.vm._domainimport import IMPORT_URI, ImportClaim, claim_of
from vkubelet.providers.vm._domainxml import METADATA_URI, Owner, owner_of
from vkubelet.providers.vm._lvimportmig import copies_in, destination_xml, pool_name, pool_xml
from vkubelet.providers.vm._lvmigrate import flags
from vkubelet.providers.vm._migrate import DomainTarget, Endpoint

TARGET_POD = Owner("dst-uid", "team-a", "db-1", "hv-2")
CLAIM = ImportClaim("vm-uid", "team-a/db", "hv-1", "Retain")
SITE_DOMAIN = f"""<domain type='qemu'>
  <name>site-db</name>
  <uuid>5f3b7072-1649-4064-a3ca-0764911b2e17</uuid>
  <title>the site's database</title>
  <metadata>
    <vkubelet-import:import xmlns:vkubelet-import='{IMPORT_URI}' machine='vm-uid'
      owner='team-a/db' node='hv-1' policy='Retain'/>
    <vkubelet:pod xmlns:vkubelet='{METADATA_URI}' uid='src-uid' namespace='team-a' name='db-0'
      node='hv-1'/>
  </metadata>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/srv/images/db.qcow2'/>
      <backingStore type='file'><format type='qcow2'/><source file='/srv/base.qcow2'/>
      </backingStore>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/srv/images/data.img'/>
      <target dev='vdb' bus='virtio'/>
    </disk>
    <disk type='file' device='cdrom'>
      <source file='/srv/iso/tools.iso'/>
      <target dev='sda' bus='sata'/>
      <readonly/>
    </disk>
    <interface type='bridge'><source bridge='br-site'/><mac address='52:54:00:aa:bb:cc'/>
    </interface>
  </devices>
</domain>"""


def test_an_imported_domain_s_disks_go_whole_into_the_target_directory_and_its_identity_stays() -> (
    None
):
    xml, copied = destination_xml(SITE_DOMAIN, "/var/lib/vk/pods/dst-uid/disks/", TARGET_POD)
    root = ET.fromstring(xml)  # noqa: S314 - built here
    assert copied == ["vda", "vdb"]  # the writable ones; the CD-ROM image must be there
    sources = [d.find("source").get("file") for d in root.iterfind("./devices/disk")]  # type: ignore[union-attr]
    assert sources == [
        "/var/lib/vk/pods/dst-uid/disks/vda.qcow2",
        "/var/lib/vk/pods/dst-uid/disks/vdb.raw",
        "/srv/iso/tools.iso",
    ]
    assert root.find("./devices/disk/backingStore") is None  # a whole copy has no chain
    # its name, UUID, title and NICs are the site's; vkubelet's metadata names the target
    assert root.findtext("name") == "site-db"
    assert root.findtext("uuid") == "5f3b7072-1649-4064-a3ca-0764911b2e17"
    assert root.findtext("title") == "the site's database"
    assert root.find("./devices/interface/source").get("bridge") == "br-site"  # type: ignore[union-attr]
    pod, claim = (
        ET.tostring(element, encoding="unicode")
        for element in (
            root.find(f"metadata/{{{METADATA_URI}}}pod"),
            root.find(f"metadata/{{{IMPORT_URI}}}import"),
        )
        if element is not None
    )
    assert owner_of(pod) == TARGET_POD
    assert claim_of(claim) == ImportClaim("vm-uid", "team-a/db", "hv-2", "Retain")


def test_an_imported_domain_with_a_block_disk_is_refused_naming_it() -> None:
    block = SITE_DOMAIN.replace(
        "<disk type='file' device='disk'>\n      <driver name='qemu' type='raw'/>\n"
        "      <source file='/srv/images/data.img'/>",
        "<disk type='block' device='disk'>\n      <driver name='qemu' type='raw'/>\n"
        "      <source dev='/dev/sdb'/>",
    )
    with pytest.raises(ValueError, match="disk vdb is a block disk"):
        destination_xml(block, "/d", TARGET_POD)


def test_an_imported_domain_s_copy_is_a_whole_one_and_a_pod_s_own_the_overlay() -> None:
    import libvirt

    assert flags(libvirt, whole_disks=True) & libvirt.VIR_MIGRATE_NON_SHARED_DISK
    assert not flags(libvirt, whole_disks=True) & libvirt.VIR_MIGRATE_NON_SHARED_INC
    assert flags(libvirt) & libvirt.VIR_MIGRATE_NON_SHARED_INC


def test_the_target_s_pool_is_a_dir_pool_of_its_pod_over_its_directory() -> None:
    pool = ET.fromstring(pool_xml("dst-uid", "/var/lib/vk/a&b/disks"))  # noqa: S314
    assert pool.get("type") == "dir"
    assert pool.findtext("name") == pool_name("dst-uid") == "vkubelet-incoming-dst-uid"
    assert pool.findtext("target/path") == "/var/lib/vk/a&b/disks"


def test_an_imported_domain_s_target_round_trips_with_its_directory() -> None:
    target = DomainTarget(
        uri="qemu+ssh://root@10.0.0.3/system",
        domain="site-db",
        files=(),
        owner=("dst-uid", "team-a", "db-1", "hv-2"),
        directory="/var/lib/vk/pods/dst-uid/disks",
    )
    endpoint = Endpoint("10.0.0.3", 0, 0, 0, (), pod="db-1", libvirt=target)
    assert Endpoint.from_json(endpoint.to_json()) == endpoint


def test_the_copies_a_domain_leaves_behind_are_its_disks_in_this_node_s_imported_directory() -> (
    None
):
    """What a move made here (one directory per receiving pod) and nothing else: not the
    site's own files, not a read-only image, not a directory deeper or elsewhere."""
    root = Path("/var/lib/vk/imported")
    xml = """<domain><devices>
      <disk type='file' device='disk'><source file='/var/lib/vk/imported/p1/vda.qcow2'/></disk>
      <disk type='file' device='disk'><source file='/var/lib/vk/imported/p1/vdb.raw'/></disk>
      <disk type='file' device='disk'><source file='/var/lib/vk/imported/p0/vdc.qcow2'/></disk>
      <disk type='file' device='disk'><source file='/srv/images/site.qcow2'/></disk>
      <disk type='file' device='disk'><source file='/var/lib/vk/imported/x/y/vdd.qcow2'/></disk>
      <disk type='file' device='cdrom'><source file='/var/lib/vk/imported/p2/cd.iso'/></disk>
      <disk type='file' device='disk'><source file='/var/lib/vk/imported/p3/ro.qcow2'/>
        <readonly/></disk>
      <disk type='block' device='disk'><source dev='/var/lib/vk/imported/p4/blk'/></disk>
    </devices></domain>"""
    assert copies_in(xml, root) == [root / "p1", root / "p0"]
    assert copies_in(SITE_DOMAIN, root) == []
