"""`vkubelet dev cluster up` options as the cluster receives them (no cluster is started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

import vkubelet.devcluster
from vkubelet.cli import app


class _Cluster:
    """Records `up`'s arguments instead of starting anything."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, name: str) -> None:
        self.name = name
        self.server = "https://127.0.0.1:6443"
        self.kubernetes_version = "v0"
        self.kubeconfig = Path("/nonexistent/kubeconfig")

    def up(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)

    def workers(self) -> list[object]:
        return []


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setattr(vkubelet.devcluster, "Cluster", _Cluster)
    _Cluster.calls = []
    return _Cluster.calls


def test_the_node_monitor_grace_period_reaches_the_controller_manager(
    calls: list[dict[str, Any]],
) -> None:
    done = CliRunner().invoke(app, ["dev", "cluster", "up", "--node-monitor-grace-period", "20"])
    assert done.exit_code == 0, done.output
    assert calls[-1]["extra_args"] == {
        "kube-controller-manager": ["--node-monitor-grace-period=20s"]
    }
    done = CliRunner().invoke(app, ["dev", "cluster", "up"])
    assert done.exit_code == 0, done.output
    assert calls[-1]["extra_args"] == {}  # Kubernetes' own default


def test_a_grace_period_under_20_s_is_refused_naming_the_option(
    calls: list[dict[str, Any]],
) -> None:
    done = CliRunner().invoke(app, ["dev", "cluster", "up", "--node-monitor-grace-period", "5"])
    assert done.exit_code == 2
    assert "--node-monitor-grace-period" in done.output
    assert calls == []
