"""An imported domain's pod IP from its guest (`_guestaddr`): which address is the pod's, and
how it is followed. The provider's side is in test_import.py; on a real daemon,
tests/integration/vm/test_vm_libvirt.py."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from vkubelet.providers.vm import _guestaddr
from vkubelet.providers.vm._guestaddr import first_ipv4, follow, routed_peer
from vkubelet.testing.harness import eventually


def test_the_pod_s_address_is_the_guest_s_first_global_ipv4_address() -> None:
    answer = {  # libvirt's interfaceAddresses, source AGENT, in the guest's order
        "lo": {"hwaddr": "00:00:00:00:00:00", "addrs": [{"type": 0, "addr": "127.0.0.1"}]},
        "eth0": {
            "hwaddr": "52:54:00:00:00:01",
            "addrs": [
                {"type": 1, "addr": "fe80::1", "prefix": 64},
                {"type": 0, "addr": "169.254.3.4", "prefix": 16},
                {"type": 0, "addr": "192.0.2.7", "prefix": 24},
            ],
        },
        "eth1": {"hwaddr": "52:54:00:00:00:02", "addrs": [{"type": 0, "addr": "198.51.100.9"}]},
    }
    assert first_ipv4(answer) == "192.0.2.7"
    assert first_ipv4({"lo": answer["lo"], "eth0": {"addrs": None}}) is None
    assert first_ipv4({}) is None


def test_without_an_agent_a_routed_tap_s_peer_is_the_guest_s_address() -> None:
    xml = """<domain><devices>
      <interface type='bridge'><source bridge='br0'/></interface>
      <interface type='ethernet'><ip address='10.0.0.1' prefix='32' peer='10.0.0.5/32'/></interface>
    </devices></domain>"""
    assert routed_peer(xml) == "10.0.0.5"
    assert routed_peer("<domain><devices><interface type='bridge'/></devices></domain>") is None
    assert routed_peer("not xml") is None


async def test_the_address_is_reported_when_it_changes_and_kept_while_the_guest_cannot_tell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_guestaddr, "UNKNOWN_INTERVAL", 0.0)
    monkeypatch.setattr(_guestaddr, "KNOWN_INTERVAL", 0.0)
    answers: deque[str | Exception | None] = deque(
        [None, "10.0.0.5", "10.0.0.5", None, RuntimeError("daemon away"), "10.0.0.6"]
    )
    reported: list[str] = []

    async def read() -> str | None:
        answer = answers.popleft() if answers else "10.0.0.6"
        if isinstance(answer, Exception):
            raise answer
        return answer

    task = asyncio.create_task(follow(read, reported.append))
    try:
        await eventually(lambda: not answers)
        assert reported == ["10.0.0.5", "10.0.0.6"]
    finally:
        task.cancel()
