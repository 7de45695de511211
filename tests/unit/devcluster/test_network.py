"""The dev cluster's pod network plan: names and ranges from an index, allocation that skips what
the machine already uses and takes back what dead clusters left, and preflight messages."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from vkubelet.devcluster import _network
from vkubelet.devcluster._network import NetworkPlan, NetworkUnavailable


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_network, "RUN_DIR", tmp_path / "run")
    monkeypatch.setattr(_network, "host_networks_in_use", lambda: [])
    return tmp_path / "run" / "networks"


def test_every_name_and_range_follows_from_the_index_and_fits_linux_limits() -> None:
    plan = NetworkPlan(31)
    worker = plan.worker(31)
    assert len(plan.bridge) <= 15 and len(worker.netns) <= 15  # IFNAMSIZ - 1
    assert worker.netns.startswith(plan.prefix)
    assert ipaddress.ip_address(worker.node_ip) in plan.node_subnet
    assert ipaddress.IPv4Network(worker.pod_cidr).subnet_of(plan.cluster_cidr)
    assert plan.host_ip == "10.200.31.1"


def test_every_network_s_pod_ranges_fall_in_what_the_workers_route_to_the_host() -> None:
    for plan in (NetworkPlan(0), NetworkPlan(_network.MAX_NETWORKS - 1)):
        assert plan.cluster_cidr.subnet_of(ipaddress.IPv4Network(_network.WORKER_PODS_CIDR))
        assert plan.virtual_cidr.subnet_of(ipaddress.IPv4Network(_network.VIRTUAL_PODS_CIDR))


def test_two_networks_and_two_workers_never_share_a_range() -> None:
    plans = [NetworkPlan(i) for i in range(_network.MAX_NETWORKS)]
    ranges = [r for p in plans for r in p.ranges()]
    assert not any(a.overlaps(b) for i, a in enumerate(ranges) for b in ranges[i + 1 :])
    pods = [ipaddress.ip_network(plans[0].worker(i).pod_cidr) for i in range(_network.MAX_WORKERS)]
    assert not any(a.overlaps(b) for i, a in enumerate(pods) for b in pods[i + 1 :])
    assert not any(p.overlaps(ipaddress.ip_network(_network.SERVICE_CIDR)) for p in ranges)


def test_a_worker_beyond_the_limit_is_refused() -> None:
    with pytest.raises(Exception, match="at most"):
        NetworkPlan(0).worker(_network.MAX_WORKERS)


def test_allocation_skips_ranges_the_machine_uses_and_ones_held_by_live_clusters(
    registry: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        _network, "host_networks_in_use", lambda: [ipaddress.ip_network("10.200.0.0/16")]
    )
    with pytest.raises(
        NetworkUnavailable,
        match=r"10\.200\.0\.0/24, 10\.160\.0\.0/16, 10\.224\.0\.0/16 \(taken: 10\.200\.0\.0/16\)",
    ):
        _network.allocate(tmp_path / "a", lambda _: False, lambda _: None)

    monkeypatch.setattr(
        _network, "host_networks_in_use", lambda: [ipaddress.ip_network("10.160.0.0/24")]
    )
    first = _network.allocate(tmp_path / "b", lambda _: False, lambda _: None)
    assert first.index == 1  # 10.160.0.0/16 overlaps a route of this machine
    second = _network.allocate(tmp_path / "c", lambda _: False, lambda _: None)
    assert second.index == 2
    assert _network.allocate(tmp_path / "b", lambda _: False, lambda _: None) == first
    assert json.loads((registry / "1.json").read_text()) == {"cluster": str(tmp_path / "b")}


def test_a_dead_clusters_network_is_reclaimed_before_it_is_reused(
    registry: Path, tmp_path: Path
) -> None:
    _network.allocate(tmp_path / "dead", lambda _: False, lambda _: None)
    reclaimed: list[int] = []
    plan = _network.allocate(
        tmp_path / "new", lambda owner: owner.endswith("dead"), lambda p: reclaimed.append(p.index)
    )
    assert plan.index == 0 and reclaimed == [0]
    assert _network.registered_owner(0) == str(tmp_path / "new")


def test_the_registry_disappears_with_the_last_network(registry: Path, tmp_path: Path) -> None:
    plan = _network.allocate(tmp_path / "a", lambda _: False, lambda _: None)
    assert registry.is_dir()
    _network.release(plan, tmp_path / "someone-else")  # not the owner: nothing happens
    assert _network.registered_owner(plan.index) == str(tmp_path / "a")
    _network.release(plan, tmp_path / "a")
    assert not registry.exists()


def test_preflight_names_every_missing_program_and_the_packages_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(
        "shutil.which", lambda tool: None if tool in ("nft", "runc") else f"/x/{tool}"
    )
    monkeypatch.setattr(_network, "CNI_BIN_DIR", tmp_path)  # no CNI plugins there
    with pytest.raises(NetworkUnavailable) as failure:
        _network.preflight()
    message = str(failure.value)
    assert "nft" in message and "runc" in message
    assert "apt-get install -y --no-install-recommends" in message
    assert "containernetworking-plugins nftables runc" in message
    assert "bridge" in message  # the CNI plugins it looked for


def test_preflight_asks_for_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NetworkUnavailable, match="need root"):
        _network.preflight()
