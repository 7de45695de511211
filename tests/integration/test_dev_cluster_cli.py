"""`vkubelet dev cluster` as a user drives it: several clusters, clean shutdown, clear errors."""

import re
import socket
from pathlib import Path

import pytest

from vkubelet.devcluster import Cluster, StartupFailed, ensure_binaries, processes_mentioning
from vkubelet.testing import Kubectl

from .cli import vkubelet


def test_two_clusters_run_side_by_side_and_down_leaves_no_process(state: Path) -> None:
    for name in ("upper", "lower"):
        result = vkubelet(state, "dev", "cluster", "up", "--name", name)
        assert result.returncode == 0, result.stderr
        assert "export KUBECONFIG=" in result.stdout
    upper, lower = Cluster("upper", root=state), Cluster("lower", root=state)
    assert upper.server != lower.server
    assert upper.directory != lower.directory

    listing = vkubelet(state, "dev", "cluster", "list").stdout
    assert "upper" in listing and "lower" in listing

    Kubectl(upper.kubeconfig)("create", "namespace", "only-in-upper")
    assert Kubectl(lower.kubeconfig)("get", "namespace", "only-in-upper", check=False).returncode
    status = vkubelet(state, "dev", "cluster", "status", "--name", "lower")
    assert status.returncode == 0, status.stdout
    assert status.stdout.count("healthy") == 5
    assert re.search(r"metrics-server\s.*healthy", status.stdout), status.stdout

    again = vkubelet(state, "dev", "cluster", "up", "--name", "upper")
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stderr and "reusing it" in again.stderr
    assert upper.is_up()  # the second `up` reused the running cluster, undisturbed
    assert Kubectl(upper.kubeconfig)("get", "namespace", "only-in-upper").returncode == 0
    # Workers need the pod network from the start: asking a running cluster without one is
    # refused with what to do, and the cluster stays as it was.
    refused = vkubelet(state, "dev", "cluster", "up", "--name", "upper", "--workers", "1")
    assert refused.returncode == 1
    assert "without a pod network" in refused.stderr
    assert upper.is_up()

    for name in ("upper", "lower"):
        assert vkubelet(state, "dev", "cluster", "down", "--name", name).returncode == 0
    assert processes_mentioning(str(state)) == []
    assert not upper.directory.exists() and not lower.directory.exists()


def test_down_on_an_unknown_name_fails_clearly(state: Path) -> None:
    result = vkubelet(state, "dev", "cluster", "down", "--name", "ghost")
    assert result.returncode == 1
    assert "no cluster named 'ghost'" in result.stderr


def test_taken_apiserver_port_is_refused_and_nothing_starts(state: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = vkubelet(
            state, "dev", "cluster", "up", "--name", "p", "--apiserver-port", str(port)
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert not Cluster("p", root=state).exists()
    assert processes_mentioning(str(state)) == []


def test_missing_go_toolchain_is_reported_when_binaries_must_be_built(
    state: Path, tmp_path: Path
) -> None:
    result = vkubelet(
        state,
        "dev",
        "cluster",
        "up",
        "--name",
        "nogo",
        env={"PATH": "/nonexistent", "VKUBELET_CACHE_DIR": str(tmp_path / "empty-cache")},
    )
    assert result.returncode == 1
    assert "Go toolchain ('go') is not on PATH" in result.stderr
    assert not Cluster("nogo", root=state).exists()
    assert processes_mentioning(str(state)) == []


def test_a_component_that_fails_to_start_rolls_back_the_whole_cluster(state: Path) -> None:
    binaries = ensure_binaries(progress=lambda _: None)
    cluster = Cluster("broken", root=state)
    with pytest.raises(StartupFailed, match="kube-apiserver exited") as failure:
        cluster.up(
            binaries=binaries,
            extra_args={"kube-apiserver": ["--no-such-flag"]},
            progress=lambda _: None,
        )
    assert "unknown flag" in str(failure.value)  # the log tail tells the user why
    assert not cluster.exists()
    assert processes_mentioning(str(state)) == []  # etcd, started first, was stopped again


def test_metrics_server_failing_to_start_rolls_back_the_whole_cluster(state: Path) -> None:
    binaries = ensure_binaries(progress=lambda _: None)
    cluster = Cluster("broken-metrics", root=state)
    with pytest.raises(StartupFailed, match="metrics-server exited") as failure:
        cluster.up(
            binaries=binaries,
            extra_args={"metrics-server": ["--no-such-flag"]},
            progress=lambda _: None,
        )
    assert "unknown flag" in str(failure.value)
    assert not cluster.exists()
    assert processes_mentioning(str(state)) == []  # the four started before it were stopped


def test_cli_reports_usage_errors_with_nonzero_exit(state: Path) -> None:
    result = vkubelet(state, "dev", "cluster", "up", "--name", "Bad_Name")
    assert result.returncode == 1
    assert "invalid cluster name 'Bad_Name'" in result.stderr
