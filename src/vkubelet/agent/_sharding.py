"""Sharding (`--shard`): replicas with the same list of nodes share them. The nodes are dealt into
a fixed number of buckets (64, or one per node below that), one Lease per bucket: a Lease write
per bucket and period rather than per node. Each replica also holds a membership Lease, so that
each knows how many replicas are alive and claims no more than its fair share of buckets,
ceil(buckets / replicas); a replica above it (others joined) hands the excess back. One list
request per round shows every Lease of the group: expiry is judged, as by the elector, on the
local clock from when a record last changed. Fencing is per bucket: every write made for a
node answers to its bucket's Lease only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import logging
import math
import time
from collections.abc import Iterable
from typing import Any, Protocol

from ..kube import KubeClient, KubeLeases, LeaderElector, LeaseStore, LeaseTiming
from ..node import AgentConfig, ConfigError, NodeFleet, NodeSpec
from ..sdk.tasks import TaskSet, run_supervised
from . import _providers
from ._leases import (
    FENCE,
    GROUP_LABEL,
    ROLE_LABEL,
    SHARD_BUCKETS,
    ReplicaOptions,
    group_of,
    lease_loop,
    lease_name,
    run_on,
)
from ._runner import NodeHost, NodeRunner

log = logging.getLogger(__name__)

JSON = dict[str, Any]

# A dead replica's membership Lease is deleted by the others after this many lease durations.
FORGET_MEMBER_AFTER = 10
# The pause between the starts of claimed nodes: building a node's provider and agent takes the
# event loop for milliseconds, and a hundred at once would hold up the heartbeats of the nodes
# already running (as the agent spreads its own nodes' starts). A round's starts are spread over
# START_SPREAD_TOTAL at most: at 50 ms each, taking over 500 nodes took 25 s of pauses alone,
# and the Lease renewals no longer need them (the claims have their own event loop).
START_SPREAD_SECONDS = 0.05
START_SPREAD_TOTAL = 8.0


def start_spread(nodes: int) -> float:
    """The pause between the starts of `nodes` nodes claimed in one round."""
    return min(START_SPREAD_SECONDS, START_SPREAD_TOTAL / nodes) if nodes else START_SPREAD_SECONDS


def shard_timing() -> LeaseTiming:
    """A longer Lease than a single leader's: a replica runs hundreds of nodes, and a renewal
    on a busy host can take seconds; a dead replica's nodes are still taken within ~25 s. The
    deadline leaves one period (4 s) between the moment a replica stops writing and the
    earliest moment another may take the bucket (one duration after the last renewal)."""
    return LeaseTiming(duration=20.0, renew_deadline=16.0, retry=4.0)


class ShardStore(LeaseStore, Protocol):
    """The Lease API as sharding uses it: one list per round shows every Lease of the group."""

    async def list(self, namespace: str, selector: str) -> list[JSON]: ...

    async def delete(self, namespace: str, name: str) -> None: ...


def buckets_of(names: Iterable[str], count: int = SHARD_BUCKETS) -> list[list[str]]:
    """The nodes dealt into `min(count, len(names))` buckets, sorted names round-robin: every
    replica of a group (the same names) deals them alike, and sizes differ by one at most (a
    hash would leave some buckets twice the size of others at a few nodes per bucket)."""
    ordered = sorted(names)
    count = max(1, min(count, len(ordered)))
    return [ordered[i::count] for i in range(count)]


class ShardRunner:
    """Claims this replica's share of the node buckets and runs the nodes of each bucket it
    holds while it holds the bucket's Lease (fencing per bucket, as for a single leader)."""

    def __init__(self, host: NodeHost, specs: list[NodeSpec], options: ReplicaOptions) -> None:
        """`specs` as configured: no provider built from them yet."""
        self._host = host
        self._specs = {spec.settings.name: spec for spec in specs}
        self.options = options
        self.group = group_of(list(self._specs))
        self.buckets = buckets_of(self._specs, options.buckets)
        self._store: ShardStore | None = None
        self.electors: list[LeaderElector] = []  # one per bucket
        self._members: dict[str, LeaderElector] = {}  # lease name -> an observer of it
        self._member: LeaderElector | None = None
        self.running: dict[int, asyncio.Task[None]] = {}  # bucket -> its hold, until stopped
        self._nodes = TaskSet("shard", logger=log)  # the holds, on the claims' loop
        self._main: asyncio.AbstractEventLoop | None = None  # the nodes' loop

    def _elector(self, name: str, role: str) -> LeaderElector:
        assert self._store is not None
        return LeaderElector(
            self._store,
            namespace=self.options.namespace,
            identity=self.options.identity,
            name=name,
            timing=self.options.timing,
            labels={GROUP_LABEL: self.group, ROLE_LABEL: role},
        )

    def alive(self) -> int:
        """Replicas alive (this one included), as far as their membership Leases show."""
        return 1 + sum(1 for m in self._members.values() if m.held_by_other())

    def fair_share(self) -> int:
        """In buckets."""
        return math.ceil(len(self.buckets) / self.alive())

    def may_write(self) -> bool:
        """The fence of a write made outside any bucket's nodes (none of a node's own): none
        while any claim is past its deadline. A node's writes answer to its bucket only."""
        return all(e.holds() for e in self.electors if e.is_leader)

    async def run(self) -> None:
        """The claims run in a thread of their own, on an event loop of their own; the nodes
        run on this one. Measured: with a hundred nodes starting, this loop lagged by seconds
        on a loaded host, and a renewal (a request of several loop turns) queued behind node
        start-ups for longer than its deadline; the replicas fenced, restarted nodes, lagged
        again and never settled (3 replicas x 300 nodes). In a thread, a renewal waits for
        the GIL (released every 5 ms by a busy thread), not for every callback ready here."""
        self._main = asyncio.get_running_loop()
        async with lease_loop() as loop:
            await run_on(loop, self._run_with_own_client)

    async def _run_with_own_client(self) -> None:
        # The Leases have a client of their own, made on their loop: the agent's is fenced,
        # and its pools carry the nodes' traffic.
        async with KubeClient(self._host.client.config, self._host.config.client) as leases:
            await self._run(KubeLeases(leases))

    async def _run(self, store: ShardStore) -> None:
        self._store = store
        self.electors = [
            self._elector(lease_name("shard", self.group, str(index)), "bucket")
            for index in range(len(self.buckets))
        ]
        member_name = lease_name("member", self.group, self.options.identity)
        self._member = self._elector(member_name, "member")
        log.info(
            "sharding: %s joins group %s (%d nodes in %d buckets)",
            self.options.identity,
            self.group,
            len(self._specs),
            len(self.buckets),
        )
        try:
            await self._member.acquire()
            # Replicas starting together see each other before they claim anything.
            await asyncio.sleep(self.options.timing.retry)
            while True:
                started = time.monotonic()
                await self._round()
                await asyncio.sleep(max(0.0, self._round_period() - (time.monotonic() - started)))
        finally:
            await self._nodes.aclose()
            for elector in [*self.electors, self._member]:
                with contextlib.suppress(Exception):
                    await asyncio.shield(elector.release())

    async def _round(self) -> None:
        assert self._store is not None and self._member is not None
        await self._member.acquire()  # renews membership
        try:
            leases = await self._store.list(self.options.namespace, f"{GROUP_LABEL}={self.group}")
        except Exception as e:
            log.warning("sharding: cannot list the group's Leases: %s", e)
            return
        by_name = {(lease.get("metadata") or {}).get("name", ""): lease for lease in leases}
        for elector in self.electors:
            elector.observe(by_name.get(elector.name))
        await self._observe_members(leases)
        fair = self.fair_share()
        mine = sorted(self.running, key=self._preference)
        if len(mine) > fair:
            for index in mine[fair:]:  # the ones others prefer most are handed back first
                log.info("sharding: handing bucket %d back (fair share %d)", index, fair)
                await self._give_back(index)
            return
        free = [
            index
            for index, elector in enumerate(self.electors)
            if index not in self.running and not elector.held_by_other()
        ]
        free.sort(key=self._preference)
        wanted = free[: fair - len(mine)]
        won = await asyncio.gather(*(self.electors[index].acquire() for index in wanted))
        claimed = [index for index, ok in zip(wanted, won, strict=True) if ok]
        spread = start_spread(sum(len(self.buckets[index]) for index in claimed))
        delay = 0.0
        for index in claimed:
            self._claimed(index, delay=delay, spread=spread)
            delay += len(self.buckets[index]) * spread

    async def _observe_members(self, leases: list[JSON]) -> None:
        assert self._store is not None and self._member is not None
        seen: set[str] = set()
        for lease in leases:
            meta = lease.get("metadata")
            if not isinstance(meta, dict) or (meta.get("labels") or {}).get(ROLE_LABEL) != "member":
                continue
            name = str(meta.get("name"))
            if name == self._member.name:
                continue
            seen.add(name)
            observer = self._members.get(name)
            if observer is None:
                observer = self._members[name] = self._elector(name, "member")
            observer.observe(lease)
        for name in set(self._members) - seen:
            del self._members[name]
        for name, observer in list(self._members.items()):
            silent = time.monotonic() - observer.observed_at
            if silent > FORGET_MEMBER_AFTER * self.options.timing.duration:
                with contextlib.suppress(Exception):  # a replica gone long ago
                    await self._store.delete(self.options.namespace, name)

    def _round_period(self) -> float:
        """Half the renewal period: a round costs one list (and a membership renewal), and an
        expired Lease is then seen, and claimed, at most half a period late."""
        return self.options.timing.retry / 2

    def _preference(self, index: int) -> str:
        """Rendezvous order: each replica prefers different buckets, so that replicas claiming
        at the same moment rarely race for the same Lease."""
        return hashlib.sha256(
            f"{self.options.identity}/{self.electors[index].name}".encode()
        ).hexdigest()

    def _claimed(self, index: int, *, delay: float, spread: float) -> None:
        elector = self.electors[index]
        run_bucket = functools.partial(self._run_bucket, index, delay, spread)

        async def hold() -> None:
            try:
                await elector.hold(lambda: run_on(self._main, run_bucket))
            finally:
                self.running.pop(index, None)

        self.running[index] = self._nodes.spawn(hold(), name=f"shard bucket {index}")
        log.info(
            "sharding: %s claimed bucket %d (%d nodes)",
            self.options.identity,
            index,
            len(self.buckets[index]),
        )

    async def _give_back(self, index: int) -> None:
        task = self.running.pop(index, None)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # a cancellation of ours still reaches us
        await self.electors[index].release()

    async def _run_bucket(self, index: int, delay: float, spread: float) -> None:
        """The nodes of a bucket, each supervised (one failing does not stop the others), their
        starts spread. Every write made on their behalf (in this task or any it starts) answers
        to this bucket's Lease: `FENCE` is set in this task's context, which they inherit."""
        FENCE.set(self.electors[index].holds)
        async with asyncio.TaskGroup() as group:
            for offset, name in enumerate(self.buckets[index]):
                start = delay + offset * spread
                group.create_task(self._supervise(name, start), name=f"shard node {name}")

    async def _supervise(self, name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await run_supervised(
            functools.partial(self._run_node, name), name=f"shard node {name}", logger=log
        )

    async def _run_node(self, name: str) -> None:
        """One claimed node: a provider built now (reading the backend's state as the last
        holder left it), its node agent and kubelet API; all stopped when the claim ends."""
        spec = copy.deepcopy(self._specs[name])
        built = _providers.build_provider(spec, self._host.events)
        assert not isinstance(built, NodeFleet)  # refused at start
        await NodeRunner(self._host, [(spec.settings, built)]).run()


def check_shardable(config: AgentConfig, replicas: ReplicaOptions) -> None:
    """Sharding shares single nodes, each on a kubelet port of its own."""
    ports: dict[int, str] = {}
    for spec in config.nodes:
        name, port = spec.settings.name, spec.settings.kubelet_port
        if not config.kubelet_api:
            continue
        if port == replicas.health_port:
            raise ConfigError(
                f"{name}: with --shard the replica's /healthz has port {port} (--kubelet-port); "
                "give the node another kubeletPort (0: any free port)"
            )
        if port in ports:
            raise ConfigError(
                f"{name}: with --shard each node needs a kubeletPort of its own "
                f"({ports[port]} has {port} too; 0: any free port)"
            )
        ports[port] = name
