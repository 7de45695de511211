"""Leader election (`--leader-elect`): replicas with the same nodes compete for one Lease; the
holder runs a whole `Agent` (built afresh at each term, so that its providers read their
backend's state as the last leader left it, and adopt its pods), the others stand by. Losing
the Lease, or failing to renew it for the renew deadline, cancels that agent before any other
replica may take over (fencing): a partitioned leader stops writing on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Callable

from ..kube import KubeClient, KubeLeases, LeaderElector, LeaseTiming
from ..node import AgentConfig
from ._agent import Agent
from ._identity import lease_kubeconfig
from ._leases import (
    GROUP_LABEL,
    ROLE_LABEL,
    ReplicaOptions,
    fenced_client,
    group_of,
    lease_loop,
    lease_name,
    run_on,
)
from ._standby import StandbyHealth

log = logging.getLogger(__name__)


def leader_timing() -> LeaseTiming:
    """client-go's proportions on a 10 s Lease (its default is 15 s): a standby sees the last
    renewal up to a period late and polls once a period, so a dead leader's node is taken over
    within ~13 s."""
    return LeaseTiming(duration=10.0, renew_deadline=7.0, retry=1.5)


async def run_leader_elected(
    validated: Agent, make_agent: Callable[[], Agent], options: ReplicaOptions
) -> None:
    """Campaign; while leading run a fresh agent; stand by (serving /healthz) otherwise.

    The Lease is renewed on a loop of its own, in a thread, as the shards' are (`ShardRunner`
    says why): an agent whose loop lags by seconds under load would otherwise miss its renew
    deadline, fence itself and restart every node for nothing."""
    await validated.discard()
    config = validated.config
    names = [spec.settings.name for spec in config.nodes]
    main = asyncio.get_running_loop()
    elector: LeaderElector | None = None  # made on the Leases' loop, with its client

    def leading() -> bool:
        return elector is not None and elector.is_leader

    def holds() -> bool:
        return elector is not None and elector.holds()

    ports = {spec.settings.kubelet_port for spec in config.nodes} if config.kubelet_api else set()
    health = StandbyHealth(options.health_port, leading) if options.health_port else None
    shares_port = health is not None and health.port in ports

    async def lead() -> None:  # on this loop
        if health is not None and shares_port:
            await health.close()  # the kubelet API takes the port (and answers /healthz)
        try:
            agent = make_agent()
            kubeconfig = await agent.own_kubeconfig()  # a node identity: obtained now
            agent.use_client(fenced_client(kubeconfig, agent.config.client, holds))
            await agent.run()
        finally:
            if health is not None:
                await health.start()

    async def campaign() -> None:  # on the Leases' loop
        nonlocal elector
        lease_config = lease_kubeconfig(config)
        async with KubeClient.from_kubeconfig(lease_config, options=config.client) as client:
            elector = LeaderElector(
                KubeLeases(client),
                namespace=options.namespace,
                identity=options.identity,
                name=lease_name("agent", names[0] if len(names) == 1 else group_of(names)),
                timing=options.timing,
                labels={GROUP_LABEL: group_of(names), ROLE_LABEL: "leader"},
            )
            log.info("leader election: %s stands by for Lease %s", options.identity, elector.name)
            try:
                await elector.run(lambda: run_on(main, lead))
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(elector.release())

    try:
        if health is not None:
            await health.start()
        async with lease_loop() as loop:
            await run_on(loop, campaign)
    finally:
        if health is not None:
            await health.close()


def agent_factory(config: AgentConfig) -> tuple[Agent, Callable[[], Agent]]:
    """An agent built now, which validates the config (loudly, at start) and is then discarded
    unrun, and the maker of each term's agent, from a pristine copy of the config (building
    providers changes it): built when the term starts, its providers read the backend then."""
    pristine = copy.deepcopy(config)
    return Agent(config), lambda: Agent(copy.deepcopy(pristine))
