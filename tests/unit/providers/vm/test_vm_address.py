"""A VM keeps its address (issue 26): which address a pod of it gets, and which it is refused.

The pod network runs on a fake `ip` (a routing table and links in memory) so that each rule is
checked without root; the real kernel side is proven by tests/integration/vm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm import _net
from vkubelet.providers.vm._backend import GuestAddress
from vkubelet.providers.vm._config import ConfigError, parse_config
from vkubelet.providers.vm._net import STANDBY_METRIC, AddressRefused, PodNetwork
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.sdk import ProviderError

from .fakes import Events, FakeRuntime, make_pod

ADDRESS = "vm.vkubelet.io/address"


class FakeIp:
    """Just what `PodNetwork` asks of `ip`: links, and routes as (destination, link, metric)."""

    def __init__(self) -> None:
        self.links: set[str] = set()
        self.routes: list[tuple[str, str, int]] = []

    async def __call__(self, *args: str, check: bool = True) -> str:
        words = list(args)
        if words[:4] == ["-4", "route", "show", "dev"]:
            return "".join(
                f"{d} metric {m} scope link\n" for d, dev, m in self.routes if dev == words[4]
            )
        if words[:3] == ["-4", "route", "show"]:
            return "".join(f"{d} dev {dev} metric {m} scope link\n" for d, dev, m in self.routes)
        if words[:3] == ["-o", "link", "show"]:
            return "".join(f"{i}: {name}@if2: <UP>\n" for i, name in enumerate(self.links))
        if words[:2] == ["link", "show"]:
            return "x" if words[2] in self.links else ""
        if words[:2] == ["link", "add"]:
            self.links.add(words[2])
        elif words[:2] == ["link", "del"]:
            self.links.discard(words[2])
            self.routes = [r for r in self.routes if r[1] != words[2]]
        elif words[:2] in (["route", "replace"], ["route", "del"]):
            destination = words[2].removesuffix("/32")
            metric = int(words[words.index("metric") + 1]) if "metric" in words else 0
            self.routes = [r for r in self.routes if (r[0], r[2]) != (destination, metric)]
            if words[1] == "replace":
                self.routes.append((destination, words[4], metric))
        return ""


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeIp:
    fake = FakeIp()
    monkeypatch.setattr(_net, "_ip", fake)
    monkeypatch.setattr(_net, "_link_settings", lambda link, forward: None)
    return fake


def network(reserved: tuple[str, ...] = ()) -> PodNetwork:
    return PodNetwork("10.224.1.0/24", shared=["10.224.0.0/16"], reserved=lambda: reserved)


def test_the_guest_prefix_is_the_pod_cidr_s_or_the_shared_range_s_and_others_are_refused() -> None:
    net = network()
    assert net.prefix_for("10.224.1.7") == 24
    assert net.prefix_for("10.224.2.7") == 16  # moved here from another node: gateway on-link
    with pytest.raises(AddressRefused, match=r"outside this node's podCIDR 10.224.1.0/24 and its "
                       r"sharedPodCIDRs \(10.224.0.0/16\)") as refused:  # fmt: skip
        net.prefix_for("10.99.0.7")
    assert refused.value.reason == "AddressOutOfRange"
    for edge in ("10.224.1.1", "10.224.1.0", "10.224.1.255"):
        with pytest.raises(AddressRefused, match="not a host address"):
            net.prefix_for(edge)


async def test_a_requested_address_is_given_and_found_again(kernel: FakeIp) -> None:
    net = network()
    guest = await net.attach("pod-a", "10.224.2.9")
    assert (guest.address, guest.prefix, guest.gateway) == ("10.224.2.9", 16, "10.224.1.1")
    assert ("10.224.2.9", net.host_link("pod-a"), 0) in kernel.routes
    assert (await net.attach("pod-a", "10.224.2.9")).address == "10.224.2.9"  # idempotent


async def test_an_address_routed_to_another_link_is_refused_as_in_use(kernel: FakeIp) -> None:
    kernel.routes.append(("10.224.1.9", "vkvmotherlink1", 0))  # another node's VM, this machine
    with pytest.raises(AddressRefused, match=r"10\.224\.1\.9 of this VM is taken") as refused:
        await network().attach("pod-a", "10.224.1.9")
    assert refused.value.reason == "AddressInUse"
    assert kernel.links == set()  # nothing half-made


async def test_a_migration_target_waits_on_standby_until_it_claims_the_route(
    kernel: FakeIp,
) -> None:
    kernel.routes.append(("10.224.2.9", "vkvmsourcelink", 0))  # the source still has the guest
    net = network()
    await net.attach("target", "10.224.2.9", standby=True)
    link = net.host_link("target")
    assert set(kernel.routes) == {
        ("10.224.2.9", "vkvmsourcelink", 0),
        ("10.224.2.9", link, STANDBY_METRIC),
    }
    claimed = await net.claim("target")
    assert (claimed.address, claimed.prefix) == ("10.224.2.9", 16)
    assert kernel.routes == [("10.224.2.9", link, 0)]  # the /32 moved to this link


async def test_a_free_address_skips_routed_and_reserved_ones(kernel: FakeIp) -> None:
    kernel.routes.append(("10.224.1.2", "vkvmotherlink1", 0))
    guest = await network(reserved=("10.224.1.3",)).attach("pod-a")
    assert guest.address == "10.224.1.4"


def test_shared_pod_cidrs_are_checked_with_the_file_and_field_named(tmp_path: Path) -> None:
    config = parse_config({"sharedPodCIDRs": ["10.224.0.0/16"]}, origin="vm.yaml", base=tmp_path)
    assert config.shared_pod_cidrs == ("10.224.0.0/16",)
    with pytest.raises(ConfigError, match=r"vm.yaml: sharedPodCIDRs\[1\]: not an IPv4 network"):
        parse_config({"sharedPodCIDRs": ["10.0.0.0/8", "nope"]}, origin="vm.yaml", base=tmp_path)


# -- the provider: the pod's request ----------------------------------------------------------
def vm_pod(**annotations: str) -> Pod:
    pod = make_pod()
    assert pod.metadata is not None
    pod.metadata.annotations = {"vm.vkubelet.io/machine": "m-1", **annotations}
    return pod


async def test_a_pod_asking_for_its_vm_s_address_gets_it_and_the_machine_keeps_it(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    assert await provider.pod_ips(vm_pod(**{ADDRESS: "10.213.0.9"})) == ["10.213.0.9"]
    assert runtime.attached == [("uid-vm", "10.213.0.9", False)]
    record = json.loads((tmp_path / "s" / "machines" / "m-1" / "machine.json").read_text())
    assert record["address"] == "10.213.0.9"  # this node does not give it away while off


async def test_a_migration_target_asks_on_standby_and_keeps_nothing_until_it_arrives(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    pod = vm_pod(**{ADDRESS: "10.213.0.9", "vm.vkubelet.io/migration-source": "vm-src"})
    await provider.pod_ips(pod)
    assert runtime.attached == [("uid-vm", "10.213.0.9", True)]
    assert not (tmp_path / "s" / "machines" / "m-1" / "machine.json").exists()


async def test_a_bad_or_refused_address_is_the_pod_s_reason_naming_the_annotation(
    provider: VMProvider, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ProviderError) as bad:
        await provider.pod_ips(vm_pod(**{ADDRESS: "10.213.0.300"}))
    assert bad.value.reason == "InvalidAddress"
    assert (
        bad.value.message
        == f"metadata.annotations[{ADDRESS}]: '10.213.0.300' is not an IPv4 address"
    )

    async def refuse(key: str, address: str | None = None, *, standby: bool = False) -> None:
        raise AddressRefused(
            "AddressInUse", f"address {address} of this VM is taken by another one"
        )

    monkeypatch.setattr(runtime, "attach_network", refuse)
    with pytest.raises(ProviderError) as taken:
        await provider.pod_ips(vm_pod(**{ADDRESS: "10.213.0.9"}))
    assert (taken.value.reason, taken.value.message) == (
        "AddressInUse",
        f"metadata.annotations[{ADDRESS}]: address 10.213.0.9 of this VM is taken by another one",
    )


async def test_a_migration_target_that_cannot_route_the_address_takes_one_of_its_own(
    provider: VMProvider, runtime: FakeRuntime, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    attach = runtime.attach_network

    async def out_of_range(
        key: str, address: str | None = None, *, standby: bool = False
    ) -> GuestAddress:
        if address is not None:
            raise AddressRefused("AddressOutOfRange", f"address {address} is outside")
        return await attach(key, standby=standby)

    monkeypatch.setattr(runtime, "attach_network", out_of_range)
    target = vm_pod(**{ADDRESS: "10.99.0.9", "vm.vkubelet.io/migration-source": "vm-src"})
    assert await provider.pod_ips(target) == ["10.213.0.2"]  # the VM still moves
    assert events.pod == [
        (
            "Warning",
            "AddressNotKept",
            f"metadata.annotations[{ADDRESS}]: address 10.99.0.9 is outside; "
            "the VM gets 10.213.0.2 here",
        )
    ]
    with pytest.raises(ProviderError) as refused:  # not a migration: the pod says why
        await provider.pod_ips(vm_pod(**{ADDRESS: "10.99.0.9"}))
    assert refused.value.reason == "AddressOutOfRange"
