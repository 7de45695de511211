"""Replicas of the agent, coordinated by Kubernetes Leases and nothing else.

Leader election (`--leader-elect`): replicas with the same nodes compete for one Lease; the
holder runs a whole `Agent` (built afresh at each term, so that its providers read their
backend's state as the last leader left it, and adopt its pods), the others stand by. Losing
the Lease, or failing to renew it for the renew deadline, cancels that agent before any other
replica may take over (fencing): a partitioned leader stops writing on its own.

Sharding (`--shard`): replicas with the same list of nodes share them. The nodes are dealt into
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
import dataclasses
import functools
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from ..kube import KubeClient, KubeLeases, LeaderElector, LeaseStore, LeaseTiming, Unreachable
from ..kubelet import KubeletServer
from ..node import AgentConfig, NodeFleet, NodeSpec
from ..node._certs import ServingCertificate
from ..sdk.tasks import TaskSet, run_supervised
from . import _providers
from ._serving import KubeletApiReadiness, kubelet_node, start_servers
from ._standby import StandbyHealth
from ._supervision import run_node

if TYPE_CHECKING:
    from ._agent import Agent

log = logging.getLogger(__name__)

JSON = dict[str, Any]

GROUP_LABEL = "vkubelet.io/replica-group"
ROLE_LABEL = "vkubelet.io/replica-role"
# A dead replica's membership Lease is deleted by the others after this many lease durations.
FORGET_MEMBER_AFTER = 10
# The pause between the starts of claimed nodes: building a node's provider and agent takes the
# event loop for milliseconds, and a hundred at once would hold up the heartbeats of the nodes
# already running (as the agent spreads its own nodes' starts). A round's starts are spread over
# START_SPREAD_TOTAL at most: at 50 ms each, taking over 500 nodes took 25 s of pauses alone,
# and the Lease renewals no longer need them (the claims have their own event loop).
START_SPREAD_SECONDS = 0.05
START_SPREAD_TOTAL = 8.0
# Nodes are claimed in buckets: a Lease write per bucket and renewal period, not per node (at a
# thousand nodes per-node claims were 250 writes/s besides the nodes' own heartbeats).
SHARD_BUCKETS = 64

# The fence of the work under way in this task: set in a bucket's task, inherited by every task
# its nodes start (asyncio copies the context), read by `FencedClient` as each request leaves.
_FENCE: ContextVar[Callable[[], bool] | None] = ContextVar("vkubelet_fence", default=None)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    namespace: str
    identity: str
    timing: LeaseTiming
    shard: bool = False
    health_port: int = 0  # the standby's /healthz (0: none)
    buckets: int = SHARD_BUCKETS  # the same for every replica of a group


def start_spread(nodes: int) -> float:
    """The pause between the starts of `nodes` nodes claimed in one round."""
    return min(START_SPREAD_SECONDS, START_SPREAD_TOTAL / nodes) if nodes else START_SPREAD_SECONDS


def leader_timing() -> LeaseTiming:
    """client-go's proportions on a 10 s Lease (its default is 15 s): a standby sees the last
    renewal up to a period late and polls once a period, so a dead leader's node is taken over
    within ~13 s."""
    return LeaseTiming(duration=10.0, renew_deadline=7.0, retry=1.5)


def shard_timing() -> LeaseTiming:
    """A longer Lease than a single leader's: a replica runs hundreds of nodes, and a renewal
    on a busy host can take seconds; a dead replica's nodes are still taken within ~25 s. The
    deadline leaves one period (4 s) between the moment a replica stops writing and the
    earliest moment another may take the bucket (one duration after the last renewal)."""
    return LeaseTiming(duration=20.0, renew_deadline=16.0, retry=4.0)


def group_of(names: list[str]) -> str:
    """Replicas configured with the same nodes form one group (a label value: short)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:16]


def lease_name(*parts: str) -> str:
    """A Lease name (a DNS subdomain) from parts that may not be one (a hostname, say)."""
    raw = "-".join(("vkubelet", *parts)).lower()
    name = re.sub(r"[^a-z0-9.-]+", "-", raw).strip("-.")
    if len(name) > 200 or name != raw:
        name = f"{name[:180]}-{hashlib.sha256(raw.encode()).hexdigest()[:10]}"
    return name


class FencedClient(KubeClient):
    """The client of work done under a Lease: it sends no write once `may_write()` says no
    (the Lease's renew deadline passed), whatever task asks. The elector cancels that work too,
    but after a pause (SIGSTOP, a frozen VM) queued callbacks run in timer order as the process
    resumes, some before the elector's own: this check, made as each request leaves, catches
    those. Reads stay allowed: they change nothing."""

    may_write: Callable[[], bool] = staticmethod(lambda: True)  # set by `fenced_client`

    def _before_send(self, method: str) -> None:
        fence = _FENCE.get() or self.may_write
        if method != "GET" and not fence():
            raise Unreachable(f"{self.server}: fenced: this replica's Lease expired")


def fenced_client(config: AgentConfig, may_write: Callable[[], bool]) -> FencedClient:
    """Made as the agent makes its client (the same kubeconfig, in-cluster rules and options)."""
    client = FencedClient.from_kubeconfig(config.kubeconfig, options=config.client)
    assert isinstance(client, FencedClient)
    client.may_write = may_write
    return client


# -- one leader -------------------------------------------------------------------------------
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
            agent.use_client(fenced_client(agent.config, holds))
            await agent.run()
        finally:
            if health is not None:
                await health.start()

    async def campaign() -> None:  # on the Leases' loop
        nonlocal elector
        client = KubeClient.from_kubeconfig(config.kubeconfig, options=config.client)
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
            await client.aclose()

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
    from ._agent import Agent

    pristine = copy.deepcopy(config)
    return Agent(config), lambda: Agent(copy.deepcopy(pristine))


# -- sharding ---------------------------------------------------------------------------------
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


@contextlib.asynccontextmanager
async def lease_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, for as long as the context lasts."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vkubelet leases", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()


async def run_on(
    loop: asyncio.AbstractEventLoop | None, work: Callable[[], Awaitable[None]]
) -> None:
    """Run `work()` as a task on `loop` (another thread's, or this one) until it ends; its error
    is raised here. Cancelled, it cancels that task and waits for its end: work under a Lease
    has stopped when this returns."""
    here = asyncio.get_running_loop()
    there = loop or here
    ended: asyncio.Future[None] = here.create_future()
    started: list[asyncio.Task[None]] = []

    def settle(task: asyncio.Task[None]) -> None:
        if ended.done():
            return
        if task.cancelled():
            ended.cancel()
        elif (error := task.exception()) is not None:
            ended.set_exception(error)
        else:
            ended.set_result(None)

    def start() -> None:
        task = there.create_task(_call(work))
        task.add_done_callback(lambda t: here.call_soon_threadsafe(settle, t))
        started.append(task)

    there.call_soon_threadsafe(start)
    try:
        await asyncio.shield(ended)
    except asyncio.CancelledError:
        if not ended.done():  # cancelled here: stop it there (after `start`: FIFO), await it
            there.call_soon_threadsafe(lambda: started[0].cancel())
            while not ended.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(ended)
        raise


async def _call(work: Callable[[], Awaitable[None]]) -> None:
    await work()


class ShardRunner:
    """Claims this replica's share of the node buckets and runs the nodes of each bucket it
    holds while it holds the bucket's Lease (fencing per bucket, as for a single leader)."""

    def __init__(self, agent: Agent, specs: list[NodeSpec], options: ReplicaOptions) -> None:
        """`specs` as configured: no provider built from them yet."""
        self._agent = agent
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
        leases = KubeClient(self._agent.client.config, self._agent.config.client)
        try:
            await self._run(KubeLeases(leases))
        finally:
            await leases.aclose()

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

    def holder_of(self, node: str) -> LeaderElector:
        """The elector of the bucket a node belongs to."""
        return next(self.electors[i] for i, names in enumerate(self.buckets) if node in names)

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
        to this bucket's Lease: `_FENCE` is set in this task's context, which they inherit."""
        _FENCE.set(self.electors[index].holds)
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
        agent = self._agent
        spec = copy.deepcopy(self._specs[name])
        built = _providers.build_provider(spec, agent.events)
        assert not isinstance(built, NodeFleet)  # refused at start
        settings = spec.settings
        readiness = KubeletApiReadiness(settings.kubelet_port) if agent.config.kubelet_api else None
        node = agent.make_node(settings, built, readiness)
        servers: list[KubeletServer] = []
        certificates: list[ServingCertificate | None] = []

        async def serve(readiness: KubeletApiReadiness) -> None:
            """Certificate, listen, renew: retried on its own (as `_serve_port` is), so a CSR
            the apiserver was too busy for does not restart the node and pause its heartbeats
            (a dead replica's nodes, claimed at once, ask for theirs together)."""
            if not servers:  # once listening, a retry never binds again
                context, certificate = await agent.tls_context(
                    name, settings.address_list(), readiness.waiting_for
                )
                started = await start_servers(
                    [kubelet_node(node, settings.kubelet_port)],
                    context,
                    agent.kubelet_auth(),
                    readiness,
                )
                servers.extend(started)
                certificates.append(certificate)
            if certificates[0] is not None:
                await certificates[0].renew_forever()  # a node held past its certificate's life

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(run_node(node))
                if readiness is not None:
                    work = functools.partial(serve, readiness)
                    group.create_task(
                        run_supervised(work, name=f"kubelet API of {name}", logger=log)
                    )
        finally:
            for server in servers:
                await server.close()
            agent.forget_node(node)
            await agent.close_provider(built)
