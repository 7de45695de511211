"""The vkubelet process: node agents, their kubelet API servers and certificates, one event loop.

This package sits above both `vkubelet.node` (node and pod controllers) and `vkubelet.kubelet`
(the HTTPS API), which do not know each other. Each concern has a module of its own:

- `_agent`: the `Agent`, which puts the others together and stops them in order;
- `_identity`: the agent's own client identity (bootstrap token, renewal) and who it is;
- `_serving`: each kubelet port's serving certificate, server and readiness condition;
- `_clientca`: the CA that the kubelet API trusts for the apiserver's client certificate;
- `_providers`: building providers (entry point, module or file) and routing their events;
- `_runner`: one node run (its agent and kubelet API), however the process came to run it;
- `_fleet`: fleets of nodes that come and go, and the drain of a node that left;
- `_leases`: what replicas share to coordinate through Leases (names, fencing, their own loop);
- `_leader`: leader election between replicas, each term a whole `Agent`;
- `_sharding`: sharing nodes between replicas, in buckets claimed through Leases;
- `_standby`: the `/healthz` a replica answers while it runs no node on the kubelet port.
"""

from ._agent import Agent
from ._leader import agent_factory, leader_timing, run_leader_elected
from ._leases import ReplicaOptions
from ._providers import NodeEventRouter, build_provider
from ._sharding import shard_timing

__all__ = [
    "Agent",
    "NodeEventRouter",
    "ReplicaOptions",
    "agent_factory",
    "build_provider",
    "leader_timing",
    "run_leader_elected",
    "shard_timing",
]
