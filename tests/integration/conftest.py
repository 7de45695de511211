"""Fixtures shared by integration tests: the cluster provider's lower cluster (see clusters.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .clusters import LowerCluster, lower_cluster_session


@pytest.fixture(scope="session")
def lower_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LowerCluster]:
    """A second dev cluster with three mock nodes of different sizes and zones, for the session."""
    with lower_cluster_session(tmp_path_factory.mktemp("lower")) as lower:
        yield lower
