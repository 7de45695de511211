"""Adopting a libvirt domain vkubelet did not make (a VirtualMachine's `spec.importDomain`,
which `vkubelet vm import` writes): what a pod asks for, and whether a domain can be taken.

Pure (no daemon), so every rule is unit-tested; the libvirt runtime (`_libvirt`) does the I/O.
Why these rules:

- **The definition stays the site's.** Disks, NICs, name, size, devices: as defined. vkubelet
  adds only `<metadata>`: its import element (`IMPORT_URI`: the machine, i.e. the
  VirtualMachine's uid, the VirtualMachine, the node, the deletion policy) and, per pod, the pod
  element (`_domainxml.METADATA_URI`) that an agent restart reads as for any domain of ours. No
  device is added and no disk written by an image: a domain that lacks what vkubelet drives it
  through is refused naming what to add (`virsh edit`), not changed behind the site's back.
- **What it must have:** a serial console on a pty (libvirt's console stream: `kubectl logs`
  and `attach`) and the guest agent's virtio-serial channel `org.qemu.guest_agent.0` (`kubectl
  exec`, exec probes, a clean power off).
- **One owner.** A domain imported by another machine, or one vkubelet made for a pod, is
  refused; so is a name this node's libvirt does not define (a domain is imported on the node
  whose host has it).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ._backend import DomainImport
from ._domainxml import Owner, metadata_values
from ._spec import SpecError

__all__ = [
    "DELETION_POLICY_ANNOTATION",
    "DOMAIN_ANNOTATION",
    "IMPORT_URI",
    "ImportClaim",
    "claim_of",
    "missing_devices",
    "refusal",
    "requested",
]

#: The namespace of vkubelet's import element in an imported domain's `<metadata>`.
IMPORT_URI: Final = "https://vkubelet.io/xmlns/vm-import/1"
#: The pod annotations the VirtualMachine controller sets from `spec.importDomain`.
DOMAIN_ANNOTATION: Final = "vm.vkubelet.io/domain"
DELETION_POLICY_ANNOTATION: Final = "vm.vkubelet.io/domain-deletion-policy"
POLICIES: Final = ("Retain", "Delete")
AGENT_CHANNEL: Final = "org.qemu.guest_agent.0"
ET.register_namespace("vkubelet-import", IMPORT_URI)


def requested(
    annotations: Mapping[str, str], machine: str | None, owner: str
) -> DomainImport | None:
    """The domain a pod asks to run as (None: a domain of its own is made). ValueError, naming
    the annotation (SpecError), for a request the node cannot take: an imported domain belongs to a
    machine (the VirtualMachine's), so a plain pod cannot ask for one."""
    name = annotations.get(DOMAIN_ANNOTATION)
    if name is None:
        return None
    field = f"metadata.annotations[{DOMAIN_ANNOTATION}]"
    if not name.strip():
        raise SpecError(field, "empty domain name")
    policy = annotations.get(DELETION_POLICY_ANNOTATION) or "Retain"
    if policy not in POLICIES:
        raise SpecError(
            f"metadata.annotations[{DELETION_POLICY_ANNOTATION}]",
            f"{policy!r} is not {' or '.join(POLICIES)}",
        )
    if machine is None:
        raise SpecError(
            field,
            "an imported domain is a machine's: import it with a VirtualMachine "
            "(spec.importDomain, or `vkubelet vm import`)",
        )
    return DomainImport(name=name, machine=machine, owner=owner, policy=policy)


@dataclass(frozen=True)
class ImportClaim:
    """vkubelet's import element: which machine (VirtualMachine) holds the domain, from which
    node, and what deleting that VirtualMachine does to it."""

    machine: str
    owner: str  # namespace/name of the VirtualMachine
    node: str
    policy: str

    @classmethod
    def of(cls, request: DomainImport, node: str) -> ImportClaim:
        return cls(request.machine, request.owner, node, request.policy)

    def xml(self) -> str:
        """The element as `virDomainSetMetadata` takes it (libvirt puts it under IMPORT_URI)."""
        attributes = {
            "machine": self.machine,
            "owner": self.owner,
            "node": self.node,
            "policy": self.policy,
        }
        return ET.tostring(ET.Element("import", attributes), encoding="unicode")


def claim_of(metadata: str | None) -> ImportClaim | None:
    """The ImportClaim in vkubelet's import element as libvirt returns it (None: none)."""
    values = metadata_values(metadata, "import", ("machine", "owner", "node", "policy"))
    return ImportClaim(*values) if values is not None else None


def missing_devices(xml: str) -> list[str]:
    """What the domain (its XML) lacks that vkubelet drives it through, each with the element
    that adds it."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    missing = []
    consoles = [*root.iterfind("./devices/serial"), *root.iterfind("./devices/console")]
    if not any(c.get("type") == "pty" for c in consoles):
        missing.append("a serial console on a pty (<serial type='pty'/>: kubectl logs, attach)")
    channels = root.iterfind("./devices/channel")
    if not any(
        (target := c.find("target")) is not None
        and target.get("type") == "virtio"
        and target.get("name") == AGENT_CHANNEL
        for c in channels
    ):
        missing.append(
            "the guest agent's channel (<channel type='unix'><target type='virtio' "
            f"name='{AGENT_CHANNEL}'/></channel>: kubectl exec, a clean power off)"
        )
    return missing


def refusal(
    where: str,
    request: DomainImport,
    xml: str,
    claim: ImportClaim | None,
    pod_owner: Owner | None,
) -> tuple[str, str] | None:
    """(reason, message) when the domain cannot be this machine's; `where` names the URI and
    domain. Nothing is changed on a refusal, whatever it says to do."""
    if claim is not None and claim.machine != request.machine:
        return (
            "DomainOwned",
            f"{where} is imported by VirtualMachine {claim.owner} (machine {claim.machine}, "
            f"node {claim.node}); a domain is one VirtualMachine's. If that VirtualMachine is "
            f"gone and its node keeps no machineGC, drop the claim: virsh metadata "
            f"{request.name} {IMPORT_URI} --remove",
        )
    if claim is None and pod_owner is not None:
        return (
            "DomainOwned",
            f"{where} was made by vkubelet for pod {pod_owner.namespace}/{pod_owner.name} "
            f"(node {pod_owner.node}); only domains vkubelet did not make are imported",
        )
    if missing := missing_devices(xml):
        return (
            "DomainUnsupported",
            f"{where} cannot be driven: it has no {'; no '.join(missing)}. Add "
            f"{'them' if len(missing) > 1 else 'it'} with virsh edit (the domain is unchanged)",
        )
    return None
