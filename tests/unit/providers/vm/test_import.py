"""Imported libvirt domains in the provider (`_domainimport`), on the fake runtime: a pod of
one starts the domain as it is (no image, disk, seed or network of ours), a refusal is the pod's
reason with nothing made, and the machine GC applies the deletion policy. The libvirt side is
tests/unit/providers/vm/test_libvirt.py and, on a real daemon,
tests/integration/vm/test_vm_libvirt.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.core_v1 import PodIP
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm import _guestaddr
from vkubelet.providers.vm._backend import DomainImport
from vkubelet.providers.vm._domainimport import (
    ImportClaim,
    claim_of,
    missing_devices,
    requested,
)
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.providers.vm._spec import SpecError
from vkubelet.sdk import ProviderError, ResolvedPod
from vkubelet.testing.harness import eventually

from .fakes import Events, FakeRuntime, state

UUID = "6f1c0e8a-0000-4000-8000-000000000001"


def imported_pod(annotations: dict[str, str] | None = None, **spec: Any) -> Pod:
    """A pod as the VM controller makes it for `spec.importDomain: {name: site-db}`."""
    body = {
        "metadata": {
            "name": "db-x1",
            "namespace": "ns",
            "uid": "uid-db-x1",
            "annotations": {
                "vm.vkubelet.io/machine": "vm-uid",
                "vm.vkubelet.io/domain": "site-db",
                "vm.vkubelet.io/domain-deletion-policy": "Delete",
                **(annotations or {}),
            },
            "ownerReferences": [
                {
                    "apiVersion": "vkubelet.io/v1alpha1",
                    "kind": "VirtualMachine",
                    "name": "db",
                    "uid": "vm-uid",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/imported"}],
            **spec,
        },
    }
    return Pod.from_dict(body)  # type: ignore[return-value]


async def _waiting(provider: VMProvider) -> Any:
    _, status = await state(provider, "db-x1")
    return status.state.waiting if status else None


async def test_an_imported_domain_starts_as_it_is_with_no_image_disk_seed_or_network(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    runtime.imports["site-db"] = UUID
    await provider.create_pod(ResolvedPod(imported_pod()))

    async def running() -> bool:
        _, status = await state(provider, "db-x1")
        return bool(status and status.state.running)

    await eventually(running)
    (spec,) = runtime.launches
    assert spec.domain == DomainImport("site-db", "vm-uid", "ns/db", "Delete")
    assert (spec.disks, spec.seed, spec.network_key, spec.claims) == ((), None, None, ())
    assert runtime.attached == [] and runtime.seeds == []  # (and the image has no rule)
    record = json.loads((tmp_path / "s" / "machines" / "vm-uid" / "import.json").read_text())
    assert (record["name"], record["uuid"], record["policy"]) == ("site-db", UUID, "Delete")


async def test_an_import_the_runtime_refuses_is_the_pod_s_reason_and_nothing_is_made(
    provider: VMProvider, runtime: FakeRuntime, events: Events, tmp_path: Path
) -> None:
    await provider.create_pod(ResolvedPod(imported_pod()))

    async def refused() -> bool:
        waiting = await _waiting(provider)
        return waiting is not None and waiting.reason == "DomainNotFound"

    await eventually(refused)
    assert "'site-db'" in (await _waiting(provider)).message
    assert any(e[1] == "Failed" and "site-db" in e[2] for e in events.pod)
    assert runtime.launches == []
    assert not (tmp_path / "s" / "machines" / "vm-uid").exists()


@pytest.mark.parametrize(
    ("annotations", "spec", "field"),
    [
        ({"vm.vkubelet.io/machine": None}, {}, "metadata.annotations[vm.vkubelet.io/domain]"),
        (
            {"vm.vkubelet.io/domain-deletion-policy": "Keep"},
            {},
            "metadata.annotations[vm.vkubelet.io/domain-deletion-policy]",
        ),
        ({}, {"volumes": [{"name": "scratch", "emptyDir": {}}]}, "spec.volumes[scratch]"),
    ],
)
async def test_an_import_the_node_cannot_take_is_refused_naming_the_field(
    provider: VMProvider,
    runtime: FakeRuntime,
    annotations: dict[str, Any],
    spec: dict[str, Any],
    field: str,
) -> None:
    runtime.imports["site-db"] = UUID
    pod = imported_pod(**spec)
    assert pod.metadata is not None and pod.metadata.annotations is not None
    for key, value in annotations.items():  # None: the annotation left out
        if value is None:
            del pod.metadata.annotations[key]
        else:
            pod.metadata.annotations[key] = value
    with pytest.raises(ProviderError) as refused:
        await provider.create_pod(ResolvedPod(pod))
    assert refused.value.reason == "InvalidVMSpec" and field in refused.value.message
    assert runtime.launches == []


async def test_an_imported_domain_is_shut_down_with_its_pod_and_released_by_its_policy(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    runtime.imports["site-db"] = UUID
    pod = imported_pod()
    await provider.create_pod(ResolvedPod(pod))

    async def up() -> bool:
        _, status = await state(provider, "db-x1")
        return bool(status and status.state.running)

    await eventually(up)
    (machine,) = runtime.machines.values()
    await provider.delete_pod(pod, 5)

    async def gone() -> bool:
        return await provider.get_pod("ns", "db-x1") is None

    await eventually(gone)
    assert machine.stops == [5.0]  # the graceful stop, within the pod's grace
    directory = tmp_path / "s" / "machines" / "vm-uid"
    await provider._machine_gone(directory)  # its VirtualMachine deleted
    assert runtime.released == [(UUID, "vm-uid", True)]


async def test_an_imported_domain_s_pod_has_no_ip_until_its_guest_tells_then_the_guest_s(
    provider: VMProvider, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_guestaddr, "UNKNOWN_INTERVAL", 0.01)
    monkeypatch.setattr(_guestaddr, "KNOWN_INTERVAL", 0.01)
    runtime.imports["site-db"] = UUID
    pod = imported_pod()
    assert await provider.pod_ips(pod) == []  # not the node's: the downward API's is empty
    await provider.create_pod(ResolvedPod(pod))

    async def pod_ip() -> str | None:
        status = (await provider.get_pod("ns", "db-x1")).status  # type: ignore[union-attr]
        assert status is not None and status.hostIP == "192.0.2.1"
        assert status.podIPs == ([PodIP(ip=status.podIP)] if status.podIP else None)
        return status.podIP

    async def running() -> bool:
        _, status = await state(provider, "db-x1")
        return bool(status and status.state.running)

    await eventually(running)
    (machine,) = runtime.machines.values()
    assert await pod_ip() is None  # the guest has told nothing yet
    pushed: list[Pod] = []
    provider.notify_pods(pushed.append)
    machine.address = "192.0.2.7"
    assert await eventually(pod_ip) == "192.0.2.7"
    assert any(p.status and p.status.podIP == "192.0.2.7" for p in pushed)  # pushed, not polled
    machine.address = "192.0.2.8"  # a new lease

    async def renewed() -> bool:
        return await pod_ip() == "192.0.2.8"

    await eventually(renewed)
    machine.address = None  # the guest between two leases: the pod keeps its address
    reads = machine.address_reads
    await eventually(lambda: machine.address_reads > reads + 2)
    assert await pod_ip() == "192.0.2.8"


def test_what_a_pod_asks_to_import_and_the_claim_vkubelet_writes_on_the_domain() -> None:
    annotations = {"vm.vkubelet.io/domain": "site-db"}
    assert requested({}, "m", "ns/db") is None
    assert requested(annotations, "m", "ns/db") == DomainImport("site-db", "m", "ns/db", "Retain")
    with pytest.raises(SpecError, match="a machine's"):
        requested(annotations, None, "ns/db")
    claim = ImportClaim("m", "ns/db", "hv-1", "Retain")
    assert claim_of(claim.xml()) == claim
    as_libvirt_returns = (
        '<import xmlns="https://vkubelet.io/xmlns/vm-import/1" machine="m" owner="ns/db" '
        'node="hv-1" policy="Retain"/>'
    )
    assert claim_of(as_libvirt_returns) == claim
    assert claim_of(None) is None and claim_of("<pod uid='x'/>") is None


def test_a_domain_needs_a_pty_console_and_the_guest_agent_channel() -> None:
    full = (
        "<domain><devices><serial type='pty'/><channel type='unix'>"
        "<target type='virtio' name='org.qemu.guest_agent.0'/></channel></devices></domain>"
    )
    assert missing_devices(full) == []
    file_console = "<domain><devices><serial type='file'/></devices></domain>"
    missing = missing_devices(file_console)
    assert len(missing) == 2 and "pty" in missing[0] and "org.qemu.guest_agent.0" in missing[1]


def test_an_imported_domain_s_launch_is_kept_for_an_agent_restart() -> None:
    from vkubelet.providers.vm._vm import Launch

    launch = Launch(name="ns/db-x1", domain=DomainImport("site-db", "vm-uid", "ns/db", "Delete"))
    assert Launch.from_json(json.loads(json.dumps(launch.to_json()))) == launch
    assert "domain" not in Launch(name="ns/plain").to_json()  # what older agents wrote: no key


async def test_a_resize_of_an_imported_domain_is_infeasible_saying_where_to_change_it(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    runtime.imports["site-db"] = UUID
    limits = {"cpu": "1", "memory": "512Mi"}
    container = {"name": "vm", "image": "vm.vkubelet.io/imported", "resources": {"limits": limits}}
    sized: dict[str, Any] = {"containers": [container]}
    await provider.create_pod(ResolvedPod(imported_pod(None, **sized)))

    async def running() -> bool:
        _, status = await state(provider, "db-x1")
        return bool(status and status.state.running)

    await eventually(running)

    async def pending() -> Any:
        pod = await provider.get_pod("ns", "db-x1")
        assert pod is not None and pod.status is not None
        found = [c for c in pod.status.conditions or [] if c.type == "PodResizePending"]
        return found[0] if found else None

    bigger = imported_pod(None, **sized)
    bigger.spec.containers[0].resources.limits["memory"] = "1Gi"  # type: ignore[index,union-attr]
    await provider.update_pod(ResolvedPod(bigger))
    condition = await pending()
    assert condition is not None and condition.status == "True"
    assert condition.reason == "Infeasible" and "virsh setvcpus" in condition.message
    _, status = await state(provider, "db-x1")
    assert status.resources.limits["memory"] == "512Mi"  # what runs
    await provider.update_pod(ResolvedPod(imported_pod(None, **sized)))  # asks for what runs again
    condition = await pending()
    assert condition is not None and condition.status == "False"
