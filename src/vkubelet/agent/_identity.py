"""Who the agent is: a node's client identity obtained from a bootstrap token (like a kubelet's
`--bootstrap-kubeconfig`), and what the apiserver says about us, since a node identity brings the
Node authorizer's and NodeRestriction's rules with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from ..kube import ApiError, KubeClient, Unreachable
from ..node import AgentConfig, ClientIdentity, ConfigError, NodeAgent
from ..sdk.retry import Backoff

log = logging.getLogger(__name__)


def bootstrap_identity(config: AgentConfig) -> ClientIdentity | None:
    """The node identity to obtain, when a bootstrap kubeconfig (or the pod's service account,
    `bootstrap_in_cluster`) is given."""
    if config.bootstrap_kubeconfig is None and not config.bootstrap_in_cluster:
        return None
    if config.bootstrap_kubeconfig is not None and config.bootstrap_in_cluster:
        raise ConfigError("--bootstrap-kubeconfig or --bootstrap-in-cluster: not both")
    if len(config.nodes) != 1:
        raise ConfigError("a bootstrap identity gives one node identity: serve one node")
    name = config.nodes[0].settings.name
    return ClientIdentity(
        kubeconfig=config.kubeconfig or config.cert_dir / f"{name}.kubeconfig",
        bootstrap=config.bootstrap_kubeconfig,
        bootstrap_in_cluster=config.bootstrap_in_cluster,
        node_name=name,
    )


def lease_kubeconfig(config: AgentConfig) -> Path | None:
    """Whose credentials write the replicas' Leases: the agent's own, but for a node identity
    bootstrapped with the pod's service account, which may write Leases in its namespace where
    `system:node:<name>` may not (there `--kubeconfig` names the node identity's file; None is
    the environment's account, in a pod its service account)."""
    return None if config.bootstrap_in_cluster else config.kubeconfig


async def identify(client: KubeClient, nodes: Sequence[NodeAgent]) -> str:
    """Who the apiserver says we are; a node identity switches on NodeRestriction's rules.

    Waits (with back-off, saying so) while the apiserver is unreachable.
    """
    backoff = Backoff(initial=0.5, cap=30.0)
    while True:
        try:
            review = await client.create(
                "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            )
            break
        except Unreachable as e:
            delay = backoff.next_delay()
            log.warning("apiserver unreachable (%s); retrying in %.1fs", e, delay)
            await asyncio.sleep(delay)
        except ApiError as e:
            log.warning("cannot tell who we are (%s); assuming an unrestricted identity", e)
            return ""
    user: str = review.get("status", {}).get("userInfo", {}).get("username", "")
    if user.startswith("system:node:"):
        own = user.removeprefix("system:node:")
        for node in nodes:
            node.settings.node_restricted = True
            if node.settings.name != own:
                log.error(
                    "running as %s, which may only manage node %s, not %s: use one agent "
                    "(or one identity) per node, or an identity with RBAC rights",
                    user,
                    own,
                    node.settings.name,
                )
        log.info("running as %s under the Node authorizer and NodeRestriction", user)
    return user
