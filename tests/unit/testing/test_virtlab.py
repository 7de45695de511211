"""The libvirt lab's pure part: the test guest's domain XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from vkubelet.testing.virtlab import guest_domain_xml


def attribute(domain: ET.Element, path: str, name: str) -> str | None:
    element = domain.find(path)
    return None if element is None else element.get(name)


def test_the_guest_domain_is_tcg_with_its_disk_console_log_and_agent_channel() -> None:
    xml = guest_domain_xml("vm-0", Path("/h/vm-0.qcow2"), console_log=Path("/h/vm-0.log"))
    domain = ET.fromstring(xml)  # noqa: S314 - our own output
    assert domain.get("type") == "qemu"  # never kvm: it cannot boot stock guests here
    assert domain.findtext("name") == "vm-0"
    assert attribute(domain, "devices/disk/source", "file") == "/h/vm-0.qcow2"
    assert attribute(domain, "devices/serial/log", "file") == "/h/vm-0.log"
    assert attribute(domain, "devices/channel/target", "name") == "org.qemu.guest_agent.0"
    assert domain.find("devices/graphics") is None  # libvirt 9.0 rejects type='none'


def test_names_and_paths_with_markup_characters_stay_text() -> None:
    odd = "a'b\"c<d>&e"
    domain = ET.fromstring(guest_domain_xml(odd, Path(f"/h/{odd}.qcow2")))  # noqa: S314
    assert domain.findtext("name") == odd
    assert attribute(domain, "devices/disk/source", "file") == f"/h/{odd}.qcow2"
    assert domain.find("devices/serial/log") is None
