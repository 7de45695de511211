"""The agent's node identity bootstrapped with the pod's service account (`--bootstrap-in-cluster`,
the chart's `identity: node`): one node's identity, and that account writes the replicas' Leases,
which `system:node:<name>` may not."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.agent._identity import bootstrap_identity, lease_kubeconfig
from vkubelet.node import AgentConfig, ConfigError, NodeSettings, NodeSpec

from .cli import invoke


def config(*names: str, **kwargs: object) -> AgentConfig:
    nodes = [NodeSpec(NodeSettings(name=name, provider="mock")) for name in names]
    return AgentConfig(nodes=nodes, cert_dir=Path("/pki"), **kwargs)  # type: ignore[arg-type]


def test_the_service_account_bootstraps_the_nodes_identity_kept_in_the_cert_dir() -> None:
    identity = bootstrap_identity(config("vk-a", bootstrap_in_cluster=True))
    assert identity is not None
    assert identity.bootstrap_in_cluster and identity.bootstrap is None
    assert identity.kubeconfig == Path("/pki/vk-a.kubeconfig")


def test_the_leases_are_written_by_the_service_account_not_the_node() -> None:
    node_file = Path("/pki/vk-a.kubeconfig")  # --kubeconfig: where the node identity goes
    assert lease_kubeconfig(config("vk-a", kubeconfig=node_file, bootstrap_in_cluster=True)) is None
    assert lease_kubeconfig(config("vk-a", kubeconfig=node_file)) == node_file


@pytest.mark.parametrize(
    ("names", "kwargs", "message"),
    [
        (("a", "b"), {"bootstrap_in_cluster": True}, "serve one node"),
        (
            ("a",),
            {"bootstrap_in_cluster": True, "bootstrap_kubeconfig": Path("b.kubeconfig")},
            "not both",
        ),
    ],
)
def test_a_node_identity_is_one_nodes_from_one_bootstrap(
    names: tuple[str, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        bootstrap_identity(config(*names, **kwargs))


def test_sharding_is_refused_with_a_node_identity() -> None:
    args = ["run", "--provider", "mock", "--nodename", "a", "--shard", "--bootstrap-in-cluster"]
    result = invoke(*args)
    assert result.exit_code == 1
    assert "a node identity is one node's" in result.output
