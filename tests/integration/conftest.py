"""Fixtures shared by integration tests: the cluster provider's lower cluster (see clusters.py),
a lower cluster with a real worker beside `worker_cluster`, and one mock node for the modules
that only talk to a node's kubelet API."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vkubelet.devcluster import Cluster, processes_mentioning
from vkubelet.testing import Kubectl, MockNode, local_test_address, mock_node

from .clusters import LowerCluster, lower_cluster_session


@pytest.fixture(scope="session")
def lower_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LowerCluster]:
    """A second dev cluster with three mock nodes of different sizes and zones, for the session."""
    with lower_cluster_session(tmp_path_factory.mktemp("lower")) as lower:
        yield lower


@pytest.fixture(scope="session")
def lower_workers(
    worker_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A second dev cluster with one real worker, beside the session's upper `worker_cluster`
    (started after it: routes between the two need both networks).

    Starting one costs 30-60 s: the modules that need one below (the cluster provider's tests
    with real workers on both sides, the chart's cluster provider run as a pod) share it for
    the session. They all use `worker_cluster`, so tests/parallel.py runs them in one worker;
    each has its own agent and namespaces, told apart by `upperClusterID` and namespace prefix.
    """
    cluster = Cluster(f"lowerw-{os.getpid()}", root=tmp_path_factory.mktemp("lowerw"))
    cluster.up(  # a failed `up` leaves nothing behind
        workers=1,
        progress=lambda m: print(f"[lowerw] {m}", file=sys.stderr, flush=True),
        tie_to_parent=True,
    )
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def api_node(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MockNode]:
    """A mock node at a non-loopback address of this machine (as root; else 127.0.0.1, where the
    apiserver's node proxy refuses it), shared by the modules that run pods of their own names
    on it and reach them through kubectl and the kubelet API (logs, exec, attach, port-forward,
    stats, top). One agent start and stop for all of them instead of one per module."""
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address()) if os.geteuid() == 0 else "127.0.0.1"
        workdir = tmp_path_factory.mktemp("api-node")
        yield stack.enter_context(
            mock_node(kube_cluster, kubectl, workdir, prefix="vk-api", address=address)
        )


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A private state root; whatever a test leaves running there is a failure and gets killed."""
    root = tmp_path / "state"
    yield root
    leftovers = processes_mentioning(str(root))
    if leftovers:
        subprocess.run(["kill", "-9", *map(str, leftovers)], check=False)
        pytest.fail(f"processes left behind: {leftovers}")
