"""Fixtures of the cluster provider's tests with real workers on both sides.

Starting a dev cluster with a worker costs 30-60 s: the modules that need one below share it
for the session (they all use `worker_cluster`, so tests/parallel.py runs them in one worker),
each with its own agent and namespaces, told apart by `upperClusterID` and namespace prefix."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from vkubelet.devcluster import Cluster


@pytest.fixture(scope="session")
def lower_workers(
    worker_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A second dev cluster with one real worker, beside the session's upper `worker_cluster`
    (started after it: routes between the two need both networks)."""
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
